"""Trajectories -> padded arrays: group check, length buckets, target alignment.

Each sample becomes one row `prompt + response`. Position t predicts token t + 1, so the loss
sits on positions [P - 1, P + R - 1) and the behaviour log-prob of response token j is placed at
position P - 1 + j, where the model's logits for that token are.

Rows are sorted by length inside a mini-batch before they are cut into micro-batches, and each
micro-batch is padded only to the smallest length bucket that holds its longest row, so one
long-tail sample pads its own micro-batch, not the whole batch; the few bucket lengths keep the
number of compiled shapes small.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from dora_jax.rollout.trajectory_lib import Trajectory


class MicroBatch(NamedTuple):
    tokens: np.ndarray  # int32 [B, T]: prompt + response, zero-padded
    positions: np.ndarray  # int32 [B, T]
    targets: np.ndarray  # int32 [B, T]: tokens shifted left by one
    mask: np.ndarray  # float32 [B, T]: 1 where the target is a trained response token
    behaviour_logp: np.ndarray  # float32 [B, T]: inference log-prob of each target (0 off mask)
    rows: np.ndarray  # int32 [B]: index of each row's sample in the iteration batch


def group_batch(trajectories: Sequence[Trajectory], tbs: int, group_size: int) -> list[Trajectory]:
    """Checks C3's batch shape (exactly `tbs` samples in complete groups of `group_size`) and
    returns the samples ordered by (prompt_id, sample_index), so groups are contiguous."""
    if len(trajectories) != tbs:
        raise ValueError(
            f"a training batch must hold exactly tbs={tbs} samples, got {len(trajectories)}"
        )
    groups: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        groups[t.prompt_id].append(t)
    for prompt_id, members in groups.items():
        indices = sorted(t.sample_index for t in members)
        if indices != list(range(group_size)):
            raise ValueError(
                f"prompt {prompt_id}: group is not complete, sample indices {indices} "
                f"(expected 0..{group_size - 1} once each)"
            )
        if any(len(t.prompt_tokens) == 0 for t in members):
            raise ValueError(f"prompt {prompt_id}: empty prompt (a response needs a context)")
    return [t for pid in sorted(groups) for t in sorted(groups[pid], key=lambda t: t.sample_index)]


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= length, else the next multiple of the largest bucket."""
    for b in buckets:
        if length <= b:
            return b
    top = buckets[-1]
    return -(-length // top) * top


def loss_lengths(samples: Sequence[Trajectory], mask_truncated: bool) -> np.ndarray:
    """Loss tokens of each sample: its response length, or 0 if it is masked out."""
    return np.asarray(
        [0 if (mask_truncated and t.truncated) else len(t.response_tokens) for t in samples],
        np.int64,
    )


def micro_batches(
    samples: Sequence[Trajectory],
    rows: np.ndarray,
    micro_batch: int,
    buckets: Sequence[int],
    mask_truncated: bool,
) -> list[MicroBatch]:
    """Cuts the samples at `rows` (one mini-batch) into padded micro-batches of `micro_batch`."""
    if len(rows) % micro_batch:
        raise ValueError(f"{len(rows)} rows do not split into micro-batches of {micro_batch}")
    total = [len(samples[r].prompt_tokens) + len(samples[r].response_tokens) for r in rows]
    order = np.asarray(rows)[np.argsort(total, kind="stable")]
    return [
        _pad(samples, order[i : i + micro_batch], buckets, mask_truncated)
        for i in range(0, len(order), micro_batch)
    ]


def _pad(
    samples: Sequence[Trajectory], rows: np.ndarray, buckets: Sequence[int], mask_truncated: bool
) -> MicroBatch:
    seqs = [samples[r] for r in rows]
    width = bucket_length(max(len(t.prompt_tokens) + len(t.response_tokens) for t in seqs), buckets)
    b = len(seqs)
    tokens = np.zeros((b, width), np.int32)
    mask = np.zeros((b, width), np.float32)
    behaviour = np.zeros((b, width), np.float32)
    for i, t in enumerate(seqs):
        p, r = len(t.prompt_tokens), len(t.response_tokens)
        tokens[i, :p] = t.prompt_tokens
        tokens[i, p : p + r] = t.response_tokens
        behaviour[i, p - 1 : p - 1 + r] = t.behaviour_logprobs
        if not (mask_truncated and t.truncated):
            mask[i, p - 1 : p - 1 + r] = 1.0
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (b, width)).copy()
    return MicroBatch(tokens, positions, targets, mask, behaviour, np.asarray(rows, np.int32))
