"""The rollout paradigms, by name: `sync`, `one_step_off`, `partial`, `dora`.

All four run in the same loop (`runner_lib`), same model, same data; a paradigm only decides
(1) its bounds (K, RBS), (2) what to dispatch under which version, (3) which instance hosts
which version and what moves between instances, (4) whether spare slots take extra work.
Every dispatch also passes the version window's admission test, so C3 holds by construction;
`partial` breaks C1 on purpose (re-prefill under the new version mid-trajectory) and the ledger
shows it. Add a paradigm by subclassing `Paradigm` and registering it in `PARADIGMS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dora_jax.rollout import orchestrator_lib

if TYPE_CHECKING:
    from dora_jax.rollout.config_lib import RolloutConfig
    from dora_jax.rollout.runner_lib import Rollout


def prompts_left(r: Rollout) -> int:
    """Groups the prompt source can still give: a source with a length (`len(r.prompts)`) is a
    finite workload, e.g. the benchmark's, so that every paradigm trains exactly the same
    samples; a plain callable is an endless stream."""
    try:
        return len(r.prompts) - r.next_prompt  # type: ignore[arg-type]
    except TypeError:
        return 1 << 62


class Paradigm:
    def bounds(self, config: RolloutConfig) -> tuple[int, int]:
        """(staleness bound K, samples kept in flight RBS)."""
        return config.staleness_bound, config.rollout_batch_size

    def top_up(self, r: Rollout) -> None:
        """Keeps RBS samples outstanding, all new ones under the newest version."""
        g = r.config.group_size
        outstanding = sum(r.outstanding().values())
        while (
            outstanding + g <= r.rollout_batch_size
            and prompts_left(r) > 0
            and r.window.admits(r.window.newest, r.selected)
        ):
            r.dispatch_group(r.window.newest)
            outstanding += g

    def rebalance(self, r: Rollout, triggers: set[str]) -> None:
        """An empty instance takes the oldest version with work waiting (no migrations)."""
        waiting = sorted(v for v, q in r.pending.items() if q)
        for x in r.healthy():
            if waiting and not x.active() and x.version not in waiting:
                holder = next((y for y in r.healthy() if y.version == waiting[0]), None)
                r.load(x, waiting[0], holder)

    def fill_spare(self, r: Rollout) -> None:
        """Only `dora` gives spare slots extra work."""


class Sync(Paradigm):
    """Generate exactly one batch under the newest version, train on it, repeat (K = 0)."""

    def bounds(self, config: RolloutConfig) -> tuple[int, int]:
        return 0, config.train_batch_size

    def top_up(self, r: Rollout) -> None:
        b = r.config.groups_per_batch
        if (
            r.dispatched_per_version[r.window.newest] < b
            and prompts_left(r) >= b
            and r.window.admits(r.window.newest, r.selected, b)
        ):
            for _ in range(b):
                r.dispatch_group(r.window.newest)


class OneStepOff(Sync):
    """Batch i+1 is generated (under version i) while batch i trains: staleness exactly 1.

    Version 0 generates the first two batches (the first trains at staleness 0).
    """

    def bounds(self, config: RolloutConfig) -> tuple[int, int]:
        return 1, config.train_batch_size

    def top_up(self, r: Rollout) -> None:
        b = r.config.groups_per_batch
        v = r.window.newest
        quota = 2 * b if v == 0 else b
        while (
            r.dispatched_per_version[v] < quota
            and prompts_left(r) >= b
            and r.window.admits(v, r.selected, b)
        ):
            for _ in range(b):
                r.dispatch_group(v)


class Partial(Paradigm):
    """AReaL / Kimi-style partial rollout: at each weight update every in-flight request is
    interrupted, the instance loads the new version, and the request is re-prefilled (prompt
    plus its tokens so far) and continued: tokens of one trajectory from several versions."""

    def rebalance(self, r: Rollout, triggers: set[str]) -> None:
        newest = r.window.newest
        r.rebind_pending(list(r.pending))  # not started: just rebind
        for x in r.healthy():
            if x.version == newest:
                continue
            interrupted = r.interrupt(x)
            holder = next((y for y in r.healthy() if y.version == newest), None)
            r.load(x, newest, holder)
            if not x.healthy:  # the load failed: what it had generated goes with the instance
                r.requeue(interrupted)
            elif interrupted:
                r.start([(x, list(zip(interrupted, x.free(), strict=False)))])
                r.telemetry.counters["reprefills"] += len(interrupted)


class Dora(Paradigm):
    """Multi-version streaming rollout (DESIGN.md): over-provisioning, the version window,
    proportional instance allocation with weight moves and request migration on triggers,
    and staleness-aware filling of spare slots."""

    def rebalance(self, r: Rollout, triggers: set[str]) -> None:
        # Work not started yet under a version no instance hosts would wait for an instance that
        # a tail or a newer version holds; under the newest version it starts sooner, fresher.
        hosted = {x.version for x in r.healthy()}
        moved = r.rebind_pending([v for v in list(r.pending) if v not in hosted])
        r.telemetry.counters["rebound"] += moved
        if not triggers:
            return
        healthy = r.healthy()
        views = [
            orchestrator_lib.InstanceView(x.index, x.version, tuple(x.active()), tuple(x.free()))
            for x in healthy
        ]
        targets = orchestrator_lib.allocate(len(healthy), r.outstanding())
        plan = orchestrator_lib.plan(views, targets, set(r.staged))
        for m in plan.migrations:
            r.migrate(r.instances[m.src], m.src_slot, r.instances[m.dst], m.dst_slot)
        for move in plan.weight_moves:
            x = r.instances[move.instance]
            if x.active():  # a migration off it failed, taking out its destination: `x`
                continue  # keeps its version and requests, and the next trigger replans
            source = None if move.source is None else r.instances[move.source]
            r.load(x, move.version, source)

    def fill_spare(self, r: Rollout) -> None:
        """Spare slots of instances hosting older live versions take new groups for them,
        freshest first, while the bound still lets those be trained (DESIGN step 5). The
        newest version's work is `top_up`'s: RBS outstanding, never more."""
        g = r.config.group_size
        for version in reversed([v for v in r.window.live() if v != r.window.newest]):
            hosts = [x for x in r.healthy() if x.version == version]
            spare = sum(len(x.free()) for x in hosts) - len(r.pending.get(version, ()))
            while spare >= g and prompts_left(r) > 0 and r.window.admits(version, r.selected):
                r.dispatch_group(version)
                r.telemetry.counters["spare_fills"] += 1
                spare -= g


PARADIGMS: dict[str, type[Paradigm]] = {
    "sync": Sync,
    "one_step_off": OneStepOff,
    "partial": Partial,
    "dora": Dora,
}
