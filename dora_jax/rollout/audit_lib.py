"""`dora-jax audit WORKDIR`: re-checks C1-C3 from the ledger alone and reports length bias.

Length bias compares the response lengths of trained samples with those of all finished ones
(trained or queued at the end) and of all dispatched ones (the unfinished at their length so
far, a lower bound): a scheme that drops or defers long trajectories shows shorter trained
responses than either.

Independent of the runtime on purpose: it trusts nothing but `ledger.jsonl`, so a bug in the
orchestrator's own bookkeeping cannot hide a lost, duplicated or too-stale sample. Besides
C1-C3 it checks that the run `completed`: a crashed run's ledger still ends with an `end`
event (the runner writes it on the way out, on Ctrl-C and SIGTERM too), whose `stopped` says
so, and it is no clean run; a killed run's (SIGKILL, out of memory) has none and fails as such.
A ledger that cannot be read (missing, cut off mid-write, an event without a key) is a
failure too: `main` prints the reason, naming the file and line, instead of auditing part of it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from dora_jax.rollout import ledger_lib

# How a ledger without an end event stopped: the runner writes one however a run ends, unless
# the process is killed outright (SIGKILL, out of memory).
_KILLED = "killed: the ledger has no end event"


@dataclasses.dataclass
class LengthStats:
    count: int
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, lengths: list[int]) -> LengthStats:
        if not lengths:
            return cls(0, 0.0, 0.0, 0.0)
        a = np.asarray(lengths, np.float64)
        return cls(
            len(a), float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 99))
        )


@dataclasses.dataclass
class AuditReport:
    """Pass/fail per rule with the evidence, plus the counters the runtime also keeps."""

    rules: dict[str, bool]
    problems: dict[str, list[str]]
    mode: str
    dispatched: int
    trained: int
    iterations: int
    c1_violations: int
    max_staleness: int
    staleness_histogram: dict[int, int]
    in_flight_at_end: int
    queued_at_end: int
    trained_lengths: LengthStats
    finished_lengths: LengthStats
    # Every dispatched sample, the unfinished ones at their length so far (None: a ledger from
    # before the end event recorded those).
    dispatched_lengths: LengthStats | None
    # How the run stopped (`end.stopped`; a ledger from before that key reads as completed)
    # and the iterations it was asked for (`end.num_iterations`, None where not written).
    stopped: str = ledger_lib.COMPLETED
    num_iterations: int | None = None

    @property
    def passed(self) -> bool:
        return all(self.rules.values())

    def format(self) -> str:
        head = f"audit of a {self.mode!r} run: {'PASS' if self.passed else 'FAIL'}"
        if self.stopped != ledger_lib.COMPLETED:
            # First line, not only under its rule: every other number below describes a run
            # cut short.
            head += f" (the run did not complete: {self.stopped})"
        lines = [head]
        for rule, ok in self.rules.items():
            lines.append(f"  {rule}: {'pass' if ok else 'FAIL'}")
            lines += [f"    - {p}" for p in self.problems[rule][:10]]
            if len(self.problems[rule]) > 10:
                lines.append(f"    ... {len(self.problems[rule]) - 10} more")
        planned = "" if self.num_iterations is None else f" of {self.num_iterations}"
        lines.append(
            f"  samples: {self.dispatched} dispatched, {self.trained} trained in "
            f"{self.iterations}{planned} iterations, {self.in_flight_at_end} in flight and "
            f"{self.queued_at_end} queued at the end"
        )
        lines.append(
            f"  C1 violations: {self.c1_violations}; max staleness {self.max_staleness}; "
            f"staleness histogram {dict(sorted(self.staleness_histogram.items()))}"
        )
        lengths = [("trained", self.trained_lengths), ("finished", self.finished_lengths)]
        if self.dispatched_lengths is not None:
            lengths.append(("dispatched (unfinished: so far)", self.dispatched_lengths))
        for name, s in lengths:
            lines.append(
                f"  response length of {name} samples: n={s.count} mean={s.mean:.1f} "
                f"p50={s.p50:.1f} p99={s.p99:.1f}"
            )
        return "\n".join(lines)


def audit_events(events: list[dict[str, Any]]) -> AuditReport:
    """Audits a ledger's events; raises `ledger_lib.LedgerError` for one the audit cannot read."""
    for i, e in enumerate(events):
        try:
            ledger_lib.check_event(e)
        except ledger_lib.LedgerError as err:
            raise ledger_lib.LedgerError(f"event {i}: {err}") from None
    problems: dict[str, list[str]] = {"C1": [], "C2": [], "C3": [], "completed": []}
    starts = [e for e in events if e["event"] == "start"]
    ends = [e for e in events if e["event"] == "end"]
    dispatches = [e for e in events if e["event"] == "dispatch"]
    trains = [e for e in events if e["event"] == "train"]
    if len(starts) != 1:
        problems["C3"].append(f"expected one start event with the bounds, found {len(starts)}")
    start = starts[0] if starts else {}
    k = start.get("staleness_bound")
    tbs = start.get("train_batch_size")
    g = start.get("group_size")

    # C1: every token of a trajectory from one version.
    c1 = 0
    for e in trains:
        if not (e["version"] == e["first_token_version"] == e["last_token_version"]):
            c1 += 1
            problems["C1"].append(
                f"sample {e['prompt_id']}/{e['sample_index']}: version {e['version']}, tokens "
                f"from {e['first_token_version']} to {e['last_token_version']}"
            )

    # C2: started => trained exactly once or still in flight / queued; groups complete.
    dispatched = {(e["prompt_id"], e["sample_index"]) for e in dispatches}
    trained_count = collections.Counter((e["prompt_id"], e["sample_index"]) for e in trains)
    for key, n in sorted(trained_count.items()):
        if n > 1:
            problems["C2"].append(f"sample {key} trained {n} times")
        if key not in dispatched:
            problems["C2"].append(f"sample {key} trained but never dispatched")
    if len(ends) > 1:
        problems["C2"].append(f"expected one end event, found {len(ends)}")
    end = ends[-1] if ends else {"in_flight": [], "queued": [], "stopped": _KILLED}
    in_flight = {tuple(k_) for k_ in end["in_flight"]}
    queued = {tuple(k_) for k_ in end["queued"]}
    for key in sorted(in_flight & queued):
        problems["C2"].append(f"sample {key} listed both in flight and queued")
    for key in sorted((in_flight | queued) & set(trained_count)):
        problems["C2"].append(f"sample {key} trained and still listed at the end")
    untrained = sorted(dispatched - set(trained_count) - in_flight - queued)
    per_iter = collections.Counter(e["iteration"] for e in trains)
    # A kill can land while an iteration's train events are being written: that iteration's
    # part is what the kill cut off, not a batch trained short (the resumed run rewrites it).
    cut = max(per_iter) if not ends and per_iter and per_iter[max(per_iter)] != tbs else None
    if not ends:  # what was unfinished is not known, so none of it can be called lost
        written = "" if cut is None else f" (and iteration {cut}'s train events were cut off)"
        problems["C2"].append(
            f"no end event, so the {len(untrained)} dispatched samples not trained cannot be "
            f"checked{written}: the run was killed; a rerun of its command resumes from its "
            "newest checkpoint, and the resumed run's ledger is audited whole"
        )
    else:
        for key in untrained:
            problems["C2"].append(f"sample {key} dispatched, never trained, not in flight: lost")
    groups: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for e in trains:
        groups[(e["iteration"], e["prompt_id"])].append(e["sample_index"])
    for (it, pid), idx in sorted(groups.items()):
        if g is not None and sorted(idx) != list(range(g)) and it != cut:
            problems["C2"].append(f"iteration {it}: group {pid} trained incomplete ({sorted(idx)})")

    # C3: bounded staleness and exactly TBS per iteration. Staleness is only as true as the
    # versions it is computed from: the trainer's must be its iteration's (it trains version i
    # into i + 1), and the sample's the one its last dispatch started it under.
    started_under = {(e["prompt_id"], e["sample_index"]): e["version"] for e in dispatches}
    hist = collections.Counter()
    for e in trains:
        name = f"sample {e['prompt_id']}/{e['sample_index']}"
        s = e["trainer_version"] - e["version"]
        hist[s] += 1
        if s != e["staleness"]:
            problems["C3"].append(f"{name}: bad staleness")
        if e["trainer_version"] != e["iteration"]:
            problems["C3"].append(
                f"{name}: trained in iteration {e['iteration']} by trainer version "
                f"{e['trainer_version']}"
            )
        dispatched_as = started_under.get((e["prompt_id"], e["sample_index"]))
        if dispatched_as is not None and dispatched_as != e["version"]:
            problems["C3"].append(
                f"{name}: trained as version {e['version']}, dispatched under {dispatched_as}"
            )
        if k is not None and not 0 <= s <= k:
            problems["C3"].append(f"{name} trained at staleness {s} > K={k}")
    for it, n in sorted(per_iter.items()):
        if tbs is not None and n != tbs and it != cut:
            problems["C3"].append(f"iteration {it} trained {n} samples, TBS={tbs}")
    skipped = sorted(set(range(max(per_iter, default=-1) + 1)) - set(per_iter))
    if skipped:
        problems["C3"].append(f"iterations {skipped} trained no samples")

    # completed: the run stopped on its own, after every iteration it was asked for.
    stopped = end.get("stopped", ledger_lib.COMPLETED)
    num_iterations = end.get("num_iterations")
    trained_iters = len(per_iter)
    of = "" if num_iterations is None else f" of {num_iterations}"
    if stopped != ledger_lib.COMPLETED:
        problems["completed"].append(
            f"the run stopped early after {trained_iters}{of} iterations: {stopped}"
        )
    elif num_iterations is not None and trained_iters < num_iterations:
        problems["completed"].append(
            f"the end event says completed, but {trained_iters}{of} iterations were trained"
        )

    trained_lengths = [e["response_length"] for e in trains]
    finished_lengths = trained_lengths + list(end.get("queued_response_lengths", []))
    unfinished_lengths = end.get("in_flight_response_lengths")
    return AuditReport(
        rules={rule: not p for rule, p in problems.items()},
        problems=problems,
        mode=start.get("mode", "?"),
        dispatched=len(dispatched),
        trained=len(trains),
        iterations=len(per_iter),
        c1_violations=c1,
        max_staleness=max(hist) if hist else 0,
        staleness_histogram=dict(hist),
        in_flight_at_end=len(in_flight),
        queued_at_end=len(queued),
        trained_lengths=LengthStats.of(trained_lengths),
        finished_lengths=LengthStats.of(finished_lengths),
        dispatched_lengths=None
        if unfinished_lengths is None
        else LengthStats.of(finished_lengths + unfinished_lengths),
        stopped=stopped,
        num_iterations=num_iterations,
    )


def audit(workdir: str) -> AuditReport:
    """Audits `workdir/ledger.jsonl`."""
    return audit_events(ledger_lib.read(workdir))


def main(workdir: str) -> int:
    """Prints the audit of `workdir` and returns the process exit code: 1 if a rule fails or
    the ledger cannot be read (one line naming the file, and the line, instead of a traceback)."""
    try:
        report = audit(workdir)
    except ledger_lib.LedgerError as e:
        print(f"audit of {workdir}: FAIL: {e}")
        return 1
    print(report.format())
    return 0 if report.passed else 1
