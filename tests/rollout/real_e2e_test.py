"""End to end on the real engine and trainer, 8 virtual CPU devices: a short dora run of a
bfloat16 model (float32 master weights on the trainer, bfloat16 copies on the instances)."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax import models
from dora_jax.engine import Engine
from dora_jax.rollout import audit_lib, request_lib, runner_lib
from dora_jax.rollout.config_lib import RolloutConfig
from dora_jax.runtime import devices_lib
from dora_jax.train import TrainConfig, Trainer


@pytest.mark.slow
def test_dora_on_the_real_engine_and_trainer(tmp_path):
    plan = devices_lib.plan_devices(train_devices=2, num_instances=3, devices_per_instance=2)
    model_config = models.ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        qk_norm=True,
    )
    model = models.create(model_config, seed=0, param_dtype=jnp.float32, dtype=jnp.bfloat16)
    config = RolloutConfig(
        mode="dora",
        train_batch_size=8,
        rollout_batch_size=24,
        group_size=4,
        staleness_bound=2,
        num_iterations=6,
        timer_steps=2,
        publish_delay_steps=2,
    )
    engines = [
        Engine(
            model, max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=32, mesh=mesh
        )
        for mesh in plan.generation_meshes
    ]
    trainer = Trainer(
        model,
        TrainConfig(tbs=8, group_size=4, learning_rate=1e-4, length_buckets=(64,)),
        plan.train_mesh,
    )
    prompts = request_lib.heavy_tail_prompts(
        seed=0, group_size=4, vocab_size=64, median_length=6, max_length=32
    )
    rollout = runner_lib.Rollout(
        config,
        engines,
        trainer,
        prompts,
        request_lib.per_sample(lambda pid, toks: float((toks == 3).mean())),
        str(tmp_path),
    )
    metrics = rollout.run()
    # Every version moved and was held in bfloat16: 2 bytes a parameter, half the trainer's.
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    assert {x.dtype for x in jax.tree.leaves(trainer.params)} == {np.dtype("float32")}
    moved = [(m["weight_move_bytes"], m["weight_moves"]) for m in metrics if m["weight_moves"]]
    assert moved and all(b == 2 * n_params * n for b, n in moved)
    held = [x.params.state for x in rollout.instances if x.params is not None]
    held += list(rollout.staged.values())
    assert {x.dtype for tree in held for x in jax.tree.leaves(tree)} == {np.dtype(jnp.bfloat16)}
    report = audit_lib.audit(str(tmp_path))
    assert report.passed, report.format()
    assert len(metrics) == 6 and trainer.version == 6
    assert rollout.totals["migrations"] >= 1
    with open(tmp_path / "trace.json") as f:
        events = json.load(f)["traceEvents"]
    spans: dict[int, list] = {}
    for e in events:
        if e["ph"] == "X" and e["name"].startswith("decode v"):
            spans.setdefault(e["tid"], []).append(
                (e["ts"], e["ts"] + e["dur"], e["args"]["version"])
            )
    assert any(
        a[0] < b[1] and b[0] < a[1] and a[2] != b[2]
        for i, j in itertools.combinations(spans, 2)
        for a in spans[i]
        for b in spans[j]
    )
