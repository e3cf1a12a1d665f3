"""A real recipe: GRPO/DAPO-style RL of a Qwen3 checkpoint on GSM8K-style math, DORA rollout.

Point `model.checkpoint` at a Hugging Face model directory (config.json, *.safetensors,
tokenizer.json, tokenizer_config.json with its chat template) and `data.*_files` at JSONL /
Parquet / ArrayRecord files whose rows have a `question` and a final numeric `answer` (for
GSM8K, the text after "####"). Sized for one TPU v5e-8 host or an 8-GPU machine: 4 chips train
(FSDP 2 x TP 2), 4 chips each host one rollout instance.

    dora-jax train --config=configs/qwen3_gsm8k.py --workdir=/mnt/bucket/runs/qwen3_gsm8k \
      --config.model.checkpoint=/data/Qwen3-0.6B \
      --config.data.train_files=/data/gsm8k/train.jsonl \
      --config.data.heldout_files=/data/gsm8k/test.jsonl

A larger checkpoint whose full AdamW state does not fit trains with LoRA instead, e.g.
`--config.model.lora_rank=64 --config.model.lora_alpha=128 --config.train.learning_rate=1e-5`
(adapters usually want about 10x full fine-tuning's rate); the exported `hf_policy` is the
checkpoint with the adapters merged in.
"""

import importlib.util
import os

import ml_collections


def _default_config() -> ml_collections.ConfigDict:
    # Loaded by path: config files are read by path too (`--config=`), not imported as a package.
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")
    spec = importlib.util.spec_from_file_location("dora_jax_default_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config() -> ml_collections.ConfigDict:
    c = _default_config()
    c.model.checkpoint = "/data/Qwen3-0.6B"
    c.model.dtype = "bfloat16"

    c.runtime.train_devices = 4
    c.runtime.train_tp = 2
    c.runtime.num_instances = 4
    c.runtime.devices_per_instance = 1

    c.data.source = "files"
    c.data.train_files = "/data/gsm8k/train.jsonl"
    c.data.heldout_files = "/data/gsm8k/test.jsonl"
    c.data.prompt_field = "question"
    c.data.answer_field = "answer"
    c.data.template = "chat"
    c.data.max_prompt_len = 512

    c.reward.name = "math"
    c.reward.timeout_s = 10.0

    # Per instance (one 16 GiB v5e chip), estimated: 32 slots x 2,560 positions x 112 KiB of
    # bfloat16 KV per token (28 layers x 8 KV heads x 128 x 2) = 9.4 GB, plus 1.2 GB of bfloat16
    # params; 64 slots would need 18.8 GB of KV alone.
    c.engine.slots = 32
    c.engine.max_decode_length = 2048
    c.engine.temperature = 1.0

    c.sft.steps = 0  # start RL from the checkpoint as it is

    c.rollout.mode = "dora"
    c.rollout.train_batch_size = 256
    c.rollout.rollout_batch_size = 384
    c.rollout.group_size = 8
    c.rollout.staleness_bound = 2
    c.rollout.num_iterations = 200
    c.rollout.timer_steps = 64

    c.train.mini_batches = 4
    # Padded tokens per forward/backward pass: the float32 logits of a pass are tokens x 151,936
    # x 4 bytes, 6.2 GB at 10,240 (spread over the 4 training chips, and as much again for their
    # gradient), estimated. That is 4 rows of the longest bucket (2,560), and 16 of GSM8K's
    # typical responses (bucket 512), where a fixed 4 rows ran 4x as many passes.
    c.train.micro_batch_tokens = 10240
    c.train.learning_rate = 1e-6
    c.train.warmup_steps = 10
    c.train.schedule = "constant"
    c.train.loss = "ppo_clip"
    c.train.length_buckets = (512, 1024, 1536, 2560)
    # Activations the backward pass keeps, estimated: ~40 bfloat16 arrays of 10,240 x 1,024
    # per layer, 23 GB over 28 layers; recomputing each layer from its input keeps 0.6 GB.
    c.train.remat = "full"

    c.eval.num_prompts = 1319
    c.eval.samples_per_prompt = 4
    c.checkpoint.every = 10
    c.checkpoint.keep = 3
    return c
