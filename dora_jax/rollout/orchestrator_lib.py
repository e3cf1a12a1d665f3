"""The DORA orchestrator's plan: how many instances each version gets, which weights move where,
and which requests migrate.

Pure functions of a snapshot of the instances, so the plan is deterministic and testable on its
own. On each trigger (new version, KV pressure, timer, an idle instance with work waiting):
  1. `allocate`: DP_w = round(DP_total * R_w / sum R) for versions with outstanding requests,
     at least one instance each (the oldest first if there are more versions than instances);
  2. `plan`: instances of versions over their share are released, their in-flight requests
     migrating onto the version's other instances (consolidating its long tail, no
     re-prefill); freed instances load the versions under their share, copying the weights
     from an instance that already holds the version, or from the trainer's published copy.
"""

from __future__ import annotations

import dataclasses


def allocate(num_instances: int, outstanding: dict[int, int]) -> dict[int, int]:
    """Instances per version, proportional to outstanding requests, summing to num_instances."""
    versions = sorted(v for v, r in outstanding.items() if r > 0)[:num_instances]
    if not versions or num_instances < 1:
        return {}
    total = sum(outstanding[v] for v in versions)
    share = {v: num_instances * outstanding[v] / total for v in versions}
    dp = {v: max(1, round(share[v])) for v in versions}
    # Fix rounding so the counts sum to DP_total: take from the most over-served version that
    # keeps its one instance, give to the most under-served; ties go to the newer version.
    while sum(dp.values()) > num_instances:
        v = max((v for v in versions if dp[v] > 1), key=lambda v: (dp[v] - share[v], v))
        dp[v] -= 1
    while sum(dp.values()) < num_instances:
        v = max(versions, key=lambda v: (share[v] - dp[v], v))
        dp[v] += 1
    return dp


@dataclasses.dataclass(frozen=True)
class InstanceView:
    index: int
    version: int | None
    active: tuple[int, ...]  # busy slots
    free: tuple[int, ...]  # free slots


@dataclasses.dataclass(frozen=True)
class Migration:
    src: int
    src_slot: int
    dst: int
    dst_slot: int


@dataclasses.dataclass(frozen=True)
class WeightMove:
    instance: int
    version: int
    source: int | None  # an instance already holding the version, or None: the trainer's copy


@dataclasses.dataclass(frozen=True)
class Plan:
    migrations: tuple[Migration, ...]
    weight_moves: tuple[WeightMove, ...]


def plan(views: list[InstanceView], targets: dict[int, int], staged: set[int]) -> Plan:
    """Migrations and weight moves that bring each version towards `targets` instances.

    A version no instance holds can only be loaded from the trainer's copy (`staged`); the
    caller rebinds the work of any other orphaned version first. An instance is released only
    if every request in it fits in the free slots of its version's remaining instances.
    """
    hosts: dict[int, list[InstanceView]] = {}
    for view in views:
        if view.version is not None:
            hosts.setdefault(view.version, []).append(view)
    deficit = {
        v: n - len(hosts.get(v, []))
        for v, n in sorted(targets.items())
        if n > len(hosts.get(v, [])) and (v in hosts or v in staged)
    }
    pool = [v.index for v in views if v.version is None]
    wanted = sum(deficit.values()) - len(pool)
    migrations: list[Migration] = []
    # Release surplus instances, oldest version first: that is where the long tail sits.
    for version in sorted(hosts):
        surplus = len(hosts[version]) - targets.get(version, 0)
        candidates = sorted(hosts[version], key=lambda v: (len(v.active), v.index))
        free = {v.index: list(v.free) for v in hosts[version]}
        released: set[int] = set()
        received: set[int] = set()  # keepers that take migrations stay
        for cand in candidates:
            if wanted <= 0 or surplus <= 0:
                break
            if cand.index in received:
                continue
            keepers = [v for v in hosts[version] if v.index not in released | {cand.index}]
            if len(cand.active) > sum(len(free[k.index]) for k in keepers):
                continue
            for slot in cand.active:  # fill the busiest keeper first: consolidate
                dst = min(
                    (k for k in keepers if free[k.index]),
                    key=lambda k: (len(free[k.index]), k.index),
                )
                migrations.append(Migration(cand.index, slot, dst.index, free[dst.index].pop(0)))
                received.add(dst.index)
            free[cand.index] = []
            released.add(cand.index)
            pool.append(cand.index)
            surplus -= 1
            wanted -= 1
        hosts[version] = [v for v in hosts[version] if v.index not in released]
    moves = []
    for version, need in deficit.items():
        for _ in range(need):
            if not pool:
                break
            holders = hosts.get(version, [])
            source = holders[0].index if holders else None
            moves.append(WeightMove(pool.pop(0), version, source))
    return Plan(tuple(migrations), tuple(moves))
