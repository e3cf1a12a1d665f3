"""The rollout's logical clock: the only time its decisions read.

DESIGN asks that the same config and seed give the same ledger. So nothing the orchestrator
decides may depend on how fast a host happens to be: when the periodic trigger fires, and when
the trainer's new version is taken up, are read from a clock counted in decode steps (a turn
of the loop advances it by the steps it ran), never from the wall. The trainer is given
`publish_delay_steps` of this clock per step, the logical stand-in for its step's duration;
where the real step takes longer, the controller waits for it, which costs time but changes no
decision. Wall-clock time (`observe.trace_lib.TraceWriter.now_us`) is read for the trace and
the metrics only.
"""

from __future__ import annotations

from typing import Any


class LogicalClock:
    """Decode steps so far (`tick`), the orchestrator's timer, and when versions are due."""

    def __init__(self, timer_steps: int, publish_delay_steps: int):
        if timer_steps < 1 or publish_delay_steps < 0:
            raise ValueError(
                f"timer_steps must be >= 1 and publish_delay_steps >= 0, got {timer_steps} "
                f"and {publish_delay_steps}"
            )
        self.timer_steps = timer_steps
        self.publish_delay_steps = publish_delay_steps
        self.tick = 0
        self._timer_tick = 0  # the timer's next multiple of `timer_steps` not yet fired
        self._taken_up_tick = 0  # when the last version was taken up

    def advance(self, steps: int) -> None:
        if steps < 0:
            raise ValueError(f"the clock cannot go back ({steps} steps)")
        self.tick += steps

    def timer_fired(self) -> bool:
        """Whether the timer fires now: once at the first check at or after each multiple of
        `timer_steps` (several multiples passed within one turn fire once)."""
        if self.tick < self._timer_tick:
            return False
        self._timer_tick = (self.tick // self.timer_steps + 1) * self.timer_steps
        return True

    def version_due(self, handed_tick: int) -> bool:
        """Whether the version trained from the batch handed over at `handed_tick` is due: at
        `publish_delay_steps` after the later of that and the previous version's take-up,
        since the trainer's steps run one after another."""
        return self.tick >= max(handed_tick, self._taken_up_tick) + self.publish_delay_steps

    def took_up_version(self) -> None:
        self._taken_up_tick = self.tick

    def state_dict(self) -> dict[str, int]:
        """JSON-able: a clock loaded from it goes on exactly as this one."""
        return {
            "tick": self.tick,
            "timer_tick": self._timer_tick,
            "taken_up_tick": self._taken_up_tick,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checkpoints from before `taken_up_tick` was saved were all taken at a barrier, where
        no batch is with the trainer: the next is handed over at or after `tick`, so 0 is as
        good as the take-up it lost."""
        self.tick = state["tick"]
        self._timer_tick = state["timer_tick"]
        self._taken_up_tick = state.get("taken_up_tick", 0)
