"""Builds a rollout run on the doubles: N instances of S slots over the virtual devices; or a
`dora-jax bench` entry's run on them, whose schedule is the real bench's
(`bench_lib_test` checks it; `benchmarks/rollout_schedule.py` prints it)."""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
from hypothesis import strategies as st
from rollout_doubles import EngineDouble, TrainerDouble

from dora_jax.models import sharding_lib
from dora_jax.rollout import bench_lib, request_lib, runner_lib
from dora_jax.rollout.config_lib import RolloutConfig


def make_rollout(
    workdir: str,
    *,
    num_instances: int = 3,
    slots: int = 4,
    fail: dict[int, int] | None = None,  # instance -> decode steps before its engine raises
    fail_prefill: dict[int, int] | None = None,  # instance -> prefill calls before it raises
    fail_on_readback: bool = False,  # decode failures raise on read-back, not at dispatch
    median_length: int = 6,
    max_length: int = 80,
    checkpoint_every: int = 0,
    on_checkpoint=None,
    resume: dict | None = None,
    stop_strings: tuple[str, ...] = (),  # matched on the tokens' text as `double_text` gives it
    text_stream=lambda: double_text,  # noqa: B008 - the text streams of stop strings
    **config,
) -> tuple[runner_lib.Rollout, TrainerDouble, list[EngineDouble]]:
    cfg = RolloutConfig(**config)
    engines = [
        EngineDouble(
            _instance_mesh(i),
            max_concurrent_decodes=slots,
            fail_after_steps=(fail or {}).get(i),
            fail_after_prefills=(fail_prefill or {}).get(i),
            fail_on_readback=fail_on_readback,
        )
        for i in range(num_instances)
    ]
    trainer = _trainer(cfg)
    if resume is not None:
        trainer.restore_version(resume["newest"])
    prompts = request_lib.heavy_tail_prompts(
        seed=cfg.seed,
        group_size=cfg.group_size,
        vocab_size=64,
        median_length=median_length,
        max_length=max_length,
    )
    if stop_strings:
        forced = prompts
        prompts = lambda i: dataclasses.replace(  # noqa: E731
            forced(i), stop_strings=stop_strings, text_stream=text_stream
        )
    rollout = runner_lib.Rollout(
        cfg,
        engines,
        trainer,
        prompts,
        request_lib.per_sample(lambda pid, toks: float(len(toks) % 2)),
        workdir,
        checkpoint_every=checkpoint_every,
        on_checkpoint=on_checkpoint,
        resume=resume,
    )
    return rollout, trainer, engines


# The text of the double's tokens, for stop strings: some tokens are two characters and some
# none (a byte-level token that ends in the middle of a character), as with real tokenizers.
TOKEN_TEXT = ("", "a", "b", "c", "d", "ab")


def double_text(token: int) -> str:
    return TOKEN_TEXT[token % len(TOKEN_TEXT)]


def bench_schedule(config: ml_collections.ConfigDict, entry: str, workdir: str) -> dict[str, float]:
    """Runs the `dora-jax bench` entry `entry` (`mode` or `mode@variant`) of `config` on the
    doubles: the bench's workload, instances, slots, engine lengths and rollout settings, a
    trainer that publishes at once. Returns `bench_lib.schedule_figures` of the run; its ledger
    is in `workdir`."""
    cfg = bench_lib.rollout_configs(config)[entry]
    w = config.workload
    engines = [
        EngineDouble(
            _instance_mesh(i),
            max_concurrent_decodes=config.engine.slots,
            max_prefill_length=w.prompt_length + w.max_length,
            max_decode_length=w.max_length,
            cache_length=w.prompt_length + w.max_length,
        )
        for i in range(config.runtime.num_instances)
    ]
    prompts = bench_lib.workload(config, config.seed, cfg.num_iterations)
    rollout = runner_lib.Rollout(cfg, engines, _trainer(cfg), prompts, _no_reward, workdir)
    return bench_lib.schedule_figures(rollout.run())


def _instance_mesh(i: int) -> jax.sharding.Mesh:
    """Instance i's one-device mesh: the devices after the trainer's, in turn (the doubles
    compute next to nothing, so instances may share one)."""
    devices = jax.devices()
    return sharding_lib.make_mesh([devices[1 + i % (len(devices) - 1)]], 1, 1)


def _no_reward(batch):
    return [0.0] * len(batch)


def _trainer(cfg: RolloutConfig) -> TrainerDouble:
    """The trainer double on the first device, checking batches against the mode's bound."""
    k, _ = runner_lib.paradigms_lib.PARADIGMS[cfg.mode]().bounds(cfg)
    return TrainerDouble(
        sharding_lib.make_mesh(jax.devices()[:1], 1, 1),
        train_batch_size=cfg.train_batch_size,
        group_size=cfg.group_size,
        staleness_bound=k,
    )


MODES = ("sync", "one_step_off", "partial", "dora")


@st.composite
def setups(draw, modes=MODES):
    """A random rollout set-up for `make_rollout`: modes, instance and slot counts, TBS, RBS,
    K, group sizes, trigger and publish timing, response lengths, stop strings."""
    g = draw(st.sampled_from([1, 2, 4]))
    tbs = g * draw(st.integers(1, 3))
    return dict(
        mode=draw(st.sampled_from(modes)),
        num_instances=draw(st.integers(1, 4)),
        slots=draw(st.integers(1, 6)),
        group_size=g,
        train_batch_size=tbs,
        rollout_batch_size=tbs + g * draw(st.integers(0, 3)),
        staleness_bound=draw(st.integers(0, 3)),
        num_iterations=draw(st.integers(2, 4)),
        timer_steps=draw(st.integers(1, 12)),
        publish_delay_steps=draw(st.integers(0, 6)),
        decode_steps_per_turn=draw(st.sampled_from([1, 1, 2, 4])),
        median_length=draw(st.integers(2, 10)),
        seed=draw(st.integers(0, 1000)),
        stop_strings=draw(st.sampled_from([(), (), ("abc",), ("ba", "dd")])),
    )
