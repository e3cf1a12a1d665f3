"""The application: config validation names the field, and a real tiny run end to end on the
files-and-checkpoint path (JSONL with malformed rows, an HF checkpoint directory with its
tokenizer, a user reward that sometimes raises), its engines in generation hosts of their own
(the in-process engines run in the resume tests and `make train`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types

import app_rewards
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from configs import default
from dora_jax import app_lib, models
from dora_jax.data import LongTailTask
from dora_jax.observe import metrics_lib
from dora_jax.rollout import audit_lib, ledger_lib
from dora_jax.runtime import hosts_lib
from dora_jax.train.checkpoint_lib import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TINY_MODEL = models.ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                 num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)  # fmt: skip


@pytest.mark.parametrize(
    "section,field,value,named",
    [
        ("rollout", "train_batch_size", 60, "rollout.train_batch_size"),
        ("rollout", "rollout_batch_size", 32, "rollout.rollout_batch_size"),
        ("rollout", "staleness_bound", -1, "rollout.staleness_bound"),
        ("rollout", "mode", "async_magic", "rollout.mode"),
        ("runtime", "num_instances", 9, "runtime.num_instances"),
        ("train", "loss", "no_such_loss", "loss"),
        ("reward", "name", "no_such_reward", "no_such_reward"),
        ("reward", "overlong_buffer", 49, "reward.overlong_buffer"),  # > engine.max_decode_length
        ("reward", "overlong_penalty", -1.0, "reward.overlong_penalty"),
        ("reward", "timeout_s", 0.0, "reward.timeout_s"),
        ("reward", "timeout_s", -1.0, "reward.timeout_s"),
        # inf overflowed Thread.join at the first score, after the SFT warm-up; NaN timed out all.
        ("reward", "timeout_s", float("inf"), "reward.timeout_s"),
        ("reward", "timeout_s", float("nan"), "reward.timeout_s"),
        ("reward", "isolation", "fork", "reward.isolation='fork'"),
        ("reward", "workers", 0, "reward.workers"),
        ("model", "dtype", "float8", "model.dtype"),
        ("data", "source", "s3", "data.source"),
        ("engine", "slots", 0, "engine.slots"),
        ("runtime", "generation_hosts", "gpu7", "runtime.generation_hosts"),
        ("runtime", "generation_hosts", "a:7100,b:7100", "runtime.generation_hosts"),
        # Only `dora-jax train` joins a training group, before validating.
        ("runtime", "training_hosts", "local:1", "runtime.training_hosts"),
        ("runtime", "host_timeout_s", 0.0, "runtime.host_timeout_s"),
        ("runtime", "host_timeout_s", float("nan"), "runtime.host_timeout_s"),
        ("runtime", "host_timeout_s", float("inf"), "runtime.host_timeout_s"),
        ("data", "on_bad_row", "ignore", "data.on_bad_row"),
        ("data", "max_prompt_len", 0, "data.max_prompt_len"),
        ("data", "template", "{question}", "data.template"),
        ("data", "source", "files", "data.train_files"),
        ("engine", "temperature", -1.0, "engine.temperature"),
        ("engine", "top_p", 2.0, "engine.top_p"),
        ("engine", "top_k", -5, "engine.top_k"),
        ("engine", "stop_strings", ("",), "engine.stop_strings"),
        ("task", "modulus", 4, "task.modulus"),
        ("sft", "batch_size", 0, "sft.batch_size"),
        ("eval", "num_prompts", 0, "eval.num_prompts"),
        ("eval", "samples_per_prompt", 0, "eval.samples_per_prompt"),
        ("checkpoint", "every", 0, r"eval.every=50 needs checkpoint.every > 0"),
        ("checkpoint", "every", -1, "checkpoint.every"),
        ("checkpoint", "keep", 0, "checkpoint.keep"),
    ],
)
def test_bad_config_fails_at_start_naming_the_field(section, field, value, named):
    config = default.get_config()
    config[section][field] = value
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        app_lib.validate(config)


def test_files_need_the_checkpoint_that_tokenizes_them():
    config = default.get_config()
    config.data.update(source="files", train_files="train.jsonl")
    with pytest.raises(ValueError, match=r"model\.checkpoint"):
        app_lib.validate(config)


@pytest.mark.parametrize(
    "section,misspelled",
    [("data", "max_prompt_length"), ("engine", "temprature"), ("model", "num_layer"),
     ("checkpoint", "evry"), (None, "num_iteration")],
)  # fmt: skip
def test_a_misspelled_field_in_a_config_file_is_refused(section, misspelled):
    """`--config.x=` overrides of unknown fields fail in absl; a config file's would be ignored
    (the default used in silence) if `validate` did not compare every section with its fields."""
    config = default.get_config()
    (config if section is None else config[section])[misspelled] = 1
    named = misspelled if section is None else f"{section}.{misspelled}"
    with pytest.raises(ValueError, match=rf"unknown config field.*'{named}'"):
        app_lib.validate(config)


def test_resuming_under_another_config_is_refused_before_the_ledger_is_cut(tmp_path):
    config = default.get_config()
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    meta = {"config": app_lib.run_defining_fields(config)}
    checkpointer.save(3, train_state={"w": np.zeros(2)}, data_iterator=None, meta=meta)
    checkpointer.close()
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"event": "start"}\n{"event": "dispatch"}\n')
    config.rollout.group_size = 4
    config.rollout.num_iterations = 600  # may change: running on for longer is a resume
    with pytest.raises(ValueError, match=r"another config \(rollout\.group_size: 8 -> 4\)"):
        app_lib.train_and_evaluate(config, str(tmp_path), progress=False)
    assert ledger.read_text() == '{"event": "start"}\n{"event": "dispatch"}\n'
    config.rollout.group_size = 8
    config.reward.update(isolation="thread", workers=8)  # how rewards run, not what they score
    config.train.remat = "full"  # what the backward pass keeps: the same math
    app_lib.check_same_run(meta["config"], config, str(tmp_path))  # nothing that defines it
    config.model.hidden_size = 32  # evaluation checks the model's fields only
    app_lib.check_same_run(meta["config"], config, str(tmp_path), prefixes=("data.",))
    with pytest.raises(ValueError, match=r"model\.hidden_size: 64 -> 32"):
        app_lib.check_same_run(meta["config"], config, str(tmp_path), prefixes=("model.",))


def test_a_run_saved_before_a_field_existed_resumes_with_the_fields_old_behaviour(tmp_path):
    """A checkpoint's config from before `engine.stop_strings` (or `reward.options`) existed
    ran without stop strings: a config stating none goes on with it, one stating some does
    not."""
    config = default.get_config()
    saved = app_lib.run_defining_fields(config)
    for added in ("engine.stop_strings", "reward.options", "train.entropy_coef",
                  "train.micro_batch_tokens", "train.epochs"):  # fmt: skip
        del saved[added]
    app_lib.check_same_run(saved, config, str(tmp_path))
    config.engine.stop_strings = ("</answer>",)
    with pytest.raises(ValueError, match=r"engine\.stop_strings: \[\] -> \['</answer>'\]"):
        app_lib.check_same_run(saved, config, str(tmp_path))


def test_stating_what_the_architecture_implies_is_the_same_run(tmp_path):
    """`model.qk_norm` can only be the architecture's value: a run started with it unset (the
    default) resumes with it stated, and a checkpoint saved when the default stated it (and
    before `reward.workers` existed) still matches."""
    config = default.get_config()
    saved = app_lib.run_defining_fields(config)
    config.model.qk_norm = True
    app_lib.check_same_run(saved, config, str(tmp_path))
    older = {**saved, "model.qk_norm": True}
    app_lib.check_same_run(older, default.get_config(), str(tmp_path), prefixes=("model.",))


def test_a_config_without_a_field_the_app_reads_names_it():
    """A config file written before a field existed failed with a bare AttributeError (or a
    KeyError, deep in validation)."""
    config = default.get_config()
    del config.runtime["host_timeout_s"]
    del config.reward["options"]
    with pytest.raises(
        ValueError, match=r"lacks field\(s\) \['reward.options', 'runtime.host_timeout_s'\]"
    ):
        app_lib.validate(config)


def test_eval_refuses_a_workdir_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        app_lib.evaluate_checkpoint(default.get_config(), str(tmp_path / "no_such_run"))
    assert not (tmp_path / "no_such_run").exists()


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
        app_lib.validate(config)  # local engines would need 12
    config.runtime.generation_hosts = "g0:7100,g1:7100,g2:7100,g3:7100"
    settings = app_lib.validate(config)
    assert settings.generation_hosts == ("g0:7100", "g1:7100", "g2:7100", "g3:7100")
    assert settings.plan.generation_meshes == () and settings.plan.train_mesh.devices.size == 8
    model = models.create(_TINY_MODEL)
    (evaluation,) = app_lib.make_engines(config, model, settings.plan, eos_ids=(1,))
    assert evaluation.mesh is settings.plan.train_mesh


def test_local_hosts_are_refused_on_an_accelerator(monkeypatch):
    config = default.get_config()
    config.runtime.generation_hosts = "local"
    monkeypatch.setattr(app_lib.jax, "devices", lambda: [types.SimpleNamespace(platform="gpu")])
    with pytest.raises(ValueError, match=r"runtime\.generation_hosts='local' .* only CPU"):
        app_lib.validate(config)


def test_the_trained_reward_is_the_tasks_plus_the_overlong_penalty():
    config = default.get_config()
    config.reward.overlong_buffer = 8
    config.reward.overlong_penalty = 0.5
    settings = app_lib.validate(config)  # engine.max_decode_length = 48: penalised past 40
    records = iter([{"prompt_tokens": [1, 2], "answer": "7"}] * 4)
    prompts = app_lib.PromptStream(records, group_size=4, max_new_tokens=48)
    prompts(0)
    # Tokens below 10 decode to their digit, the others to spaces, which exact_match strips.
    tokenizer = types.SimpleNamespace(
        decode=lambda ids: "".join(str(t) if t < 10 else " " for t in ids)
    )
    runner = app_lib.RewardRunner(app_lib.get_reward("exact_match"), timeout_s=5.0)
    reward = app_lib.RewardAdapter(runner, tokenizer, prompts, settings.overlong)
    right, wrong = [7], [3]
    responses = [right, [10] * 43 + right, [10] * 47 + wrong, [10] * 39 + wrong]
    scored = reward([(0, np.asarray(tokens, np.int32)) for tokens in responses])
    assert scored == [1.0, 1.0 - 0.5 * 4 / 8, -0.5, 0.0]
    assert reward.metrics()["reward/overlong_penalized"] == 2
    assert reward.metrics()["reward/calls"] == 4


def test_reward_options_from_the_config_are_bound_to_the_reward():
    """`reward.options` reach the function in its worker processes; a misspelled one fails at
    start, naming the field (the registry took options, but no config field could give them)."""
    config = default.get_config()
    config.reward.name = "format"
    config.reward.options = {"pattern": r"<answer>.+?</answer>"}
    runner = app_lib.reward_runner(config)
    try:
        scored = runner.score([(0, "so <answer>7</answer>", ""), (1, "so \\boxed{7}", "")])
    finally:
        runner.close()
    assert scored == [1.0, 0.0]  # the default pattern would score them the other way round
    config.reward.options = {"patern": "x"}
    with pytest.raises(ValueError, match=r"reward\.options\.patern"):
        app_lib.validate(config)


def test_reward_workers_from_the_config_score_side_by_side():
    """`reward.workers` calls run at once: six meet at a barrier of six (four, the default,
    would break it and score errors)."""
    config = default.get_config()
    config.reward.update(name="app_rewards:meets_five_others", isolation="thread", workers=6)
    runner = app_lib.reward_runner(config)
    assert runner.score([(i, "y", "x") for i in range(6)]) == [1.0] * 6
    assert runner.counters.errors == 0


def test_a_prompts_record_is_dropped_once_its_group_is_scored():
    records = iter([{"prompt_tokens": [i], "answer": str(i)} for i in range(3)])
    prompts = app_lib.PromptStream(records, group_size=2, max_new_tokens=4)
    for prompt_id in range(3):
        prompts(prompt_id)
    assert prompts.answer(1) == prompts.answer(1) == "1"
    assert sorted(prompts.records) == [0, 2]  # a run no longer holds every prompt it read
    assert prompts.answer(0) == "0" and prompts.answer(2) == "2"


def test_a_turns_samples_are_scored_concurrently():
    """The rollout hands the reward a turn's finished samples at once: a reward that waits
    (a sandbox, a judge) runs them side by side. Four calls meet at a barrier of four, which
    breaks (an error, scored 0) unless all four are in flight together."""
    barrier = threading.Barrier(4)

    def meet(completion, answer):
        barrier.wait(timeout=10)
        return 1.0

    prompts = app_lib.PromptStream(iter([{"prompt_tokens": [1], "answer": "x"}]), 4, 8)
    prompts(0)
    runner = app_lib.RewardRunner(meet, timeout_s=20.0, workers=4, isolation="thread")
    tokenizer = types.SimpleNamespace(decode=lambda ids: "y")
    overlong = app_lib.validate(default.get_config()).overlong
    reward = app_lib.RewardAdapter(runner, tokenizer, prompts, overlong)
    assert reward([(0, np.asarray([1], np.int32))] * 4) == [1.0] * 4
    assert runner.counters.errors == 0


def test_real_recipe_is_a_valid_config():
    from configs import qwen3_gsm8k

    settings = app_lib.validate(qwen3_gsm8k.get_config())
    assert settings.rollout.mode == "dora" and settings.train.tbs == 256
    assert settings.plan.num_instances == 4


def test_batch_size_set_twice_is_refused():
    config = default.get_config()
    config.train.tbs = 32
    with pytest.raises(ValueError, match=r"train\.tbs"):
        app_lib.validate(config)


def test_cli_reports_a_bad_field_and_exits_non_zero():
    result = subprocess.run(
        [sys.executable, "-m", "dora_jax.cli", "train", "--config=configs/default.py",
         "--config.rollout.group_size=7", "--workdir=/tmp/never_written"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "rollout.train_batch_size" in result.stderr
    assert not os.path.exists("/tmp/never_written/ledger.jsonl")


def test_cli_help_lists_its_flags_and_host_flags_are_refused_elsewhere():
    """`--help` listed nothing (absl shows the flags of `__main__`, the console script), and
    `train --num_cpu_devices=2` ran on the config's 8 devices without a word."""
    command = [sys.executable, "-m", "dora_jax.cli"]
    for asked in (["train", "--help"], ["--help"]):
        shown = subprocess.run(command + asked, cwd=ROOT, capture_output=True, text=True,
                               timeout=120)  # fmt: skip
        assert shown.returncode == 0 and "--workdir" in shown.stdout and "--config" in shown.stdout
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
    shown = subprocess.run(command + ["--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert "--version" in shown.stdout and "export" in shown.stdout


# `dora-jax train`, interrupted (Ctrl-C, a preemption) while its checkpoint 2 is being written.
_INTERRUPTED_AT_ITERATION_3 = """
import sys
from dora_jax import cli
from dora_jax.train import checkpoint_lib

save = checkpoint_lib.Checkpointer.save

def save_then_interrupt(self, step, **items):
    save(self, step, **items)  # orbax goes on writing in the background
    if step == 2:
        raise KeyboardInterrupt("interrupted at iteration 3")

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
    it (left as a tmp directory), and its restart began again from scratch."""
    died = subprocess.run([sys.executable, "-c", _INTERRUPTED_AT_ITERATION_3, str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert died.returncode != 0 and "interrupted at iteration 3" in died.stderr
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name]
    assert Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 2


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


def test_stop_strings_written_as_one_string_are_refused():
    """A config file's `c.engine.stop_strings = "</answer>"` (a str, not a tuple) would stop at
    any of its characters if taken as a sequence; a command-line override of the default tuple
    is refused by ml_collections itself."""
    config = default.get_config()
    del config.engine["stop_strings"]
    config.engine.stop_strings = "</answer>"
    with pytest.raises(ValueError, match=r"engine\.stop_strings='</answer>'"):
        app_lib.validate(config)


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


@given(st.integers(1, 30), st.integers(1, 12), st.integers(1, 200))
def test_held_out_is_scored_at_the_first_barrier_at_or_after_each_multiple(every, barrier, n):
    barriers = range(barrier, n + 1, barrier)
    expected = {next((b for b in barriers if b >= m), None) for m in range(every, n + 1, every)}
    got = {v for v in barriers if app_lib.held_out_due(v, every, barrier)}
    assert got == expected - {None}
    assert not any(app_lib.held_out_due(v, 0, barrier) for v in barriers)


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
def test_files_and_checkpoint_path_end_to_end(tmp_path, monkeypatch):
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
    summary = app_lib.train_and_evaluate(config, str(workdir), progress=False)
    assert started == [(config.runtime.num_instances, 600.0)]

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


def _tensors(directory) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


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
