"""The trajectory queue: groups of G samples from dispatch until they are trained.

The trainer takes complete groups only, exactly TBS samples (TBS / G groups) per iteration.
A group's samples may come from different versions (a regenerated sample, say); its deadline
is the last iteration that may train it, `min(sample versions) + K`, and batches are picked
earliest-deadline-first so that no group outlives the staleness bound (C3).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any

from dora_jax.rollout.trajectory_lib import Trajectory


@dataclasses.dataclass
class Group:
    prompt_id: int
    versions: list[int]  # bound version per sample
    done: dict[int, Trajectory] = dataclasses.field(default_factory=dict)
    completed_seq: int = -1  # logical order in which the group completed

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.versions)


class TrajectoryQueue:
    def __init__(self, group_size: int, staleness_bound: int, groups_per_batch: int):
        self.group_size = group_size
        self.k = staleness_bound
        self.groups_per_batch = groups_per_batch
        self._groups: dict[int, Group] = {}  # untrained groups by prompt id, in dispatch order
        # Untrained groups per deadline, kept up to date on every change: the window's
        # admission test reads it for every group a turn dispatches.
        self._due: collections.Counter[int] = collections.Counter()
        self._seq = 0

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: every untrained group with its finished trajectories."""
        return {
            "seq": self._seq,
            "groups": [
                {
                    "prompt_id": g.prompt_id,
                    "versions": list(g.versions),
                    "completed_seq": g.completed_seq,
                    "done": [t.to_dict() for _, t in sorted(g.done.items())],
                }
                for g in self._groups.values()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seq = state["seq"]
        self._groups = {}
        self._due.clear()
        for g in state["groups"]:
            done = [Trajectory.from_dict(t) for t in g["done"]]
            self._add(
                Group(
                    g["prompt_id"],
                    list(g["versions"]),
                    {t.sample_index: t for t in done},
                    g["completed_seq"],
                )
            )

    def deadline(self, group: Group) -> int:
        return min(group.versions) + self.k

    def due_by_deadline(self) -> Mapping[int, int]:
        """Untrained groups per deadline (read-only view; no zero counts)."""
        return self._due

    def add_group(self, prompt_id: int, version: int) -> None:
        self._add(Group(prompt_id, [version] * self.group_size))

    def rebind(self, key: tuple[int, int], version: int) -> None:
        self._set_version(self._groups[key[0]], key[1], version)

    def finish(self, traj: Trajectory) -> None:
        group = self._groups[traj.prompt_id]
        self._set_version(group, traj.sample_index, traj.version)
        group.done[traj.sample_index] = traj
        if group.complete:
            group.completed_seq = self._seq
            self._seq += 1

    def untrained_versions(self) -> set[int]:
        return {v for g in self._groups.values() for v in g.versions}

    def queued(self) -> list[Trajectory]:
        """Finished trajectories waiting to be trained, in a fixed order."""
        return [t for g in self._groups.values() for _, t in sorted(g.done.items())]

    def select_batch(self, iteration: int) -> list[Trajectory] | None:
        """TBS samples for `iteration`, or None when the trainer must wait.

        Earliest-deadline-first over complete groups; it waits rather than leave behind more
        groups due by some iteration d than the iterations up to d can still train.
        """
        b = self.groups_per_batch
        complete = sorted(
            (g for g in self._groups.values() if g.complete),
            key=lambda g: (self.deadline(g), g.completed_seq),
        )
        if len(complete) < b:
            return None
        chosen = complete[:b]
        left_behind = collections.Counter(self._due)
        left_behind.subtract(self.deadline(g) for g in chosen)
        if not self.fits(left_behind, iteration + 1):
            return None
        for g in chosen:
            self._remove(g)
        return [g.done[i] for g in chosen for i in range(self.group_size)]

    def fits(self, due: Mapping[int, int], first_iteration: int) -> bool:
        """Whether groups due by each deadline (`due`: groups per deadline) can all be trained
        from `first_iteration` on, `groups_per_batch` an iteration: C3's feasibility, which
        admission (`VersionWindow.admits`) and batch selection both keep. One pass over at most
        K+2 deadlines: admission asks for every group a turn dispatches."""
        total = 0
        for d in sorted(due):
            total += due[d]
            if total > (d - first_iteration + 1) * self.groups_per_batch:
                return False
        return True

    def _add(self, group: Group) -> None:
        self._groups[group.prompt_id] = group
        self._due[self.deadline(group)] += 1

    def _remove(self, group: Group) -> None:
        del self._groups[group.prompt_id]
        self._uncount(self.deadline(group))

    def _set_version(self, group: Group, sample_index: int, version: int) -> None:
        self._uncount(self.deadline(group))
        group.versions[sample_index] = version
        self._due[self.deadline(group)] += 1

    def _uncount(self, deadline: int) -> None:
        self._due[deadline] -= 1
        if not self._due[deadline]:
            del self._due[deadline]
