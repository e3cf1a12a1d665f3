"""The application: a resume under another config refused before the ledger is cut, hosts
planned before any process starts, the CLI's flags, and a real tiny run end to end on the
files-and-checkpoint path (JSONL with malformed rows, an HF checkpoint directory with its
tokenizer, a user reward that sometimes raises), its engines in generation hosts of their own
(the in-process engines run in the resume tests and `make train`)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import app_rewards
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from dora_jax import app_lib, cli, models, settings_lib, task_lib
from dora_jax.config_fields_lib import ConfigError
from dora_jax.data import LongTailTask, load_tokenizer
from dora_jax.data.pipeline_lib import BadRowError, NoUsableRowsError
from dora_jax.observe import metrics_lib
from dora_jax.rollout import audit_lib, ledger_lib
from dora_jax.runtime import hosts_lib
from dora_jax.train.checkpoint_lib import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TINY_MODEL = models.ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                 num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)  # fmt: skip


def _saved_run(workdir, config) -> dict:
    """A checkpoint of version 3 in `workdir` saved under `config` (its state a stand-in: only
    the config it holds is read before these refusals); returns its meta."""
    checkpointer = Checkpointer(str(workdir / "checkpoints"))
    meta = {"config": settings_lib.run_defining_fields(config)}
    checkpointer.save(3, train_state={"w": np.zeros(2)}, data_iterator=None, meta=meta)
    checkpointer.close()
    return meta


def test_resuming_under_another_config_is_refused_before_the_ledger_is_cut(tmp_path):
    config = default.get_config()
    meta = _saved_run(tmp_path, config)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"event": "start"}\n{"event": "dispatch"}\n')
    config.rollout.group_size = 4
    config.rollout.num_iterations = 600  # may change: running on for longer is a resume
    with pytest.raises(ValueError, match=r"another config \(rollout\.group_size: 8 -> 4\)"):
        app_lib.train_and_evaluate(config, str(tmp_path), progress=False)
    assert ledger.read_text() == '{"event": "start"}\n{"event": "dispatch"}\n'
    config.rollout.group_size = 8
    config.rollout.num_iterations = 2  # fewer than the saved run's: nothing to continue
    with pytest.raises(ConfigError, match=r"at version 3, past rollout\.num_iterations=2"):
        app_lib.train_and_evaluate(config, str(tmp_path), progress=False)
    assert ledger.read_text() == '{"event": "start"}\n{"event": "dispatch"}\n'
    config.reward.update(isolation="thread", workers=8)  # how rewards run, not what they score
    config.train.remat = "full"  # what the backward pass keeps: the same math
    settings_lib.check_same_run(meta["config"], config, str(tmp_path))  # nothing that defines it
    config.model.hidden_size = 32  # evaluation checks the model's fields only
    settings_lib.check_same_run(meta["config"], config, str(tmp_path), prefixes=("data.",))
    with pytest.raises(ValueError, match=r"model\.hidden_size: 64 -> 32"):
        settings_lib.check_same_run(meta["config"], config, str(tmp_path), prefixes=("model.",))


def test_eval_of_another_models_run_says_to_read_it_as_trained_not_to_continue_it(tmp_path):
    config = default.get_config()
    _saved_run(tmp_path, config)
    config.model.hidden_size = 32
    says = r"model\.hidden_size: 64 -> 32\); read it with the model settings it was trained"
    with pytest.raises(ConfigError, match=says):
        app_lib.evaluate_checkpoint(config, str(tmp_path))


@pytest.mark.parametrize(
    "value,named",
    [("local:0", "runtime.training_hosts"), ("gpu7", "runtime.training_hosts"),
     ("a:7100", "runtime.coordinator")],
)  # fmt: skip
def test_bad_training_hosts_fail_before_any_process_starts(value, named):
    config = default.get_config()
    config.runtime.training_hosts = value
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        app_lib.start_training_hosts(config)


def test_hosts_on_other_machines_take_no_devices_here(monkeypatch):
    monkeypatch.setenv(hosts_lib.KEY_VARIABLE, "secret")
    config = default.get_config()
    config.runtime.update(train_devices=8, train_tp=2, num_instances=4)  # 8 devices here
    with pytest.raises(ValueError, match=r"runtime\.num_instances=4"):
        settings_lib.validate(config)  # local engines would need 12
    config.runtime.generation_hosts = "g0:7100,g1:7100,g2:7100,g3:7100"
    settings = settings_lib.validate(config)
    assert settings.generation_hosts == ("g0:7100", "g1:7100", "g2:7100", "g3:7100")
    assert settings.plan.generation_meshes == () and settings.plan.train_mesh.devices.size == 8
    model = models.create(_TINY_MODEL)
    (evaluation,) = app_lib.make_engines(config, model, settings.plan, eos_ids=(1,))
    assert evaluation.mesh is settings.plan.train_mesh


def test_eval_refuses_a_workdir_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        app_lib.evaluate_checkpoint(default.get_config(), str(tmp_path / "no_such_run"))
    assert not (tmp_path / "no_such_run").exists()


@pytest.mark.parametrize("version, says", [(None, "holds no checkpoint"), (3, r"it has \[\]")])
def test_reading_a_workdir_without_checkpoints_leaves_it_as_it_was(tmp_path, version, says):
    """Orbax's manager creates the directory it is given; `export` and `eval` only read."""
    with pytest.raises(ConfigError, match=says):
        app_lib.export_checkpoint(default.get_config(), str(tmp_path), version)
    assert list(tmp_path.iterdir()) == []


def test_a_second_train_in_a_workdir_in_use_is_refused(tmp_path, monkeypatch):
    """A job requeued while the old one still ran: both trained, mixing checkpoints, metrics
    and summary. The lock is the kernel's, so a killed run leaves none behind."""
    held = app_lib._lock_workdir(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"another dora-jax train is running in it \(pid "
                       rf"{os.getpid()} on "):  # fmt: skip
        app_lib.train_and_evaluate(default.get_config(), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    held.close()
    app_lib._lock_workdir(str(tmp_path)).close()  # free again

    def refuse(config):
        raise ConfigError("refused after the lock was taken")

    monkeypatch.setattr(app_lib, "reward_runner", refuse)
    with pytest.raises(ConfigError, match="after the lock") as refused:
        app_lib.train_and_evaluate(default.get_config(), str(tmp_path))
    # A run that failed lets the lock go, though its traceback (`refused`) is still alive.
    app_lib._lock_workdir(str(tmp_path)).close()
    assert refused.traceback
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="a file, not a directory"):
        app_lib.train_and_evaluate(default.get_config(), str(tmp_path / "file"))


def test_export_refuses_an_out_that_would_overwrite_something(tmp_path):
    config = default.get_config()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    config.model.checkpoint = str(tmp_path / "model")
    (tmp_path / "notes.txt").write_text("")
    refusals = [
        (tmp_path / "notes.txt", "a file, not a directory"),
        (tmp_path / "model", "is model.checkpoint"),
        (tmp_path / "checkpoints" / "x", "inside the run's checkpoints"),
    ]
    for out, says in refusals:
        with pytest.raises(ConfigError, match=says):
            app_lib.export_checkpoint(config, str(tmp_path), out=str(out))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    "override, says",
    [
        ("--config.rollout.group_size=7", "rollout.train_batch_size=64: must be a multiple of"),
        ("--config.rollout.mdoe=dora", "names no field of the config: 'mdoe'; Did you mean"),
        ("--config.data.source=files", "data.train_files='' must name at least one file"),
        ("--config.model.checkpoint=/no/such/model", "not a Hugging Face model directory"),
        ("--config.data.template=chat", "data.template='chat' needs model.checkpoint"),
    ],
)
def test_cli_reports_a_bad_field_in_one_line_and_exits_non_zero(tmp_path, override, says):
    """A refused config is its message alone: a traceback would bury the field it names."""
    result = subprocess.run(
        [sys.executable, "-m", "dora_jax.cli", "train", "--config=configs/default.py", override,
         f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("dora-jax: ") and says in line, result.stderr
    assert not (tmp_path / "run").exists()


def test_cli_keeps_the_traceback_of_a_bug_in_user_code(tmp_path):
    """Only refusals are one line: an error raised in a config file or a reward module the
    config names is a bug to debug, shown with its traceback."""
    (tmp_path / "broken_config.py").write_text("def get_config():\n    return {}['x']\n")
    (tmp_path / "broken_reward.py").write_text(
        "LIMIT = int('1e3')\n\ndef score(prompt, response, answer):\n    return 0.0\n"
    )
    command = [sys.executable, "-m", "dora_jax.cli", "train", f"--workdir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    for args, error in [
        ([f"--config={tmp_path / 'broken_config.py'}"], "KeyError: 'x'"),
        (["--config=configs/default.py", "--config.reward.name=broken_reward:score"],
         "ValueError: invalid literal for int()"),
    ]:  # fmt: skip
        result = subprocess.run(command + args, cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        assert result.returncode == 1
        assert "Traceback" in result.stderr and error in result.stderr, result.stderr[-2000:]
        assert "dora-jax: " not in result.stderr


def test_cli_help_lists_its_flags_and_host_flags_are_refused_elsewhere():
    """`--help` listed nothing (absl shows the flags of `__main__`, the console script), and
    `train --num_cpu_devices=2` ran on the config's 8 devices without a word."""
    command = [sys.executable, "-m", "dora_jax.cli"]

    def shown(*asked: str) -> str:
        result = subprocess.run(command + list(asked), cwd=ROOT, capture_output=True, text=True,
                                timeout=120)  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    for asked in (["train", "--help"], ["--help"]):
        assert "--workdir" in shown(*asked) and "--config" in shown(*asked)
    # Each command's help is its own: what it does and only the flags it takes.
    assert "--version" not in shown("train", "--help")
    assert "--version" in shown("export", "--help")
    assert "--address" in shown("host", "--help") and "--config" not in shown("host", "--help")
    assert "ledger.jsonl" in shown("audit", "-h") and "--" not in shown("audit", "-h")
    refused = subprocess.run(
        command + ["eval", "--config=configs/default.py", "--num_cpu_devices=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0 and "--config.num_cpu_devices" in refused.stderr
    refused = subprocess.run(  # `eval --version=2` scored the newest checkpoint, not version 2
        command + ["eval", "--config=configs/default.py", "--version=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0 and "`dora-jax export`'s flag" in refused.stderr
    assert "--version" in shown("--help") and "export" in shown("--help")


# `dora-jax train`, stopped by SIGTERM (a preemption, `timeout`, Slurm, Kubernetes) while its
# checkpoint 2 is being written.
_INTERRUPTED_AT_ITERATION_3 = """
import os
import signal
import sys
from dora_jax import cli
from dora_jax.train import checkpoint_lib

save = checkpoint_lib.Checkpointer.save

def save_then_interrupt(self, step, **items):
    save(self, step, **items)  # orbax goes on writing in the background
    if step == 2:
        os.kill(os.getpid(), signal.SIGTERM)

checkpoint_lib.Checkpointer.save = save_then_interrupt
sys.argv = ["dora-jax", "train", "--config=configs/default.py", "--workdir=" + sys.argv[1],
            "--config.sft.steps=2", "--config.rollout.num_iterations=4",
            "--config.rollout.train_batch_size=8", "--config.rollout.rollout_batch_size=16",
            "--config.engine.slots=4", "--config.eval.num_prompts=4",
            "--config.eval.samples_per_prompt=1", "--config.checkpoint.every=2"]
cli.run()
"""


@pytest.mark.slow
def test_a_run_interrupted_keeps_the_checkpoint_it_was_writing(tmp_path):
    """Checkpoints save in the background: a run interrupted while one was being written lost
    it (left as a tmp directory), and its restart began again from scratch. SIGTERM stops a
    run as Ctrl-C does (it killed it outright, without the ledger's end event), with one line
    that says how to go on."""
    died = subprocess.run([sys.executable, "-c", _INTERRUPTED_AT_ITERATION_3, str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert died.returncode == 130, died.stderr[-2000:]
    (line,) = [line for line in died.stderr.splitlines() if line.startswith("dora-jax")]
    assert (
        line == "dora-jax train: interrupted (the same command resumes from the newest checkpoint)"
    )
    assert "Traceback" not in died.stderr
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name]
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 2
    end = list(ledger_lib.read(str(tmp_path)))[-1]
    assert end["event"] == "end" and end["stopped"].startswith("KeyboardInterrupt")


def test_cli_refuses_stray_arguments(tmp_path):
    """`train --config=... extra` ran the whole default run, the word ignored; `audit A B`
    audited A alone."""
    command = [sys.executable, "-m", "dora_jax.cli"]
    for args, stray in [(["train", "--config=configs/default.py", "extra"], "['extra']"),
                        (["audit", str(tmp_path), "other"], "['other']")]:  # fmt: skip
        refused = subprocess.run(command + args + [f"--workdir={tmp_path / 'run'}"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
        assert refused.returncode == 1
        assert refused.stderr.strip().endswith(f"unexpected argument(s) {stray}"), refused.stderr
    assert not (tmp_path / "run").exists()


def test_a_workdir_that_is_not_a_local_directory_is_refused():
    with pytest.raises(ValueError, match="gs://bucket/run.*local directory"):
        app_lib.train_and_evaluate(default.get_config(), "gs://bucket/run")


@pytest.mark.slow
def test_partial_runs_through_the_app_re_prefilling_past_the_prompt_limit(tmp_path):
    """partial re-prefills prompt + generated-so-far at each weight update: with prefill sized
    for prompts alone, the first update took out every instance and the run died."""
    config = default.get_config()
    config.rollout.update(mode="partial", num_iterations=3, train_batch_size=8,
                          rollout_batch_size=16, group_size=4)  # fmt: skip
    config.sft.steps = 2
    config.engine.slots = 4
    config.eval.update(num_prompts=4, samples_per_prompt=1)
    summary = app_lib.train_and_evaluate(config, str(tmp_path), progress=False)
    assert summary["iterations"] == 3
    with open(tmp_path / "metrics.jsonl") as f:
        assert sum(record.get("reprefills", 0) for record in map(json.loads, f)) > 0
    report = audit_lib.audit(str(tmp_path))
    # Tokens of one trajectory from several versions: C1 fails by design, nothing else does.
    assert {rule for rule, ok in report.rules.items() if not ok} == {"C1"}


@pytest.mark.slow
@pytest.mark.parametrize("hosts", ["", "local"], ids=["in_process", "generation_hosts"])
def test_a_lora_run_trains_adapters_alone_and_exports_them_merged(tmp_path, hosts):
    """`model.lora_rank` end to end, its engines in this process or in generation hosts of
    their own: the warm-up and RL move the adapters alone (the exported policy is the seed's
    base weights plus the checkpoint's adapters merged, in numpy), the run keeps C1-C3, and
    every publish and every weight move after an instance's first carries the adapters alone
    (onto generation hosts too)."""
    config = default.get_config()
    config.model.update(lora_rank=4, lora_alpha=8.0, lora_targets="q_proj,v_proj,down_proj")
    config.rollout.update(num_iterations=4, train_batch_size=8, rollout_batch_size=16,
                          group_size=4)  # fmt: skip
    config.sft.steps = 3
    config.train.learning_rate = 1e-3
    config.engine.slots = 4
    config.eval.update(num_prompts=4, samples_per_prompt=1)
    config.checkpoint.every = 2
    config.runtime.generation_hosts = hosts
    app_lib.train_and_evaluate(config, str(tmp_path), progress=False)
    assert all(audit_lib.audit(str(tmp_path)).rules.values())

    vocab = LongTailTask().tokenizer().vocab_size
    # The built-in task's tokenizer is written along: the policy reloads as a model.checkpoint.
    assert load_tokenizer(str(tmp_path / "hf_policy")).vocab_size == vocab
    shape = settings_lib.model_shape(config)
    model_config = models.ModelConfig(vocab_size=vocab, **shape)
    base = models.create(model_config, seed=config.seed)
    lora = models.LoRAConfig(4, 8.0, ("q_proj", "v_proj", "down_proj"))
    _, like = models.Functional.of(models.create(model_config, seed=config.seed, lora=lora))
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    trained = {k: np.asarray(v[...]) for k, v in
               nnx.to_flat_state(checkpointer.restore_params(4, like))}  # fmt: skip
    checkpointer.close()
    written = _tensors(tmp_path / "hf_policy")
    merged = 0
    for key, weight in nnx.to_flat_state(nnx.state(base)):
        name = ".".join(map(str, key)).replace("layers.", "model.layers.")
        if key[-1] == "kernel":
            name = name.removesuffix(".kernel") + ".weight"
            want = np.asarray(weight[...])
            if (*key[:-1], "lora_a") in trained:
                a, b = trained[(*key[:-1], "lora_a")], trained[(*key[:-1], "lora_b")]
                assert np.abs(b).max() > 0, key  # trained
                want = want + lora.scale * a @ b
                merged += 1
            np.testing.assert_allclose(written[name], want.T, rtol=1e-5, atol=1e-6)
        elif key[0] == "layers":
            np.testing.assert_array_equal(written[name], np.asarray(weight[...]), err_msg=name)
    assert merged == 3 * model_config.num_layers
    # The adapters alone, in PEFT's layout (torch's Linear weights: A [r, in], B [out, r]).
    adapter = _tensors(tmp_path / "hf_policy" / "adapter", "adapter_model.safetensors")
    assert len(adapter) == 2 * merged
    for key, value in trained.items():
        if key[-1] in ("lora_a", "lora_b"):
            name = "base_model.model.model." + ".".join(map(str, key[:-1]))
            name += ".lora_A.weight" if key[-1] == "lora_a" else ".lora_B.weight"
            np.testing.assert_array_equal(adapter[name], value.T, err_msg=name)
    np.testing.assert_array_equal(written["model.embed_tokens.weight"], base.embed_tokens[...])
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    moves = sum(r.get("weight_moves", 0) for r in records)
    moved = sum(r.get("weight_move_bytes", 0) for r in records)
    whole = sum(x.nbytes for x in jax.tree.leaves(like))
    adapters = sum(x.nbytes for x in jax.tree.leaves(nnx.filter_state(like, nnx.LoRAParam)))
    first = config.runtime.num_instances
    assert moves > first and moved == first * whole + (moves - first) * adapters
    # Each version is published onto the base of the instance it is staged on, or for
    # generation hosts the trainer's own.
    assert [r["publish_bytes"] for r in records] == [adapters] * len(records)
    # `dora-jax export` and `eval` restore the LoRA checkpoint onto the adapted model.
    exported = _tensors(app_lib.export_checkpoint(config, str(tmp_path)))
    for name, value in written.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    assert app_lib.evaluate_checkpoint(config, str(tmp_path))["version"] == 4


def test_stop_strings_end_rollout_and_held_out_responses_at_their_first_match(tmp_path):
    """`engine.stop_strings` reach both the rollout's requests and held-out evaluation: every
    response the reward sees ends at the first stop string in it, and nothing is lost (the
    audit). The near-untrained policy writes "a" or "b" in about half its responses."""
    config = default.get_config()
    config.rollout.update(num_iterations=2, train_batch_size=8, rollout_batch_size=16,
                          group_size=4)  # fmt: skip
    config.sft.steps = 2
    config.engine.update(slots=4, stop_strings=("a", "b"))
    config.eval.update(num_prompts=8, samples_per_prompt=2)
    config.reward.update(name="app_rewards:remembers_what_it_scores", isolation="thread")
    app_rewards.SCORED.clear()
    app_lib.train_and_evaluate(config, str(tmp_path), progress=False)
    dispatched = sum(e["event"] == "dispatch" for e in ledger_lib.read(str(tmp_path)))
    assert len(app_rewards.SCORED) == dispatched + 2 * 8 * 2  # and held-out before and after
    for text in app_rewards.SCORED:
        first = min((text.find(s) + 1 for s in "ab" if s in text), default=len(text))
        assert first == len(text), text  # nothing after the first stop string
    assert sum(text[-1:] in ("a", "b") for text in app_rewards.SCORED) > 10
    assert all(audit_lib.audit(str(tmp_path)).rules.values())


@pytest.mark.slow
def test_held_out_scores_during_rl_are_those_of_the_checkpoint_they_name(tmp_path):
    """`eval.every`: at a checkpoint barrier the held-out set is scored with that version and
    logged with the next iteration; the last version's scores are the run's `heldout_after`,
    and a run asked to go on logs them too. The reference is `dora-jax eval` of the same
    version, restored from its checkpoint on disk (the newer ones set aside). Held-out scoring
    does not count in the run's reward counters."""
    config = default.get_config()
    config.rollout.update(num_iterations=4, train_batch_size=8, rollout_batch_size=16,
                          group_size=4)  # fmt: skip
    config.sft.steps = 150
    config.engine.slots = 4
    config.eval.update(num_prompts=16, samples_per_prompt=2, every=2)
    config.checkpoint.update(every=2, keep=3)
    first = app_lib.train_and_evaluate(config, str(tmp_path), progress=False)
    config.rollout.num_iterations = 6
    second = app_lib.train_and_evaluate(config, str(tmp_path), progress=False)  # on from v4
    records = {r["step"]: r for r in metrics_lib.read_metrics(str(tmp_path))}
    logged = {s: {k: v for k, v in r.items() if k.startswith("eval/")} for s, r in records.items()}
    assert [s for s, scores in logged.items() if scores] == [3, 5]
    assert logged[5] == {
        "eval/version": 4.0,
        **{f"eval/{k}": v for k, v in first["heldout_after"].items()},
    }
    # Each dispatched sample is scored once when it finishes (the last barrier drained them
    # all); the held-out scoring does not count.
    dispatched = sum(e["event"] == "dispatch" for e in ledger_lib.read(str(tmp_path)))
    assert second["reward_counters"]["reward/calls"] == dispatched
    for newer in ("6", "4"):
        os.rename(tmp_path / "checkpoints" / newer, tmp_path / f"set_aside_{newer}")
    reference = app_lib.evaluate_checkpoint(config, str(tmp_path))
    assert reference["pass@2"] > 0  # a policy that scores something, not 0 == 0
    assert logged[3] == {"eval/version": 2.0, **{f"eval/{k}": v for k, v in reference.items()}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, contents, says",
    [("heldout.jsonl", "", r"data files .*heldout\.jsonl.* hold no rows"),
     ("heldout.csv", "prompt,answer\n", "heldout.csv: unknown format '.csv'"),
     ("heldout.array_record", "", r"heldout\.array_record: not a readable ArrayRecord")],
)  # fmt: skip
def test_a_data_file_that_is_no_data_is_refused_naming_the_field_before_the_workdir(
    tmp_path, name, contents, says
):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / name).write_text(contents)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")  # never parsed here
    config = default.get_config()
    config.model.checkpoint = str(tmp_path / "model")
    config.data.update(source="files", train_files=str(tmp_path / "train.jsonl"),
                       heldout_files=str(tmp_path / name))  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^data\.heldout_files: .*{says}"):
        app_lib.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_that_cannot_tokenize_or_template_is_refused_before_the_workdir(tmp_path):
    """Both were tracebacks, after the workdir was made."""
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    config = default.get_config()
    config.model.checkpoint = str(checkpoint)
    config.data.update(source="files", train_files=str(tmp_path / "train.jsonl"))
    with pytest.raises(ConfigError, match=r"^model\.checkpoint=.* has no tokenizer\.json"):
        app_lib.train_and_evaluate(config, str(tmp_path / "run"))
    LongTailTask().tokenizer().save(checkpoint)
    # Held-out files with no usable row are named as such, not as training data.
    (tmp_path / "heldout.jsonl").write_text('{"prompt": 5, "answer": "2"}\n')
    config.data.heldout_files = str(tmp_path / "heldout.jsonl")
    data = task_lib.load_task(config)
    with pytest.raises(ConfigError, match=r"^data\.heldout_files: no usable row .* wrong_type=1"):
        task_lib.heldout_records(config, data)
    config.data.template = "chat"
    with pytest.raises(ConfigError, match=r"^data\.template='chat': .*model has no chat_template"):
        app_lib.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("error", [BadRowError, NoUsableRowsError, ConfigError])
def test_a_stop_by_the_data_policy_is_one_line_like_a_refusal(error):
    """A bad row under `data.on_bad_row=error` names its file, line and field: a traceback
    through grain's iterators buried it."""

    def command(argv):
        raise error("d.jsonl line 3 field 'prompt': prompt is empty")

    with pytest.raises(SystemExit) as stopped:
        cli._without_traceback("train", command)(["dora-jax"])
    assert stopped.value.code == "dora-jax: d.jsonl line 3 field 'prompt': prompt is empty"

    def buggy(argv):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):  # anything else keeps its traceback
        cli._without_traceback("train", buggy)(["dora-jax"])


def test_files_and_checkpoint_path_end_to_end(tmp_path, monkeypatch, caplog):
    task = LongTailTask()
    checkpoint = tmp_path / "policy"
    tokenizer = task.tokenizer()
    tokenizer.save(checkpoint)
    model = models.create(
        models.ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                           num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True)
    )  # fmt: skip
    models.save_pretrained(model, str(checkpoint))
    rows = task.rows("train", 12, seed=0)  # 8 good rows: the run reads the first epoch whole
    lines = [json.dumps(r) for r in rows]
    lines[1] = json.dumps({"prompt": "1+1>2="})  # missing answer
    lines[4] = json.dumps({"prompt": 5, "answer": "x"})  # wrong type
    lines[7] = "{not json"
    lines[10] = json.dumps({"prompt": "0+1>" + "1" * 40 + "=", "answer": "1"})  # too long
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("\n".join(lines) + "\n")
    heldout_file = tmp_path / "heldout.jsonl"
    heldout_file.write_text("\n".join(json.dumps(r) for r in task.rows("heldout", 8, 1)) + "\n")

    config = default.get_config()
    config.model.checkpoint = str(checkpoint)
    config.data.source = "files"
    config.data.train_files = str(train_file)
    config.data.heldout_files = str(heldout_file)
    config.reward.name = "app_rewards:flaky_exact_match"
    config.rollout.update(num_iterations=4, train_batch_size=8, rollout_batch_size=16,
                          group_size=4)  # fmt: skip
    config.engine.slots = 4
    config.eval.update(num_prompts=8, samples_per_prompt=1)
    config.checkpoint.every = 2
    config.train.kl_coef = 0.05  # the reference policy goes into every checkpoint
    config.rollout.decode_steps_per_turn = 3  # several steps per call on the hosts' engines
    config.runtime.generation_hosts = "local"
    config.runtime.host_timeout_s = 600.0
    started = []
    start = hosts_lib.start_local_hosts

    def start_hosts(specs, timeout_s):
        started.append((len(specs), timeout_s))
        return start(specs, timeout_s)

    monkeypatch.setattr(hosts_lib, "start_local_hosts", start_hosts)
    workdir = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        summary = app_lib.train_and_evaluate(config, str(workdir), progress=False)
    assert started == [(config.runtime.num_instances, 600.0)]
    # The default's warm-up has no demonstrations to train on here: said, not silently skipped.
    assert any(m.startswith("sft.steps=500: no warm-up") for m in caplog.messages)

    assert summary["iterations"] == 4
    skipped = summary["skipped_rows"]  # each bad row counted every epoch the run reaches it
    assert set(skipped) == {"missing_field", "wrong_type", "invalid_json", "prompt_too_long"}
    assert 1 <= min(skipped.values()) <= max(skipped.values()) <= 2
    assert summary["reward_counters"]["reward/errors"] > 0  # answers starting with "1"
    assert summary["heldout_accuracy_before"] is not None
    for name in ("ledger.jsonl", "trace.json", "summary.json", "summary.png", "metrics.jsonl"):
        assert (workdir / name).exists(), name
    assert any(p.name.startswith("events.out.tfevents") for p in workdir.iterdir())
    saved = sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == ["2", "4"]  # every 2 versions, the last one included
    reloaded = models.from_pretrained(str(workdir / "hf_policy"))
    assert reloaded.config.vocab_size == tokenizer.vocab_size
    assert audit_lib.audit(str(workdir)).passed
    with open(workdir / "metrics.jsonl") as f:
        kl = [record["train/kl"] for record in map(json.loads, f)]
    assert len(kl) == 4
    assert 0 <= kl[0] < 1e-3  # the reference is the policy RL started from
    assert max(kl) > kl[0]
    scores = app_lib.evaluate_checkpoint(config, str(workdir))  # restores the reference too
    # The last version's checkpoint is the final policy: eval scores what training reported.
    assert scores["version"] == 4
    assert scores["pass@1"] == summary["heldout_accuracy_after"]
    on_disk = json.loads((workdir / "summary.json").read_text())
    for key in ("heldout_accuracy_before", "heldout_accuracy_after", "iterations", "wall_time_s",
                "trained_tokens_per_s"):  # fmt: skip
        assert key in on_disk
    # `dora-jax export` of the last checkpoint is the run's hf_policy, tensor for tensor, with
    # the starting checkpoint's tokenizer; an earlier version exports its own, other, policy.
    final = app_lib.export_checkpoint(config, str(workdir))
    assert final == str(workdir / "hf_policy_v4")
    assert (workdir / "hf_policy_v4" / "tokenizer.json").exists()
    written = _tensors(workdir / "hf_policy")
    exported = _tensors(final)
    assert written.keys() == exported.keys()
    for name, value in written.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    earlier = _tensors(app_lib.export_checkpoint(config, str(workdir), 2, str(tmp_path / "v2")))
    assert any(not np.array_equal(earlier[name], value) for name, value in written.items())
    with pytest.raises(ValueError, match=r"no checkpoint of version 3; it has \[2, 4\]"):
        app_lib.export_checkpoint(config, str(workdir), 3)
    # Export reads the params alone: under other trainer settings (here without the KL
    # reference the checkpoint holds, and with TIS history it does not) it writes the same
    # policy.
    config.train.update(kl_coef=0.0, tis_cap=2.0, max_staleness=2)
    again = _tensors(app_lib.export_checkpoint(config, str(workdir), out=str(tmp_path / "v4")))
    for name, value in written.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    # In another dtype: the float32 master weights, rounded once (a run computing in bfloat16
    # exports in float32 the same way).
    config.model.dtype = "bfloat16"
    rounded = app_lib.export_checkpoint(config, str(workdir), out=str(tmp_path / "v4_bf16"))
    from safetensors.torch import load_file

    for name, value in load_file(os.path.join(rounded, "model.safetensors")).items():
        assert str(value.dtype) == "torch.bfloat16", name
        expected = written[name].astype(jnp.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(value.float().numpy(), expected, err_msg=name)
    # Rows deleted from (or added to) the training files: the saved iterator's position would
    # point at other rows, and the run went on silently.
    config.model.dtype = "float32"
    config.train.update(kl_coef=0.05, tis_cap=None, max_staleness=None)
    config.rollout.num_iterations = 6
    train_file.write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ConfigError, match=r"^data\.train_files: 11 rows now, 12 when the run"):
        app_lib.train_and_evaluate(config, str(workdir), progress=False)


def _tensors(directory, name: str = "model.safetensors") -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(directory, name))


def test_network_hosts_wait_as_long_as_host_timeout_s(monkeypatch):
    """A host that took its spec and went silent fails after `runtime.host_timeout_s`, not
    the hard-wired half hour."""
    from multiprocessing.connection import Listener

    monkeypatch.setenv(hosts_lib.KEY_VARIABLE, "secret")
    listener = Listener(("127.0.0.1", 0), authkey=b"secret")
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    config = default.get_config()
    config.runtime.host_timeout_s = 0.3
    address = "{}:{}".format(*listener.address)
    model = models.create(_TINY_MODEL)
    raised = []

    def start_hosts():
        try:
            app_lib.start_generation_hosts(config, [address], model, eos_ids=[1])
        except BaseException as e:  # noqa: BLE001 - the test reads it below
            raised.append(e)

    starting = threading.Thread(target=start_hosts, daemon=True)
    starting.start()
    starting.join(30)  # a regression waits half an hour: fail here, not at the suite's timeout
    assert not starting.is_alive(), "still waiting for the silent host"
    assert isinstance(raised[0], hosts_lib.HostError)
    assert f"{address}: no answer in 0.3 s" in str(raised[0])
    accepted[0].close()
    listener.close()
