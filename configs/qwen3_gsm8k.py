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

    c.engine.slots = 64
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
    c.train.micro_batch_size = 16
    c.train.learning_rate = 1e-6
    c.train.warmup_steps = 10
    c.train.schedule = "constant"
    c.train.loss = "ppo_clip"
    c.train.length_buckets = (512, 1024, 1536, 2560)
    # A micro-batch of 16 sequences of up to 2,560 tokens through 28 layers keeps tens of GB of
    # activations for the backward pass (an estimate: ~40 bf16 arrays of 16 x 2560 x 1024 per
    # layer) against a v5e chip's 16 GiB; recomputing each layer keeps ~2 GB (its inputs).
    c.train.remat = "full"

    c.eval.num_prompts = 1319
    c.eval.samples_per_prompt = 4
    c.checkpoint.every = 10
    c.checkpoint.keep = 3
    return c
