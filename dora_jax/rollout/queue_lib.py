"""The trajectory queue: groups of G samples from dispatch until they are trained.

The trainer takes complete groups only, exactly TBS samples (TBS / G groups) per iteration.
A group's samples may come from different versions (a regenerated sample, say); its deadline
is the last iteration that may train it, `min(sample versions) + K`, and batches are picked
earliest-deadline-first so that no group outlives the staleness bound (C3).
"""

from __future__ import annotations

import collections
import dataclasses
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
        for g in state["groups"]:
            done = [Trajectory.from_dict(t) for t in g["done"]]
            self._groups[g["prompt_id"]] = Group(
                g["prompt_id"],
                list(g["versions"]),
                {t.sample_index: t for t in done},
                g["completed_seq"],
            )

    def deadline(self, group: Group) -> int:
        return min(group.versions) + self.k

    def deadlines(self) -> list[int]:
        return [self.deadline(g) for g in self._groups.values()]

    def add_group(self, prompt_id: int, version: int) -> None:
        self._groups[prompt_id] = Group(prompt_id, [version] * self.group_size)

    def rebind(self, key: tuple[int, int], version: int) -> None:
        self._groups[key[0]].versions[key[1]] = version

    def finish(self, traj: Trajectory) -> None:
        group = self._groups[traj.prompt_id]
        group.versions[traj.sample_index] = traj.version
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
        # Groups left behind that are due by d, for each deadline d in increasing order.
        left_behind = collections.Counter(self.deadlines())
        left_behind.subtract(self.deadline(g) for g in chosen)
        left = 0
        for d in sorted(left_behind):
            left += left_behind[d]
            if left > (d - iteration) * b:
                return None
        for g in chosen:
            del self._groups[g.prompt_id]
        return [g.done[i] for g in chosen for i in range(self.group_size)]
