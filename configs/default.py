"""The embedded CPU default: `make train`.

A tiny Qwen3-style policy learns the built-in long-tail task (walks around a clock, response
lengths heavy-tailed) on 8 virtual CPU devices: a 4-device training mesh (fsdp=2 x tp=2) and
four 1-device rollout instances running DORA's multi-version streaming rollout. A short SFT
warm-up on noisy demonstrations gives the policy a modest accuracy that RL then raises.
"""

import ml_collections

from dora_jax.rollout import config_lib as rollout_config_lib
from dora_jax.runtime import compile_cache_lib
from dora_jax.train import config_lib as train_config_lib


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    # Virtual CPU devices to create when running on CPU (ignored on TPU/GPU).
    c.num_cpu_devices = 8
    # JAX's persistent compilation cache, shared with later runs and restarts ('' = off).
    c.compilation_cache_dir = compile_cache_lib.DEFAULT_DIRECTORY

    c.model = ml_collections.ConfigDict()
    c.model.checkpoint = ""  # a Hugging Face model directory; empty = random init from below
    c.model.dtype = "float32"
    c.model.architecture = "Qwen3ForCausalLM"
    c.model.hidden_size = 64
    c.model.intermediate_size = 192
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 16
    # Unset (None): what `architecture` implies (Qwen3: on), so that switching the architecture
    # alone gives a valid model; `--config.model.qk_norm=false` states it.
    c.model.qk_norm = ml_collections.config_dict.placeholder(bool)
    # LoRA: > 0 trains rank-`lora_rank` adapters on `lora_targets` (Hugging Face projection
    # names; MoE experts keep none) scaled by lora_alpha / lora_rank, the base weights frozen.
    # The optimizer then holds two moments per adapter number, not per weight. LoRA usually
    # wants a learning rate ~10x full fine-tuning's. Export merges the adapters in.
    c.model.lora_rank = 0
    c.model.lora_alpha = 16.0
    c.model.lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"

    c.runtime = ml_collections.ConfigDict()
    c.runtime.train_devices = 4
    c.runtime.train_tp = 2
    c.runtime.num_instances = 4
    c.runtime.devices_per_instance = 1
    c.runtime.instance_tp = 1
    # Where each rollout instance's engine runs: "" in this process; "local" in a child process
    # of its own (a generation host on this machine's CPU devices); "HOST:PORT,..." one running
    # `dora-jax host` per instance (with DORA_JAX_HOST_KEY set on both sides; they bring their
    # own devices, so only the training mesh is planned here). The controller
    # reaches hosts through host-side queues: the multi-process shape of DESIGN.md, with the
    # same ledger as in-process engines, at the cost of the transfers.
    c.runtime.generation_hosts = ""
    # Seconds the controller waits for a generation host's answer (or to hand it a command)
    # before taking its instance out as hung. Generous: a host's first steps compile, minutes
    # for a large model on an accelerator.
    c.runtime.host_timeout_s = 1800.0
    # Where the training mesh runs: "" in this process; "local:N" across this process and N child
    # processes (CPU), one JAX process group (jax.distributed, gloo); "HOST:PORT,..." with one
    # running `dora-jax host` per address. The mesh is then every device of the group
    # (runtime.train_devices counts them all) and the rollout runs on generation hosts.
    c.runtime.training_hosts = ""
    # This machine's HOST:PORT for the group's coordination service (network training hosts).
    c.runtime.coordinator = ""

    c.data = ml_collections.ConfigDict()
    c.data.source = "longtail"  # "longtail" (built-in task) or "files"
    c.data.train_files = ""  # comma-separated JSONL / Parquet / ArrayRecord paths
    c.data.heldout_files = ""
    c.data.prompt_field = "prompt"
    c.data.answer_field = "answer"
    c.data.template = "{prompt}"  # a format string, or "chat" (the checkpoint's chat template)
    c.data.max_prompt_len = 8
    c.data.on_bad_row = "skip"  # or "error"

    c.task = ml_collections.ConfigDict()  # the built-in long-tail task
    c.task.modulus = 47
    c.task.max_step = 3
    c.task.alpha = 1.2
    c.task.heldout_fraction = 0.2
    c.task.demonstration_noise = 0.1

    c.reward = ml_collections.ConfigDict()
    c.reward.name = "exact_match"  # a registered name or a dotted path to a user function
    # Keyword arguments bound to the reward function once, e.g. the `format` reward's
    # `c.reward.options.pattern = r"<answer>.+?</answer>"` (set in a config file: a command-line
    # override can only change an option the file already sets).
    c.reward.options = ml_collections.ConfigDict()
    c.reward.timeout_s = 5.0
    # "process": each call in a worker process, killed past the timeout even when stuck in C
    # code; "thread" for a reward function that does not pickle (its hung calls are abandoned).
    c.reward.isolation = "process"
    # Calls at once (worker processes or threads): more for a reward that waits on something
    # (a sandbox running code, a judge model), at a process each.
    c.reward.workers = 4
    # DAPO's soft overlong punishment: a penalty growing linearly to -overlong_penalty over the
    # last overlong_buffer tokens before engine.max_decode_length (0 = off).
    c.reward.overlong_buffer = 0
    c.reward.overlong_penalty = 1.0

    c.engine = ml_collections.ConfigDict()
    c.engine.slots = 16  # decode slots per rollout instance
    c.engine.max_decode_length = 48
    c.engine.temperature = 1.0
    c.engine.top_k = 0
    c.engine.top_p = 1.0
    # A response also ends at the first token whose text completes one of these, which stays in
    # the response (trained, and seen by the reward), e.g. ("</answer>",) for a template that
    # asks for <answer>...</answer>.
    c.engine.stop_strings = ()

    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 500
    c.sft.batch_size = 64
    c.sft.learning_rate = 3e-3

    # Every rollout field, at its default unless set here, so each one can be overridden.
    c.rollout = rollout_config_lib.config_section(
        mode="dora",
        train_batch_size=64,
        rollout_batch_size=96,
        group_size=8,
        staleness_bound=2,
        num_iterations=300,
        timer_steps=16,
        kv_pressure=0.9,
        publish_delay_steps=4,
    )

    # Every trainer field, at its default unless set here, so each one can be overridden.
    c.train = train_config_lib.config_section(
        mini_batches=2,
        learning_rate=2e-4,
        warmup_steps=2,
        advantage="grpo",
        loss="ppo_clip",
        length_buckets=(16, 32, 64),
    )

    c.eval = ml_collections.ConfigDict()
    c.eval.num_prompts = 256
    c.eval.samples_per_prompt = 4  # pass@1 is their mean, pass@k their max
    # Sampling of the held-out samples, where it differs from rollout's (`engine.*`), as verl's
    # val_kwargs: e.g. temperature 0 for greedy pass@1. Unset = the engine's value.
    c.eval.temperature = ml_collections.config_dict.placeholder(float)
    c.eval.top_k = ml_collections.config_dict.placeholder(int)
    c.eval.top_p = ml_collections.config_dict.placeholder(float)
    # Versions between held-out evaluations during RL (logged as eval/pass@1, eval/pass@4 and
    # eval/version with the next iteration, and drawn in summary.png); 0 = before and after RL
    # only. Each runs at the first checkpoint barrier at or after a multiple of it, where the
    # trainer's params are at rest.
    c.eval.every = 50

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 5  # iterations between checkpoints (0: none, with eval.every = 0)
    c.checkpoint.keep = 2
    return c
