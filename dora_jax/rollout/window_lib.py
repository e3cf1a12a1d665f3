"""The sliding version window: which policy versions are live, and what may still be started.

At most K+1 versions are live (`|W| <= K+1`): the newest published one and every older one
that still has untrained samples. The oldest retires only once all its trajectories have been
collected; until then the trainer cannot advance past the bound (the trajectory queue makes it
wait). New work for version w is admitted only if, with it, every group can still be trained
by its deadline: for every deadline d, the groups due by d fit in the iterations left up to d.
"""

from __future__ import annotations

import collections

from dora_jax.rollout.queue_lib import TrajectoryQueue


class VersionWindow:
    def __init__(self, queue: TrajectoryQueue):
        self.queue = queue
        self.newest = 0  # the newest published policy version

    @property
    def k(self) -> int:
        return self.queue.k

    def live(self) -> list[int]:
        """Live versions, oldest first."""
        return sorted(self.queue.untrained_versions() | {self.newest})

    def admits(self, version: int, next_iteration: int, new_groups: int = 1) -> bool:
        """Can `new_groups` more groups at `version` start and still be trained within K?"""
        deadline = version + self.k
        if version > self.newest or deadline < next_iteration:
            return False
        due = collections.Counter(self.queue.due_by_deadline())
        due[deadline] += new_groups
        return self.queue.fits(due, next_iteration)
