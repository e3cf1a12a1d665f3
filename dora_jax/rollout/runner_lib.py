"""The rollout loop shared by every paradigm: logical decode steps, the trainer, the ledger.

Time is logical, counted in decode steps (`runtime.clock_lib`). Each loop turn runs
`decode_steps_per_turn` decode steps on every busy instance (one engine call each). The
trainer's steps run on a worker thread, which also makes each new version's copy for the
instances; the version is taken up at the first turn `publish_delay_steps` decode steps after
its batch was handed over, or after the previous version was taken up if that was later (or at
once if rollout has nothing left to do). So every decision depends on step counts, completions
and versions only, and the same config and seed give the same ledger. A version is taken up
before its params are back from the trainer: the controller makes the turn's decisions,
enqueues the decode steps of every instance that keeps its version, and only then waits for
them, so instances of older versions (DORA's tails) decode while the trainer finishes. The
trainer holds up to `TRAINER_QUEUE` batches, so it starts its next step as soon as one ends
rather than when the controller next takes a version up. The wall-clock overlap comes from
JAX's asynchronous dispatch: every instance's decode steps are enqueued before any token is
read back, and the trainer computes on its own mesh meanwhile.

The paradigm (`paradigms_lib`) decides what to dispatch and which instance hosts which version;
this module does the mechanics: dispatch, admission into slots, decode, finish, migrate, load
weights, train, publish, survive a failed instance, and record everything.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from dora_jax.observe.trace_lib import TRACE_FILE, TraceWriter
from dora_jax.rollout import ledger_lib, paradigms_lib
from dora_jax.rollout.config_lib import RolloutConfig
from dora_jax.rollout.instance_lib import RolloutInstance
from dora_jax.rollout.queue_lib import TrajectoryQueue
from dora_jax.rollout.request_lib import PromptSource, Request, TurnRewardFn
from dora_jax.rollout.telemetry_lib import TRAINER_TRACK, Telemetry
from dora_jax.rollout.trajectory_lib import Trajectory
from dora_jax.rollout.window_lib import VersionWindow
from dora_jax.runtime import transfer_lib
from dora_jax.runtime.clock_lib import LogicalClock
from dora_jax.runtime.hosts_lib import RemoteTarget

if TYPE_CHECKING:  # the rollout runs any trainer with this interface, in-process or not
    from dora_jax.train.trainer_lib import TrainerLike

# Batches handed to the trainer and not yet taken up as versions, at most: the one it trains
# and the next, so that it never idles between steps while a complete batch waits. Safe for
# every rule: a batch is selected for the iteration it will train (C3 is checked against that
# iteration), and the window admits new work against the batches selected, not the versions
# published.
TRAINER_QUEUE = 2

# `Rollout.staged`'s entry for the version taken up this turn until its params come back.
_ARRIVING = object()


class _TrainingJob(NamedTuple):
    future: concurrent.futures.Future
    batch: list[Trajectory]
    iteration: int
    handed_tick: int  # when the batch was handed to the trainer


class Rollout:
    """One run of a paradigm: `Rollout(...).run()` trains `num_iterations` batches."""

    def __init__(
        self,
        config: RolloutConfig,
        engines: Sequence[Any],
        trainer: TrainerLike,
        prompts: PromptSource,
        reward_fn: TurnRewardFn,
        workdir: str,
        on_iteration: Callable[[dict[str, float]], None] | None = None,
        checkpoint_every: int = 0,
        on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
        resume: dict[str, Any] | None = None,
    ):
        self.config = config
        self.paradigm = paradigms_lib.PARADIGMS[config.mode]()
        k, self.rollout_batch_size = self.paradigm.bounds(config)
        self.trainer = trainer
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.workdir = workdir
        # Called with each iteration's metrics right after its version is published: the app
        # hangs metrics, progress and checkpoints here.
        self.on_iteration = on_iteration
        # Every `checkpoint_every` versions, and at the last one, the run reaches a barrier (see
        # `_checkpoint`) and hands `on_checkpoint` its state; `resume` is such a state to
        # continue from (the last one's: a run asked for more iterations than it has done).
        self.checkpoint_every = checkpoint_every
        self.on_checkpoint = on_checkpoint
        self._draining = False
        self.instances = [RolloutInstance(i, e) for i, e in enumerate(engines)]
        self.queue = TrajectoryQueue(config.group_size, k, config.groups_per_batch)
        self.window = VersionWindow(self.queue)
        self.ledger = ledger_lib.Ledger(workdir, resume_offset=resume and resume["ledger_offset"])
        if resume is None:
            self.ledger.start(
                mode=config.mode,
                staleness_bound=k,
                train_batch_size=config.train_batch_size,
                group_size=config.group_size,
            )
        name = f"dora_jax rollout ({config.mode})"
        if resume is None:
            self.trace = TraceWriter(name)
        else:  # the trace goes on from the run's before the restart
            previous = os.path.join(workdir, TRACE_FILE)
            self.trace = TraceWriter(f"{name}, resumed at v{resume['newest']}", previous)
        self.telemetry = Telemetry([x.num_slots for x in self.instances], self.trace)
        # Trainer copies of published versions that no instance holds yet (version 0: the
        # initial params, copied before the trainer's first step donates them).
        shardings, dtype, _ = _staging(self.instances[0])
        self.staged: dict[int, Any] = {
            0: transfer_lib.put(trainer.params, shardings, copy=True, dtype=dtype).tree
        }
        self.clock = LogicalClock(config.timer_steps, config.publish_delay_steps)
        self.selected = 0  # batches handed to the trainer
        self.next_prompt = 0
        self.pending: dict[int, collections.deque[Request]] = collections.defaultdict(
            collections.deque
        )
        self.unfinished: dict[tuple[int, int], Request] = {}  # dispatched, not finished
        self.dispatched_per_version: collections.Counter[int] = collections.Counter()
        self.totals: collections.Counter[str] = collections.Counter()
        self.metrics: list[dict[str, float]] = []
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self._jobs: collections.deque[_TrainingJob] = collections.deque()  # oldest first
        self._taking_up: _TrainingJob | None = None  # its version taken up, its step unsettled
        self._admitting: set[int] = set()  # instances with admissions enqueued this turn
        self._publish_now = False  # nothing left to decode: take the next version up at once
        self._last_publish_us = self.trace.now_us()
        if resume is not None:
            self._load_state(resume)

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """Runs until `num_iterations` batches are trained; returns per-iteration metrics."""
        stopped = ledger_lib.COMPLETED
        try:
            while self.window.newest < self.config.num_iterations or self._draining:
                self._turn()
        except BaseException as e:  # the ledger says how the run ended, the error goes on
            # An interruption carries no message: say what it was (Ctrl-C, or SIGTERM to train).
            stopped = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} (interrupted)"
            raise
        finally:
            # A step not started yet is dropped (its batch is listed as queued at the end):
            # an interrupt waits for the running step only, not for the one queued behind it.
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._stop(stopped)
        return self.metrics

    def _turn(self) -> None:
        self._plan_and_decode()
        # A version taken up is settled within its turn whichever way the turn went (in
        # `_decode` when the turn decodes), so the ledger's order never depends on timing.
        self._settle()
        self._receive_all()

    def _plan_and_decode(self) -> None:
        progress = self._progress()
        triggers: set[str] = set()
        if self._jobs and (self._publish_now or self.clock.version_due(self._jobs[0].handed_tick)):
            self._take_up()
            every = self.checkpoint_every
            last = self.window.newest >= self.config.num_iterations
            # The last version's barrier checkpoints the final policy, for `eval` and for a run
            # asked to go on: its in-flight samples finish and wait, queued, in the checkpoint.
            self._draining = bool(every) and (self.window.newest % every == 0 or last)
            if last and not self._draining:
                return
            triggers.add("new_version")
        if self._draining and not self.outstanding():
            self._settle()  # the barrier saves the trainer at this version
            self._checkpoint()
            if self.window.newest >= self.config.num_iterations:
                return
        self._try_train()
        if self.selected < self.config.num_iterations and not self._draining:
            self.paradigm.top_up(self)
        if self.clock.timer_fired():
            triggers.add("timer")
        if any(x.kv_tokens() > self.config.kv_pressure * _kv_capacity(x) for x in self.healthy()):
            triggers.add("kv_pressure")
        if any(not x.active() for x in self.healthy()) and self.outstanding():
            triggers.add("idle")
        self._rehome_orphans()
        self.paradigm.rebalance(self, triggers)
        self._retire()  # the versions instances left
        if self.selected < self.config.num_iterations and not self._draining:
            self.paradigm.fill_spare(self)
        self._admit()
        if any(x.active() for x in self.healthy()):
            self.clock.advance(max(self._decode(), 1))
            return
        if self._jobs:
            self._publish_now = True
        elif progress == self._progress():
            raise RuntimeError(
                f"rollout stalled at step {self.clock.tick}: {self.selected} batches selected, "
                f"live versions {self.window.live()}, outstanding {self.outstanding()}"
            )
        self.clock.advance(1)

    def _progress(self) -> tuple[int, int, int]:
        """What a turn that neither decodes nor waits for the trainer must change, or the run
        has stalled. An instance taken out counts: its requeued work goes to another next turn."""
        return (self.totals["prefills"], self.selected, self.totals["failed_instances"])

    def healthy(self) -> list[RolloutInstance]:
        return [x for x in self.instances if x.healthy]

    def outstanding(self) -> dict[int, int]:
        """Unfinished requests per version (pending or in a slot)."""
        counts: collections.Counter[int] = collections.Counter(
            {v: len(q) for v, q in self.pending.items() if q}
        )
        for x in self.healthy():
            for slot in x.active():
                counts[x.slots[slot].version] += 1
        return dict(counts)

    # -- dispatch, admission, decode --------------------------------------------------------

    def dispatch_group(self, version: int) -> None:
        spec = self.prompts(self.next_prompt)
        if len(spec.max_new_tokens) != self.config.group_size:
            raise ValueError(
                f"prompt {self.next_prompt}: {len(spec.max_new_tokens)} sample limits for "
                f"rollout.group_size={self.config.group_size}"
            )
        self.queue.add_group(self.next_prompt, version)
        for i in range(self.config.group_size):
            seed = self.seed_of(spec.prompt_id, i)
            self.pending[version].append(Request(spec, i, seed, version))
        self.dispatched_per_version[version] += 1
        self.next_prompt += 1

    def seed_of(self, prompt_id: int, sample_index: int) -> int:
        """The sampling seed of a sample: a function of the run seed and its identity only."""
        rng = np.random.default_rng([self.config.seed, prompt_id, sample_index])
        return int(rng.integers(2**31))

    def _admit(self) -> None:
        batches = []
        for x in self.healthy():
            queue = self.pending.get(x.version)
            starts = []
            for slot in x.free():
                if not queue:
                    break
                starts.append((queue.popleft(), slot))
            if starts:
                batches.append((x, starts))
        self.start(batches)

    def start(self, batches: list[tuple[RolloutInstance, list[tuple[Request, int]]]]) -> None:
        """Enqueues each instance's admissions of (request, slot) pairs; the turn's `_decode`
        reads their first tokens back with its step."""
        for x, starts in batches:
            for request, _ in starts:
                if not request.started:
                    self.ledger.dispatch(*request.key, request.version, self.selected)
                    self.unfinished[request.key] = request
            try:
                x.dispatch_prefill(starts)
            except Exception:  # noqa: BLE001 - any engine error takes the instance out
                self._fail(x, [r for r, _ in starts])
                continue
            self._admitting.add(x.index)
            self.telemetry.counters["prefills"] += len(starts)
            self.totals["prefills"] += len(starts)

    def _decode(self) -> int:
        """A turn's decode steps on every instance with a busy slot: every admission and
        decode call is enqueued before anything is read back, and those of instances that
        keep their version before the controller waits for a version taken up this turn.
        Returns the steps it ran."""
        t0 = self.trace.now_us()
        busy: list[list[int]] = [[] for _ in self.instances]  # per instance, per step run
        failed = []
        finished: list[Request] = []

        def dispatch(instances: list[RolloutInstance]) -> None:
            for x in instances:
                try:
                    x.dispatch_generate(self.config.decode_steps_per_turn)
                except Exception:  # noqa: BLE001 - any engine error takes the instance out
                    failed.append(x)

        dispatch([x for x in self.healthy() if x.active() and not x.expecting])
        waited = self._settle()
        received = self._receive_all()
        received_us = self.trace.now_us()  # their turn on the timeline starts after the load
        dispatch([x for x in received if x.active()])
        stepping = [x for x in self.healthy() if x.active()]
        for x in stepping:
            if x in failed:
                continue
            try:
                done, busy[x.index] = x.collect()
            except Exception:  # noqa: BLE001
                failed.append(x)
                continue
            finished.extend(done)
        scoring_us = self.trace.now_us()
        self._finish(finished)
        now = self.trace.now_us()
        if finished:
            self.telemetry.scored(len(finished), scoring_us, now)
        for x in self.healthy():
            label = "decode" if busy[x.index] else "idle"
            if x.index in self._admitting:
                label = "prefill+decode"
            start = received_us if x in received else t0
            self.telemetry.state(x.name, f"{label} v{x.version}", start, version=x.version)
        self._admitting.clear()
        lags = [self.window.newest - x.version if busy[x.index] else 0 for x in self.instances]
        # The wait for the trainer is left out of every instance's decoding time, as if none
        # decoded meanwhile: when they finished is not known, so the bubble is not understated.
        # So is scoring the turn's finished samples, when nothing is enqueued.
        self.telemetry.decode_turn(busy, (scoring_us - t0) / 1e6 - waited, lags)
        for x in failed:
            self._fail(x)
        return max(map(len, busy))

    def _finish(self, requests: Sequence[Request]) -> None:
        """Scores a turn's finished requests in one reward call and queues their trajectories,
        in the order the instances handed them back."""
        if not requests:
            return
        rewards = self.reward_fn([(r.key, np.asarray(r.tokens, np.int32)) for r in requests])
        if len(rewards) != len(requests):
            raise ValueError(f"the reward function gave {len(rewards)} rewards for {len(requests)}")
        for request, reward in zip(requests, rewards, strict=True):
            self.queue.finish(request.to_trajectory(float(reward)))
            del self.unfinished[request.key]
            self.totals["finished"] += 1

    def _fail(self, x: RolloutInstance, prefilling: Sequence[Request] = ()) -> None:
        """Requeues a failed instance's requests (those in its slots and those it was
        prefilling) from scratch under the newest version."""
        self.telemetry.close(x.name, self.trace.now_us())
        # A prefill that failed half-way may have put some of its requests in slots already.
        self.requeue({r.key: r for r in [*x.fail(), *prefilling]}.values())
        self.totals["failed_instances"] += 1
        if not self.healthy():
            raise RuntimeError("every rollout instance has failed")

    def requeue(self, requests: Iterable[Request]) -> None:
        """Restarts requests from scratch under the newest version, first in line (the
        instance that held them failed; what they generated there is not trusted)."""
        for request in requests:
            request.restart(self.window.newest)
            self.queue.rebind(request.key, self.window.newest)
            self.pending[self.window.newest].appendleft(request)
            self.totals["requeued"] += 1
            self.telemetry.counters["requeued"] += 1

    def interrupt(self, x: RolloutInstance) -> list[Request]:
        """Takes every request out of `x`'s slots, with what it generated so far (`partial`'s
        weight update). An engine error takes `x` out instead (its requests requeued): []."""
        try:
            return x.evict_all()
        except Exception:  # noqa: BLE001 - any engine error takes the instance out
            self._fail(x)
            return []

    def _rehome_orphans(self) -> None:
        """Pending work of a version no instance holds any more goes to the newest version."""
        hosted = {x.version for x in self.healthy()} | set(self.staged)
        self.rebind_pending(v for v in list(self.pending) if v not in hosted)

    def rebind_pending(self, versions: Iterable[int]) -> int:
        """Binds the not-yet-started requests of `versions` to the newest version; returns how
        many moved. Safe for every rule: nothing of them was sampled yet (C1), and a group's
        deadline (its oldest sample version + K) can only move later, so every deadline's
        count of groups due, which the window's admission bounded, can only fall (C3)."""
        newest = self.window.newest
        moved = 0
        for version in [v for v in versions if v != newest and self.pending.get(v)]:
            for request in self.pending.pop(version):
                request.version = newest
                self.queue.rebind(request.key, newest)
                self.pending[newest].append(request)
                moved += 1
        return moved

    # -- weights and migrations -------------------------------------------------------------

    def load(self, x: RolloutInstance, version: int, source: RolloutInstance | None) -> None:
        """Weight move: from `source` (an instance holding `version`) or the trainer's copy.
        An engine error takes out the instance at fault: `x`, or a source whose generation host
        cannot be read, after which another holder or the trainer's copy serves (taking `x`
        out for its source's fault would cascade through every instance that copies from it).
        The version taken up this turn comes from the trainer's copy once it is back
        (`RolloutInstance.expect`, `_receive_all`)."""
        if x.healthy and self.staged.get(version) is _ARRIVING:
            try:
                x.expect(version)
            except Exception:  # noqa: BLE001 - as `x.load` would have: the instance goes out
                self._fail(x)
            return
        while x.healthy:
            if source is not None and not source.healthy:  # taken out since the plan was made
                source = next((y for y in self.healthy() if y.version == version), None)
                if source is None and version not in self.staged:
                    return  # its requests went to the newest version with the instance
            if source is None and version not in self.staged:
                raise RuntimeError(f"v{version} is not held anywhere; cannot load it on {x.name}")
            params = source.params.state if source is not None else self.staged[version]
            t0 = self.trace.now_us()
            try:
                seconds, nbytes = x.load(version, params)
            except transfer_lib.SourceError:
                assert source is not None  # the trainer's copy is never on a host (`_staging`)
                x.unload()  # holds nothing now, and is ready for the next try or the next plan
                self._fail(source)
                continue
            except Exception:  # noqa: BLE001 - any engine error takes the instance out
                self._fail(x)
                return
            self._count_load(x, t0, seconds, nbytes, source)
            return

    def _receive_all(self) -> list[RolloutInstance]:
        """Hands every instance expecting the version taken up its params (settled by now) and
        so enqueues its admissions; returns those instances. An engine error takes the
        instance out, its requests requeued."""
        received = []
        for x in self.healthy():
            if not x.expecting:
                continue
            t0 = self.trace.now_us()
            try:
                seconds, nbytes = x.receive(self.staged[x.version])
            except Exception:  # noqa: BLE001 - any engine error takes the instance out
                self._fail(x)
                continue
            self._count_load(x, t0, seconds, nbytes, None)
            received.append(x)
        return received

    def _count_load(
        self,
        x: RolloutInstance,
        t0: float,
        seconds: float,
        nbytes: int,
        source: RolloutInstance | None,
    ) -> None:
        origin = "trainer" if source is None else source.name
        self.telemetry.action(x.name, f"load v{x.version}", t0, self.trace.now_us(), source=origin)
        self.telemetry.counters["weight_moves"] += 1
        self.telemetry.counters["weight_move_s"] += seconds
        self.telemetry.counters["weight_move_bytes"] += nbytes

    def migrate(self, src: RolloutInstance, slot: int, dst: RolloutInstance, dst_slot: int) -> None:
        """Moves a request with its KV cache to another instance of the same version. An engine
        error takes out the instance that raised; the request is requeued either way (until
        `src` lets it go it is in `src`'s slot, after that `dst` owns it)."""
        if not (src.healthy and dst.healthy):
            return  # an earlier step of the same plan took one of them out
        t0 = self.trace.now_us()
        try:
            request, exported = src.export(slot)
        except Exception:  # noqa: BLE001 - any engine error takes the instance out
            self._fail(src)
            return
        nbytes = transfer_lib.tree_nbytes(exported)
        try:
            dst.import_(dst_slot, request, exported)
        except transfer_lib.SourceError:  # `src`'s host failed to hand the slot over
            self._fail(src, [request])
            return
        except Exception:  # noqa: BLE001
            self._fail(dst, [request])
            return
        t1 = self.trace.now_us()
        for x in (src, dst):
            self.telemetry.action(x.name, "migrate", t0, t1, src=src.index, dst=dst.index)
        self.telemetry.counters["migrations"] += 1
        self.telemetry.counters["kv_bytes_moved"] += nbytes
        self.totals["migrations"] += 1

    # -- trainer ------------------------------------------------------------------------------

    def _try_train(self) -> None:
        """Hands the trainer the next iteration's batch once one is complete, while its queue
        has room. The iteration that ends at a checkpoint's version waits for the barrier."""
        if len(self._jobs) >= TRAINER_QUEUE:
            return
        if self.selected >= self.config.num_iterations or self._draining:
            return
        every = self.checkpoint_every
        if self._jobs and every and self.selected % every == 0:
            return  # the barrier at version `selected` needs the trainer there, idle
        batch = self.queue.select_batch(self.selected)
        if batch is None:
            return
        # The new version waits where loading it costs least: the least busy instance now.
        target = min(self.healthy(), key=lambda x: (len(x.active()), x.index))
        future = self._executor.submit(self._train_step, batch, self.selected, _staging(target))
        self._jobs.append(_TrainingJob(future, batch, self.selected, self.clock.tick))
        self.selected += 1
        self._retire()

    def _train_step(
        self, batch: list[Trajectory], iteration: int, staging: tuple[Any, Any, Any]
    ) -> tuple[dict[str, float], float, float, Any]:
        """The trainer's step, then its new version's copy for the instances, back to back on
        the worker while the controller decodes; `_take_up` takes the version up later."""
        if self.trainer.version != iteration:
            raise RuntimeError(f"trainer at version {self.trainer.version}, expected {iteration}")
        t0 = self.trace.now_us()
        metrics = self.trainer.step(batch)
        t1 = self.trace.now_us()
        return metrics, t0, t1, self.trainer.publish(*staging)

    def _take_up(self) -> None:
        """The next version becomes the newest: every decision from here on sees it, and its
        params follow when `_settle` has them."""
        job = self._jobs.popleft()
        self._taking_up = job
        self.staged[job.iteration + 1] = _ARRIVING
        self.window.newest = job.iteration + 1
        self.clock.took_up_version()
        self._publish_now = False
        self._retire()

    def _settle(self) -> float:
        """Waits for the step of the version taken up this turn, if any, and records it: the
        ledger's trained samples, the trainer's span, the iteration's metrics. Returns the
        seconds waited (no instance's decoding is timed through it)."""
        job = self._taking_up
        if job is None:
            return 0.0
        wait0 = time.perf_counter()
        train_metrics, t0, t1, published = job.future.result()
        waited = time.perf_counter() - wait0
        if published.version != self.window.newest:
            raise RuntimeError(
                f"trainer published v{published.version}, took up v{self.window.newest}"
            )
        self._taking_up = None
        # Trained once the step is done: a step that raises leaves its batch in the end
        # event's queued list, not claimed by the ledger.
        for traj in job.batch:
            self.ledger.train(traj, iteration=job.iteration, trainer_version=job.iteration)
            self.totals["trained"] += 1
        self.trace.span(
            TRAINER_TRACK,
            f"train iteration {job.iteration}",
            t0,
            t1,
            version=job.iteration,
        )
        self.staged[published.version] = published.params
        now = self.trace.now_us()
        interval = (now - self._last_publish_us) / 1e6
        m = self.telemetry.iteration_metrics(interval)
        tokens = sum(len(t.prompt_tokens) + len(t.response_tokens) for t in job.batch)
        m.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
        m.update(
            iteration=float(published.version - 1),
            versions_live=float(len(self.window.live())),
            step_time_s=(t1 - t0) / 1e6,
            trainer_idle_s=max(interval - (t1 - t0) / 1e6, 0.0),
            iteration_time_s=interval,
            trained_tokens=float(tokens),
            trained_tokens_per_s=tokens / max(interval, 1e-12),
            publish_s=published.metrics.get("publish_seconds", 0.0),
            publish_bytes=published.metrics.get("publish_bytes", 0.0),
        )
        self.metrics.append(m)
        if self.on_iteration is not None:
            self.on_iteration(m)
        self._last_publish_us = now
        self.telemetry.reset()
        return waited

    def _retire(self) -> None:
        """Frees the params of versions that left the window (all their samples trained), and
        the trainer's copy of an older version no instance will load from it: one an instance
        holds (a load copies from there) or one with no work waiting (nothing is dispatched
        under an older version but to the instances that hold it)."""
        live = set(self.window.live())
        for x in self.healthy():
            if x.version is not None and x.version not in live and not x.active():
                x.unload()
        held = {x.version for x in self.healthy()}
        for version in list(self.staged):
            older = version != self.window.newest
            if version not in live or (
                older and (version in held or not self.pending.get(version))
            ):
                del self.staged[version]

    # -- checkpoints ----------------------------------------------------------------------------

    def _checkpoint(self) -> None:
        """The barrier: nothing is in flight, so the state below is the whole rollout state.

        While draining, no new work starts and the trainer waits; every dispatched sample
        finishes under its own version and waits, complete, in the trajectory queue. Instances
        drop their params, so a resumed run (which holds only the trainer's newest version)
        and an uninterrupted one continue from identical states and write identical ledgers
        (unless an instance failed before the barrier: a resumed run starts with every instance
        healthy). Nothing is ever resumed half-generated, so no trajectory mixes versions across
        a crash.
        """
        for x in self.healthy():
            x.unload()
        self._draining = False
        # The timeline so far, which a SIGKILL would lose (the trace is otherwise written at
        # the stop): a resume from this barrier reads it as the run before the restart.
        self.trace.save(os.path.join(self.workdir, TRACE_FILE))
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.state_dict())

    def state_dict(self) -> dict[str, Any]:
        """JSON-able rollout state at a barrier (nothing in flight, nothing pending)."""
        if self.outstanding() or self._jobs or self.unfinished:
            raise RuntimeError("rollout state is only complete at a checkpoint barrier")
        return {
            **self.clock.state_dict(),
            "selected": self.selected,
            "newest": self.window.newest,
            "next_prompt": self.next_prompt,
            "dispatched_per_version": {str(v): n for v, n in self.dispatched_per_version.items()},
            "totals": dict(self.totals),
            "queue": self.queue.state_dict(),
            "ledger_offset": self.ledger.offset(),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        if self.trainer.version != state["newest"]:
            raise ValueError(
                f"trainer restored at version {self.trainer.version}, "
                f"rollout state is at version {state['newest']}"
            )
        self.clock.load_state_dict(state)
        self.selected = state["selected"]
        self.window.newest = state["newest"]
        self.next_prompt = state["next_prompt"]
        self.dispatched_per_version.update(
            {int(v): n for v, n in state["dispatched_per_version"].items()}
        )
        self.totals.update(state["totals"])
        self.queue.load_state_dict(state["queue"])
        self.staged = {self.window.newest: self.staged.pop(0)}

    # -- end of run ---------------------------------------------------------------------------

    def _stop(self, stopped: str) -> None:
        jobs = [*([self._taking_up] if self._taking_up else []), *self._jobs]
        handed_over = [t for job in jobs for t in job.batch]  # not trained, as published
        self.ledger.end(
            {key: len(r.tokens) for key, r in self.unfinished.items()},
            self.queue.queued() + handed_over,
            stopped=stopped,
            num_iterations=self.config.num_iterations,
        )
        self.ledger.close()
        self.telemetry.close_all(self.trace.now_us())
        self.trace.save(os.path.join(self.workdir, TRACE_FILE))


def _staging(x: RolloutInstance) -> tuple[Any, Any, Any]:
    """Where a new version waits for its instances, in what dtype, and on what LoRA base: on
    `x`'s mesh, so that loading it there is free, unless `x` is a generation host of its own,
    which could die with the only copy; then where the trainer's params are (None), from where
    any host can load it. In the instances' dtype either way (`Engine.param_dtype`). A LoRA
    version staged on `x` is its adapters on `x`'s base (`RolloutInstance.base`)."""
    shardings = x.engine.param_shardings
    if isinstance(shardings, RemoteTarget):
        return None, x.engine.param_dtype, None
    return shardings, x.engine.param_dtype, x.base


def _kv_capacity(x: RolloutInstance) -> int:
    return x.num_slots * x.engine.cache_length
