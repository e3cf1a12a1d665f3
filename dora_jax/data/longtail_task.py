"""The built-in task: a walk around a clock, with heavy-tailed walk lengths.

Why this task: DORA's problem is that response lengths are heavy-tailed, so a synchronous step
waits for a few long trajectories. This task makes that real on a CPU with a tiny model.

Problem `(s, d, t)` on the ring Z_M (M prime, so every step d generates the ring): start at s,
add d (mod M) repeatedly, and write every value visited until t is reached. Prompt
`"{s}+{d}>{t}="`, answer the visited values, one symbol of `SYMBOLS` each ("5" is 5, "b" is
11, "e" is 14): with M=47, `"5+3>e="` -> `"8be"` (5+3=8, 8+3=11, 11+3=14).
The walk length k (the response length) is the problem size, drawn from a truncated power
law P(k) ~ k^-alpha on 1..M-1, so lengths are heavy-tailed over the prompt distribution
(M=47, alpha=1.2: median 3, p99 43 characters).

Why it is learnable by a 2-layer model: each output token depends on the previous token and on
two prompt symbols only (next = previous + d; stop with EOS right after writing t); no counting
and no long-range alignment. Why RL still has room after a short SFT: every step must be right
for an exact match, so the per-token error of a briefly trained model compounds over long walks,
and demonstrations may carry per-character noise (`demonstrations(noise=...)`) that supervised
learning copies into the policy's sampling distribution while an exact-match reward removes it.
Held-out accuracy is meant at the sampling temperature RL optimises (pass@1 of samples).
Measured (2 layers, hidden 64, AdamW 3e-3, batch 64, 2 CPU cores): clean demonstrations, 800
steps -> held-out 99% greedy / 98% sampled (nothing left for RL); noise 0.1, 600 steps (~100 s)
-> 71% greedy / 44% sampled (67% on walks <= 3, 6% on walks > 10), room for RL to gain.

Train and held-out problems are disjoint: a fixed `split_seed` assigns every (s, d, k) triple to
one split, whatever seed the rows are sampled with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dora_jax.data.tokenizer_lib import Tokenizer, char_tokenizer

SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
MARKERS = "+>="
SPLITS = ("train", "heldout")
REWARD = "exact_match"  # the registry name of this task's reward: the walk is the answer


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, int(n**0.5) + 1))


@dataclasses.dataclass(frozen=True)
class LongTailTask:
    modulus: int = 47
    max_step: int = 3
    alpha: float = 1.2
    heldout_fraction: float = 0.2
    split_seed: int = 0

    def __post_init__(self) -> None:
        if not _is_prime(self.modulus) or self.modulus + len(MARKERS) + 3 > 64:
            raise ValueError(
                f"task.modulus must be a prime with modulus + {len(MARKERS) + 3} <= 64 "
                f"(the vocabulary), got {self.modulus}"
            )
        if not 1 <= self.max_step < self.modulus:
            raise ValueError(f"task.max_step must be in [1, modulus), got {self.max_step}")
        if self.alpha < 0:
            raise ValueError(f"task.alpha must be >= 0, got {self.alpha}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(
                f"task.heldout_fraction must be in (0, 1), got {self.heldout_fraction}"
            )

    @property
    def alphabet(self) -> str:
        return SYMBOLS[: self.modulus] + MARKERS

    def tokenizer(self) -> Tokenizer:
        return char_tokenizer(self.alphabet)

    @property
    def max_prompt_len(self) -> int:
        return 6  # "s+d>t="

    @property
    def max_response_len(self) -> int:
        return self.modulus  # M-1 values + EOS

    def problem(self, s: int, d: int, k: int) -> dict[str, str]:
        """The row for the walk of k steps of d from s: `{"prompt": ..., "answer": ...}`."""
        m = self.modulus
        if not (0 <= s < m and 1 <= d <= self.max_step and 1 <= k < m):
            raise ValueError(f"problem (s={s}, d={d}, k={k}) is outside the task's ranges")
        walk = [(s + i * d) % m for i in range(1, k + 1)]
        prompt = f"{SYMBOLS[s]}+{SYMBOLS[d]}>{SYMBOLS[walk[-1]]}="
        return {"prompt": prompt, "answer": "".join(SYMBOLS[v] for v in walk)}

    def _split_problems(self, split: str) -> np.ndarray:
        """All (s, d, k) of one split, as rows of an int array."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        m = self.modulus
        grid = np.stack(
            np.meshgrid(np.arange(m), np.arange(1, self.max_step + 1), np.arange(1, m),
                        indexing="ij"), -1).reshape(-1, 3)  # fmt: skip
        heldout = np.random.default_rng(self.split_seed).random(len(grid)) < self.heldout_fraction
        return grid[heldout if split == "heldout" else ~heldout]

    def rows(self, split: str, n: int, seed: int) -> list[dict[str, str]]:
        """n problems of `split`, drawn with replacement with P(problem) ~ k^-alpha."""
        problems = self._split_problems(split)
        weights = problems[:, 2].astype(np.float64) ** -self.alpha
        picks = np.random.default_rng(seed).choice(len(problems), n, p=weights / weights.sum())
        return [self.problem(*map(int, problems[i])) for i in picks]

    def demonstrations(
        self, rows: Sequence[dict[str, str]], noise: float, seed: int
    ) -> list[tuple[str, str]]:
        """(prompt, response) pairs for SFT; each answer character is replaced, with
        probability `noise`, by a random value symbol (the EOS position is never noised)."""
        if not 0 <= noise < 1:
            raise ValueError(f"demonstration noise must be in [0, 1), got {noise}")
        rng = np.random.default_rng(seed)
        out = []
        for row in rows:
            chars = list(row["answer"])
            for i in np.flatnonzero(rng.random(len(chars)) < noise):
                chars[i] = SYMBOLS[rng.integers(self.modulus)]
            out.append((row["prompt"], "".join(chars)))
        return out


def length_stats(rows: Sequence[dict[str, str]]) -> dict[str, float]:
    """p50 / p99 / max of response lengths in tokens (answer characters + EOS)."""
    lengths = np.asarray([len(r["answer"]) + 1 for r in rows], np.float64)
    p50, p99 = np.percentile(lengths, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "max": float(lengths.max()),
            "p99_over_p50": float(p99 / p50)}  # fmt: skip
