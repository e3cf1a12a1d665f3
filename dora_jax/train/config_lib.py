"""Trainer hyper-parameters: one frozen, validated dataclass built from `config.train`.

Every field is checked when the config is built, so a typo in a loss name or an impossible batch
split fails at start-up with the field's name, not hours later inside a jitted step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

from dora_jax.config_fields_lib import dataclass_section, from_fields, is_count
from dora_jax.models.model_lib import REMAT_POLICIES
from dora_jax.train import advantage_lib, loss_lib

SCHEDULES = ("constant", "cosine")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum_over_const")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What one training iteration does with its batch of `tbs` trajectories."""

    # Batch: one iteration takes exactly `tbs` samples = `tbs / group_size` complete groups.
    tbs: int = 16
    group_size: int = 4
    # Optimizer steps per pass over the batch; each takes `tbs / mini_batches` samples.
    mini_batches: int = 1
    # Passes over each iteration's batch (GRPO's mu, verl's ppo_epochs, Tunix's num_iterations):
    # epochs x mini_batches optimizer steps per iteration, every one's ratio taken against the
    # samples' behaviour log-probs.
    epochs: int = 1
    # Samples per forward/backward pass (gradient accumulation); None = the whole mini-batch.
    micro_batch_size: int | None = None
    # Padded tokens per forward/backward pass over the whole training mesh, in place of
    # micro_batch_size when set (verl's use_dynamic_bsz with ppo_max_token_len_per_gpu, which
    # counts per device). Length-sorted rows go as many to a pass as fit (a power of two, and at
    # least one row per fsdp device), so short responses take few passes and long ones stay
    # within memory; a sequence longer than the budget trains alone.
    micro_batch_tokens: int | None = None
    # Sequences (prompt + response) are padded to the smallest bucket that holds them; longer
    # ones to a multiple of the largest bucket.
    length_buckets: tuple[int, ...] = (32, 128, 512, 2048, 8192)
    # What the backward pass keeps of each decoder layer (`models.REMAT_POLICIES`): "none",
    # "full" (recompute the layer from its input) or "dots" (keep the matmul outputs). Long
    # responses on an accelerator need "full" or "dots" to fit the activations.
    remat: str = "none"

    # Optimizer: AdamW, linear warmup, then constant or cosine decay; global-norm clipping.
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"
    decay_steps: int = 1000  # optimizer steps of the cosine decay, warmup included
    min_learning_rate_ratio: float = 0.0  # cosine ends at learning_rate * this
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0  # None disables clipping

    # Algorithm.
    advantage: str = "grpo"  # a name in advantage_lib's registry
    advantage_eps: float = 1e-6  # added to the group std (grpo)
    loss: str = "ppo_clip"  # a name in loss_lib's registry
    eps_low: float = 0.2  # ppo_clip / gspo: ratio lower bound 1 - eps_low
    eps_high: float = 0.28  # ppo_clip / gspo: ratio upper bound 1 + eps_high (DAPO clip-higher)
    # ppo_clip, A < 0: the objective is at least clip_ratio_c * A (dual clip, verl's default 3):
    # a token the policy now favours far more than its stale sampler did cannot dominate the
    # update. None = off.
    clip_ratio_c: float | None = 3.0
    eps_neg_low: float = 0.2  # triplet, A < 0: lower bound 1 - eps_neg_low
    eps_neg_high: float = 2.0  # triplet, A < 0: upper bound 1 + eps_neg_high (dual clip)
    eps_pos_high: float = 0.28  # triplet, A > 0: upper bound 1 + eps_pos_high
    # Truncated importance sampling cap C for min(pi_train_behaviour / pi_inference, C); None = off.
    tis_cap: float | None = None
    # Largest allowed trainer_version - sample.version (C3); None = not checked. TIS needs it,
    # because the trainer keeps the params of that many past versions to recompute log-probs.
    max_staleness: int | None = None
    kl_coef: float = 0.0  # k3 KL to the reference policy; > 0 needs a reference model
    # The rollout's sampling temperature (`engine.temperature`): the policy trained, and its
    # reference and entropy, are softmax(logits / temperature), the distribution the engines
    # sample from and report behaviour log-probs of (0 = greedy, scaled by 1).
    temperature: float = 1.0
    # Entropy bonus (verl's entropy_coeff): the loss minus this times each token's entropy,
    # aggregated as the objective is; negative values minimise entropy instead.
    entropy_coef: float = 0.0
    aggregation: str = "token_mean"
    t_max: int | None = None  # the constant of seq_sum_over_const (max response length)
    mask_truncated: bool = False  # drop samples that hit the length limit from the loss
    # A non-finite loss or gradient skips its update (counted in `skipped_updates`); after this
    # many steps in a row with every update skipped the trainer stops the run instead of
    # publishing unchanged versions for ever. None = never stop.
    max_skipped_steps: int | None = 10

    def __post_init__(self) -> None:
        _counts(self, 1, "tbs", "group_size", "mini_batches", "epochs", "decay_steps")
        _counts(self, 0, "warmup_steps")
        _positive(self, "learning_rate", "adam_eps")
        _non_negative(self, "weight_decay", "kl_coef", "advantage_eps", "temperature")
        _non_negative(self, "eps_low", "eps_high", "eps_neg_low", "eps_neg_high", "eps_pos_high")
        if self.tbs % self.group_size:
            _fail("tbs", f"{self.tbs} must be a multiple of group_size={self.group_size}")
        if self.tbs % self.mini_batches:
            _fail("mini_batches", f"{self.mini_batches} must divide tbs={self.tbs}")
        mini = self.tbs // self.mini_batches
        if self.micro_batch_size is not None and (
            self.micro_batch_size <= 0 or mini % self.micro_batch_size
        ):
            _fail(
                "micro_batch_size",
                f"{self.micro_batch_size} must be positive and divide the mini-batch size "
                f"tbs / mini_batches = {mini}",
            )
        if self.micro_batch_tokens is not None and not is_count(self.micro_batch_tokens, 1):
            _fail(
                "micro_batch_tokens",
                f"{self.micro_batch_tokens!r} must be an integer >= 1 (or None)",
            )
        if not self.length_buckets or any(b <= 0 for b in self.length_buckets):
            _fail("length_buckets", f"{self.length_buckets} must be non-empty and positive")
        if tuple(sorted(self.length_buckets)) != tuple(self.length_buckets):
            _fail("length_buckets", f"{self.length_buckets} must be sorted ascending")
        if not math.isfinite(self.entropy_coef):
            _fail("entropy_coef", f"{self.entropy_coef} must be finite")
        if self.remat not in REMAT_POLICIES:
            _fail("remat", f"{self.remat!r} is not one of {sorted(REMAT_POLICIES)}")
        if self.schedule not in SCHEDULES:
            _fail("schedule", f"{self.schedule!r} is not one of {SCHEDULES}")
        if not 0.0 <= self.min_learning_rate_ratio <= 1.0:
            _fail("min_learning_rate_ratio", f"{self.min_learning_rate_ratio} must be in [0, 1]")
        if not (0.0 <= self.adam_b1 < 1.0 and 0.0 <= self.adam_b2 < 1.0):
            _fail("adam_b1", f"adam_b1={self.adam_b1}, adam_b2={self.adam_b2} must be in [0, 1)")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            _fail("max_grad_norm", f"{self.max_grad_norm} must be positive (or None)")
        if self.advantage not in advantage_lib.ADVANTAGES:
            _fail(
                "advantage", f"{self.advantage!r} is not one of {sorted(advantage_lib.ADVANTAGES)}"
            )
        if self.advantage in ("grpo", "dr_grpo", "rloo") and self.group_size < 2:
            # Each baseline is its group's mean (or the others'): a group of one has no
            # signal, every advantage 0, and training would run doing nothing.
            _fail("group_size", f"{self.advantage} needs group_size >= 2")
        if self.loss not in loss_lib.LOSSES:
            _fail("loss", f"{self.loss!r} is not one of {sorted(loss_lib.LOSSES)}")
        if self.eps_low >= 1.0 or self.eps_neg_low >= 1.0:
            _fail("eps_low", f"eps_low={self.eps_low}, eps_neg_low={self.eps_neg_low} must be < 1")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            _fail("clip_ratio_c", f"{self.clip_ratio_c} must be > 1 (or None)")
        if self.tis_cap is not None and self.tis_cap <= 0:
            _fail("tis_cap", f"{self.tis_cap} must be positive (or None)")
        if self.max_staleness is not None and self.max_staleness < 0:
            _fail("max_staleness", f"{self.max_staleness} must be >= 0 (or None)")
        if self.max_skipped_steps is not None and self.max_skipped_steps < 1:
            _fail("max_skipped_steps", f"{self.max_skipped_steps} must be >= 1 (or None)")
        if self.tis_cap is not None and self.max_staleness is None:
            _fail("max_staleness", "must be set when tis_cap is (past versions' params are kept)")
        if self.aggregation not in AGGREGATIONS:
            _fail("aggregation", f"{self.aggregation!r} is not one of {AGGREGATIONS}")
        if self.aggregation == "seq_sum_over_const" and (self.t_max is None or self.t_max <= 0):
            _fail("t_max", f"{self.t_max} must be a positive int for seq_sum_over_const")

    @property
    def mini_batch_size(self) -> int:
        return self.tbs // self.mini_batches

    @property
    def micro_batching(self) -> dict[str, int]:
        """`batch_lib.micro_batches`' keyword: the token budget if set, else rows per pass."""
        if self.micro_batch_tokens is not None:
            return {"tokens": self.micro_batch_tokens}
        return {"size": self.micro_batch_size or self.mini_batch_size}

    @classmethod
    def from_dict(cls, d: Any) -> TrainConfig:
        """From `config.train` (a dict or ConfigDict); unknown keys are an error."""
        return from_fields(cls, d, "train")


# Set from the rollout and engine config (`rollout.config_lib.train_config`), never in
# `config.train`.
ROLLOUT_FIELDS = ("tbs", "group_size", "max_staleness")
ENGINE_FIELDS = ("temperature",)


def config_section(**values: Any) -> ml_collections.ConfigDict:
    """A config file's `train` section: every field a user may set, at its default unless
    given here (`dataclass_section`)."""
    elsewhere = {f: "is set by the rollout config, not in config.train" for f in ROLLOUT_FIELDS}
    elsewhere |= {f: f"is engine.{f}, not set in config.train" for f in ENGINE_FIELDS}
    return dataclass_section(TrainConfig, "train", values, elsewhere)


def _fail(field: str, why: str) -> None:
    raise ValueError(f"train.{field}: {why}")


def _counts(config: TrainConfig, least: int, *names: str) -> None:
    for name in names:
        if not is_count(getattr(config, name), least):
            _fail(name, f"{getattr(config, name)!r} must be an integer >= {least}")


def _positive(config: TrainConfig, *names: str) -> None:
    for name in names:
        if not getattr(config, name) > 0:
            _fail(name, f"{getattr(config, name)} must be positive")


def _non_negative(config: TrainConfig, *names: str) -> None:
    for name in names:
        if not getattr(config, name) >= 0:
            _fail(name, f"{getattr(config, name)} must be >= 0")
