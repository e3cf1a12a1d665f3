"""Config validation fails at start, naming the field; a checkpoint's run is known by its
run-defining fields."""

from __future__ import annotations

import os
import re
import types

import ml_collections
import pytest

from configs import bench_longtail, default
from dora_jax import settings_lib, task_lib
from dora_jax.config_fields_lib import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
        ("model", "lora_rank", -1, "model.lora_rank"),
        ("model", "lora_alpha", 0.0, "model.lora_alpha"),
        ("model", "lora_targets", "q_proj,lm_head", "model.lora_targets"),
        ("model", "lora_targets", "", "model.lora_targets"),
        # A random init's shape: it trained at the uniform loss (width 0) or failed in JAX.
        ("model", "hidden_size", 0, "model.hidden_size=0 must be an integer >= 1"),
        ("model", "num_layers", 0, "model.num_layers=0 must be an integer >= 1"),
        ("model", "num_kv_heads", 3, "model.num_heads=4 must be a multiple of num_kv_heads=3"),
        ("model", "head_dim", 15, "model.head_dim=15 must be even"),
        # Fields the trainer takes from the rollout are named where the user sets them.
        ("rollout", "group_size", 1, "rollout.group_size: grpo needs group_size >= 2"),
        ("train", "mini_batches", 3, "must divide rollout.train_batch_size=64"),
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
        settings_lib.validate(config)


def test_a_bench_config_is_refused_naming_the_command_that_runs_it():
    with pytest.raises(ValueError, match="this is a bench config .*run it with `dora-jax bench`"):
        settings_lib.validate(bench_longtail.get_config())


def test_files_need_the_checkpoint_that_tokenizes_them():
    config = default.get_config()
    config.data.update(source="files", train_files="train.jsonl")
    with pytest.raises(ValueError, match=r"model\.checkpoint"):
        settings_lib.validate(config)


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
        settings_lib.validate(config)


@pytest.mark.parametrize(
    "field, value, says",
    [("engine.temperature", "1.0", "must be a number"),
     ("train.learning_rate", "2e-4", "must be a number"),
     ("reward.timeout_s", "5", "must be a number"),
     ("seed", "0", "must be an integer"),
     ("rollout.staleness_bound", 2.0, "must be an integer"),
     ("engine.top_k", True, "must be an integer")],
)  # fmt: skip
def test_a_config_files_number_of_the_wrong_type_is_refused_naming_it(field, value, says):
    """A config file is Python: `temperature = "1.0"` failed a comparison deep in a library
    (`'<=' not supported between 'float' and 'str'`), or past validation (`seed`), naming no
    field. Overrides cannot do this: ml_collections casts them to the field's type."""
    values = default.get_config().to_dict()
    section, _, name = field.rpartition(".")
    (values[section] if section else values)[name] = value
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(field)}={re.escape(repr(value))}: {says}$"
    ):
        settings_lib.validate(ml_collections.ConfigDict(values))


def test_a_run_saved_before_a_field_existed_resumes_with_the_fields_old_behaviour(tmp_path):
    """A checkpoint's config from before `engine.stop_strings` (or `reward.options`) existed
    ran without stop strings: a config stating none goes on with it, one stating some does
    not."""
    config = default.get_config()
    saved = settings_lib.run_defining_fields(config)
    for added in ("engine.stop_strings", "reward.options", "train.entropy_coef",
                  "train.micro_batch_tokens", "train.epochs", "model.lora_rank",
                  "model.lora_alpha", "model.lora_targets"):  # fmt: skip
        del saved[added]
    settings_lib.check_same_run(saved, config, str(tmp_path))
    config.engine.stop_strings = ("</answer>",)
    with pytest.raises(ValueError, match=r"engine\.stop_strings: \[\] -> \['</answer>'\]"):
        settings_lib.check_same_run(saved, config, str(tmp_path))


def test_stating_what_the_architecture_implies_is_the_same_run(tmp_path):
    """`model.qk_norm` can only be the architecture's value: a run started with it unset (the
    default) resumes with it stated, and a checkpoint saved when the default stated it (and
    before `reward.workers` existed) still matches."""
    config = default.get_config()
    saved = settings_lib.run_defining_fields(config)
    config.model.qk_norm = True
    settings_lib.check_same_run(saved, config, str(tmp_path))
    older = {**saved, "model.qk_norm": True}
    settings_lib.check_same_run(older, default.get_config(), str(tmp_path), prefixes=("model.",))


def test_a_run_is_the_same_whichever_way_its_files_are_named(tmp_path, monkeypatch):
    """Paths were compared as typed: a preempted job relaunched from another directory, or
    naming its data by an absolute path, was refused as "another config"."""
    (tmp_path / "model").mkdir()
    (tmp_path / "train.jsonl").write_text("")
    config = default.get_config()
    monkeypatch.chdir(tmp_path)
    config.model.checkpoint, config.data.train_files = "./model", "train.jsonl, ./train.jsonl"
    saved = settings_lib.run_defining_fields(config)
    monkeypatch.chdir("/")
    config.model.checkpoint = str(tmp_path / "model")
    config.data.train_files = f"{tmp_path}/train.jsonl,{tmp_path}/../{tmp_path.name}/train.jsonl"
    settings_lib.check_same_run(saved, config, str(tmp_path))
    config.data.train_files = f"{tmp_path}/train.jsonl"  # one file fewer is another run
    with pytest.raises(ValueError, match=r"data\.train_files: "):
        settings_lib.check_same_run(saved, config, str(tmp_path))


def test_shape_fields_a_checkpoint_overrides_do_not_define_the_run(tmp_path):
    """With `model.checkpoint` set the shape comes from its config.json, and the config's
    shape fields are not used; they still had to match on resume, so a run started with a
    stray `--config.model.num_layers=8` could not be continued without it."""
    config = default.get_config()
    config.model.checkpoint = str(tmp_path)
    config.model.num_layers = 8
    saved = settings_lib.run_defining_fields(config)
    assert "model.num_layers" not in saved and "model.checkpoint" in saved
    config.model.num_layers = 2
    settings_lib.check_same_run(saved, config, str(tmp_path))
    settings_lib.check_same_run({**saved, "model.num_layers": 8}, config, str(tmp_path))  # older
    config.model.checkpoint = ""  # a random init: the shape is the run's
    with pytest.raises(ValueError, match=r"model\.checkpoint: "):
        settings_lib.check_same_run(saved, config, str(tmp_path))


def test_a_max_prompt_len_too_short_for_the_builtin_task_is_refused_at_start():
    config = default.get_config()
    config.data.max_prompt_len = 6  # "s+d>t=": six characters, a token each
    settings_lib.validate(config)
    config.data.max_prompt_len = 5
    with pytest.raises(ConfigError, match=r"data\.max_prompt_len=5: .* take 6 tokens"):
        settings_lib.validate(config)
    config.data.update(max_prompt_len=8, template="Q: {prompt}")
    with pytest.raises(ConfigError, match=r"data\.max_prompt_len=8: .* take 9 tokens"):
        settings_lib.validate(config)


def _stub_checkpoint(tmp_path, monkeypatch) -> str:
    """A model directory that passes `check_inputs`, whose tokenizer is never read (stubbed):
    these tests are about the data files."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(task_lib, "load_tokenizer", lambda path: None)
    return str(tmp_path / "model")


def test_missing_input_files_are_named_by_field_and_spaces_in_lists_are_dropped(
    tmp_path, monkeypatch
):
    (tmp_path / "a.jsonl").write_text('{"prompt": "p", "answer": "a"}\n')
    config = default.get_config()
    config.data.update(source="files", train_files=f"{tmp_path / 'a.jsonl'} , ")
    config.model.checkpoint = _stub_checkpoint(tmp_path, monkeypatch)
    settings_lib.check_inputs(config)
    assert len(task_lib.load_task(config).train_rows) == 1
    config.data.train_files = " , ,"
    with pytest.raises(ValueError, match=r"data\.train_files=' , ,' must name at least one"):
        settings_lib.validate(config)
    config.data.train_files = str(tmp_path / "a.jsonl")
    config.data.heldout_files = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"
    with pytest.raises(ConfigError, match=r"^data\.heldout_files: .*b\.jsonl does not exist$"):
        task_lib.load_task(config)
    config.data.train_files = str(tmp_path / "c.jsonl")  # both fields wrong: the first named
    with pytest.raises(ConfigError, match=r"^data\.train_files: .*c\.jsonl does not exist$"):
        task_lib.load_task(config)
    config.data.heldout_files = ""
    config.model.checkpoint = str(tmp_path)
    with pytest.raises(ConfigError, match=r"^model\.checkpoint=.*no config\.json"):
        settings_lib.check_inputs(config)


def test_responses_past_the_checkpoints_positions_are_refused_at_start(tmp_path, monkeypatch):
    """A response ran past `max_position_embeddings` with nothing said: positions the model
    was never trained at (vLLM refuses the same max_model_len)."""
    config = default.get_config()
    config.model.checkpoint = _stub_checkpoint(tmp_path, monkeypatch)
    (tmp_path / "model" / "config.json").write_text('{"max_position_embeddings": 56}')
    config.data.max_prompt_len, config.engine.max_decode_length = 8, 48
    settings_lib.check_inputs(config)  # 56 positions: all of them
    config.engine.max_decode_length = 49
    says = r"reaches 57 positions, past model\.checkpoint's max_position_embeddings=56"
    with pytest.raises(ConfigError, match=rf"^engine\.max_decode_length=49: .* {says}"):
        settings_lib.check_inputs(config)
    for broken in ('{"max_position_embeddings": 56', "[56]"):  # cut off; not an object
        (tmp_path / "model" / "config.json").write_text(broken)
        with pytest.raises(ConfigError, match=r"^model\.checkpoint=.*config\.json is no JSON"):
            settings_lib.check_inputs(config)


def test_a_field_name_no_row_has_is_refused_naming_the_config_field(tmp_path, monkeypatch):
    """A misspelled `data.prompt_field` made every row a bad row: one warning per row through a
    whole pass, then a stop that blamed the data, after the workdir was made."""
    (tmp_path / "a.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    config = default.get_config()
    config.data.update(source="files", train_files=str(tmp_path / "a.jsonl"))
    config.model.checkpoint = _stub_checkpoint(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match=r"^data\.prompt_field='prompt': data file .*a\.jsonl: "
                       r"none of its first 1 rows has a field 'prompt' \(they have \['answer', "
                       r"'question'\]\)$"):  # fmt: skip
        task_lib.load_task(config)
    config.data.prompt_field = "question"
    assert len(task_lib.load_task(config).train_rows) == 1


def test_lora_targets_are_the_same_run_in_any_order_and_spacing(tmp_path):
    config = default.get_config()
    config.model.lora_targets = "q_proj, v_proj"
    saved = settings_lib.run_defining_fields(config)
    config.model.lora_targets = "v_proj,q_proj"
    settings_lib.check_same_run(saved, config, str(tmp_path))
    config.model.lora_targets = "v_proj,q_proj,o_proj"
    with pytest.raises(ValueError, match=r"model\.lora_targets: 'q_proj, v_proj' -> 'v_proj,q_"):
        settings_lib.check_same_run(saved, config, str(tmp_path))


def test_a_run_stopped_by_a_bad_row_resumes_skipping_them(tmp_path):
    """Under on_bad_row=error every bad row stopped the run and was refused on resume under
    skip, so a user fixed the data one restart at a time."""
    config = default.get_config()
    config.data.on_bad_row = "error"
    saved = settings_lib.run_defining_fields(config)
    config.data.on_bad_row = "skip"
    settings_lib.check_same_run(saved, config, str(tmp_path))
    config.data.max_prompt_len = 7  # the data's other rules still define the run
    with pytest.raises(ValueError, match=r"data\.max_prompt_len"):
        settings_lib.check_same_run(saved, config, str(tmp_path))


def test_a_config_without_a_field_the_app_reads_names_it():
    """A config file written before a field existed failed with a bare AttributeError (or a
    KeyError, deep in validation)."""
    config = default.get_config()
    del config.runtime["host_timeout_s"]
    del config.reward["options"]
    with pytest.raises(
        ValueError, match=r"lacks field\(s\) \['reward.options', 'runtime.host_timeout_s'\]"
    ):
        settings_lib.validate(config)


def test_local_hosts_are_refused_on_an_accelerator(monkeypatch):
    config = default.get_config()
    config.runtime.generation_hosts = "local"
    gpu = [types.SimpleNamespace(platform="gpu")]
    monkeypatch.setattr(settings_lib.jax, "devices", lambda: gpu)
    with pytest.raises(ValueError, match=r"runtime\.generation_hosts='local' .* only CPU"):
        settings_lib.validate(config)


def test_reward_options_from_the_config_are_bound_to_the_reward():
    """`reward.options` reach the function in its worker processes; a misspelled one fails at
    start, naming the field (the registry took options, but no config field could give them)."""
    config = default.get_config()
    config.reward.name = "format"
    config.reward.options = {"pattern": r"<answer>.+?</answer>"}
    runner = settings_lib.reward_runner(config)
    try:
        scored = runner.score([(0, "so <answer>7</answer>", ""), (1, "so \\boxed{7}", "")])
    finally:
        runner.close()
    assert scored == [1.0, 0.0]  # the default pattern would score them the other way round
    config.reward.options = {"patern": "x"}
    with pytest.raises(ValueError, match=r"reward\.options\.patern"):
        settings_lib.validate(config)


def test_reward_workers_from_the_config_score_side_by_side():
    """`reward.workers` calls run at once: six meet at a barrier of six (four, the default,
    would break it and score errors)."""
    config = default.get_config()
    config.reward.update(name="app_rewards:meets_five_others", isolation="thread", workers=6)
    runner = settings_lib.reward_runner(config)
    assert runner.score([(i, "y", "x") for i in range(6)]) == [1.0] * 6
    assert runner.counters.errors == 0


def test_real_recipe_is_a_valid_config():
    from configs import qwen3_gsm8k

    settings = settings_lib.validate(qwen3_gsm8k.get_config())
    assert settings.rollout.mode == "dora" and settings.train.tbs == 256
    assert settings.plan.num_instances == 4


def test_batch_size_set_twice_is_refused():
    config = default.get_config()
    config.train.tbs = 32
    with pytest.raises(ValueError, match=r"train\.tbs"):
        settings_lib.validate(config)


def test_stop_strings_written_as_one_string_are_refused():
    """A config file's `c.engine.stop_strings = "</answer>"` (a str, not a tuple) would stop at
    any of its characters if taken as a sequence; a command-line override of the default tuple
    is refused by ml_collections itself."""
    config = default.get_config()
    del config.engine["stop_strings"]
    config.engine.stop_strings = "</answer>"
    with pytest.raises(ValueError, match=r"engine\.stop_strings='</answer>'"):
        settings_lib.validate(config)


def test_lora_on_a_random_init_is_warned_about(caplog):
    """Adapters on a random base barely learn (BENCHMARKS.md): the run says so at start."""
    config = default.get_config()
    settings_lib.validate(config)
    assert "LoRA" not in caplog.text
    config.model.lora_rank = 4
    settings_lib.validate(config)
    assert "model.lora_rank=4 on a random init" in caplog.text
