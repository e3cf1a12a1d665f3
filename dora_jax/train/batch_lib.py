"""Trajectories -> padded arrays: group check, length buckets, target alignment.

Each sample becomes one row `prompt + response`. Position t predicts token t + 1, so the loss
sits on positions [P - 1, P + R - 1) and the behaviour log-prob of response token j is placed at
position P - 1 + j, where the model's logits for that token are.

Rows are sorted by length inside a mini-batch before they are cut into micro-batches, and each
micro-batch is padded only to the smallest length bucket that holds its longest row, so one
long-tail sample pads its own micro-batch, not the whole batch; the few bucket lengths keep the
number of compiled shapes small.

Micro-batches hold either a fixed number of rows or as many rows as fit a token budget (verl's
`ppo_max_token_len_per_gpu`, AReaL's `max_tokens_per_mb`). With heavy-tailed lengths a fixed
count is a bad trade: sized for the longest responses, the short ones run many small passes;
sized for the short ones, a micro-batch of long ones does not fit in memory. Under a budget,
rows x padded width stays within it, so short rows go many to a pass and long ones few. The row
counts are powers of two (a micro-batch is padded with empty rows up to one), so each length
bucket compiles a handful of shapes, not one per count.
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
    # int32 [B]: index of each row's sample in the iteration batch; -1 for an empty row, which
    # only pads a token-budget micro-batch to its shape (all-zero mask)
    rows: np.ndarray

    @property
    def samples(self) -> np.ndarray:
        """Each row's sample index, for gathering per-sample values; an empty row reads the
        first row's (always a real one), which its zero mask keeps out of the loss and every
        metric, and which adds no version of its own to those the micro-batch holds."""
        return np.where(self.rows < 0, self.rows[0], self.rows)


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
    buckets: Sequence[int],
    mask_truncated: bool,
    *,
    size: int | None = None,
    tokens: int | None = None,
    min_rows: int = 1,
) -> list[MicroBatch]:
    """Cuts the samples at `rows` (one mini-batch), sorted by length, into padded micro-batches
    of `size` rows each, or of at most `tokens` padded tokens each (a row longer than that
    trains alone). Exactly one of the two is given. A token-budget micro-batch has at least
    `min_rows` rows (the training mesh's fsdp size: fewer rows than devices would not split
    over them, and every device would compute them all)."""
    if (size is None) == (tokens is None):
        raise ValueError("micro-batches take a number of rows or a token budget, not both")
    total = np.asarray(
        [len(samples[r].prompt_tokens) + len(samples[r].response_tokens) for r in rows]
    )
    by_length = np.argsort(total, kind="stable")
    order = np.asarray(rows)[by_length]
    if size is not None:
        if len(rows) % size:
            raise ValueError(f"{len(rows)} rows do not split into micro-batches of {size}")
        return [
            _pad(samples, order[i : i + size], buckets, mask_truncated)
            for i in range(0, len(order), size)
        ]
    assert tokens is not None
    cut: list[list[int]] = [[]]
    for r, length in zip(order, total[by_length], strict=True):
        width = bucket_length(int(length), buckets)  # the micro-batch's longest row so far
        if cut[-1] and len(cut[-1]) + 1 > _rows_within(tokens, width):
            cut.append([])
        cut[-1].append(int(r))
    return [
        _pad(
            samples,
            np.asarray(c),
            buckets,
            mask_truncated,
            rows_to=max(1 << (len(c) - 1).bit_length(), min_rows),
        )
        for c in cut
    ]


def _rows_within(tokens: int, width: int) -> int:
    """The most rows of `width` a micro-batch of `tokens` takes: the largest power of two that
    fits, and at least one."""
    return 1 << max((tokens // width).bit_length() - 1, 0)


def _pad(
    samples: Sequence[Trajectory],
    rows: np.ndarray,
    buckets: Sequence[int],
    mask_truncated: bool,
    rows_to: int = 0,
) -> MicroBatch:
    """The micro-batch of `rows`, with empty rows after them up to `rows_to` rows."""
    seqs = [samples[r] for r in rows]
    width = bucket_length(max(len(t.prompt_tokens) + len(t.response_tokens) for t in seqs), buckets)
    b = max(len(seqs), rows_to)
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
    padded_rows = np.full(b, -1, np.int32)
    padded_rows[: len(rows)] = rows
    return MicroBatch(tokens, positions, targets, mask, behaviour, padded_rows)


def token_versions(mb: MicroBatch, samples: Sequence[Trajectory]) -> np.ndarray:
    """int32 [B, T]: the version that sampled each target of `mb`, laid out as `_pad` lays out
    the behaviour log-probs (other positions, masked out, read their row's version). One version
    per row unless C1 is broken: `partial` continues a request under each new version."""
    versions = np.empty(mb.mask.shape, np.int32)
    for i, r in enumerate(mb.samples):
        t = samples[r]
        p = len(t.prompt_tokens)
        versions[i] = t.version
        versions[i, p - 1 : p - 1 + len(t.token_versions)] = t.token_versions
    return versions
