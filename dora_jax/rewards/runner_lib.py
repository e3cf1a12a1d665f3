"""Scoring samples without letting one bad reward function stop the run.

A reward is user code (or math-verify on adversarial model output): it can raise, return
garbage, or hang. `RewardRunner` runs up to `workers` calls at once, each under a
wall-clock timeout. A call that raises, returns something that is not a finite number, runs past
the timeout or kills its worker scores 0, is counted, and is logged with the sample id; the run
goes on.

Workers are processes by default (`isolation="process"`), because only a process can be stopped:
a call stuck in C code that holds the GIL (sympy on a huge power, `re` on a catastrophic
pattern) would freeze a thread-based runner and the controller with it. A timed-out worker is
killed and replaced, so it neither freezes the run nor piles up. The function must pickle (a
module-level function, as `get_reward` returns). `isolation="thread"` runs calls in daemon
threads instead, for functions that do not pickle; there a timed-out call is abandoned (Python
cannot kill a thread) and its late result ignored.
"""

from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import ctypes
import dataclasses
import logging
import math
import multiprocessing.connection
import numbers
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from dora_jax.config_fields_lib import check_timeout, is_count
from dora_jax.rewards.registry_lib import RewardFn

_log = logging.getLogger(__name__)

ISOLATIONS = ("process", "thread")
# A worker process imports the reward's module (math-verify and sympy for `math`) before its
# first call; that start-up is not the call's, so it has a budget of its own.
_START_TIMEOUT_S = 300.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclasses.dataclass
class RewardCounters:
    calls: int = 0
    errors: int = 0  # raised, returned a value that is not a finite number, or killed its worker
    timeouts: int = 0


_COUNTER_FIELDS = dataclasses.fields(RewardCounters)


@dataclasses.dataclass(frozen=True)
class _Outcome:
    raised: bool
    reward: float  # NaN unless the call returned a finite number
    shown: str  # the exception or the returned value, for the log
    # How long the call ran, timed where it ran: a result read back after the runner's wait
    # overran (a busy host) is still judged by its own duration, not by when it was read.
    seconds: float = 0.0


def _call(fn: RewardFn, completion: str, answer: str) -> _Outcome:
    start = time.monotonic()
    try:
        value = fn(completion, answer)
    # Any failure of user code scores 0 and never stops the run; `sys.exit` in it too, which
    # would otherwise end a thread worker silently, to be counted as a timeout.
    except (Exception, SystemExit) as e:
        return _Outcome(True, math.nan, _shown(e), time.monotonic() - start)
    seconds = time.monotonic() - start
    return _Outcome(False, _as_reward(value), _shown(value), seconds)


def _shown(value: object) -> str:
    """`value` for the log. Its `repr` is user code too, and can fail (a raising `__repr__`, an
    int of over 4,300 digits): that must not turn a scored call into a lost one."""
    try:
        return repr(value)[:200]
    except Exception:  # noqa: BLE001
        return f"<a {type(value).__name__} that cannot be shown>"


class RewardRunner:
    """Scores `(sample_id, completion, answer)` items with `fn`, `workers` calls at a time."""

    def __init__(
        self,
        fn: RewardFn,
        timeout_s: float = 10.0,
        workers: int = 4,
        isolation: str = "process",
    ):
        check_timeout(timeout_s)
        if not is_count(workers, 1):
            raise ValueError(f"workers={workers!r}: must be an integer >= 1")
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation={isolation!r}: must be one of {ISOLATIONS}")
        self._pickled = b""  # what each worker process loads
        if isolation == "process":
            try:
                self._pickled = pickle.dumps(fn)
            except Exception as e:
                raise ValueError(
                    f"isolation='process' sends the reward to worker processes, and it does not "
                    f"pickle ({e}); define it at module level, or use isolation='thread'"
                ) from e
        self._fn, self._timeout_s, self._num_workers = fn, timeout_s, workers
        self._isolation = isolation
        self._workers: list[_Worker] = []  # started on the first score
        self._starter = _Starter()
        # A runner dropped without `close` (a run that raised) still stops its workers.
        weakref.finalize(self, _stop_all, self._workers, self._starter)
        self.counters = RewardCounters()

    def metrics(self) -> dict[str, int]:
        """Cumulative counters under TensorBoard-style names."""
        return {f"reward/{f.name}": getattr(self.counters, f.name) for f in _COUNTER_FIELDS}

    def restore_metrics(self, saved: Mapping[str, float]) -> None:
        """Continues the counters from what `metrics()` returned (a checkpoint's copy)."""
        for f in _COUNTER_FIELDS:
            setattr(self.counters, f.name, int(saved.get(f"reward/{f.name}", 0)))

    def score(
        self, items: Sequence[tuple[Hashable, str, str]], counted: bool = True
    ) -> list[float]:
        """Rewards of `items`, in order. `counted=False` leaves the counters alone (held-out
        scoring: `reward/*` count the run's own samples); failures are logged either way."""
        outcomes = (
            self._in_processes(items) if self._isolation == "process" else self._in_threads(items)
        )
        counters = self.counters if counted else RewardCounters()
        return [
            self._settle(sample_id, o, counters)
            for (sample_id, _, _), o in zip(items, outcomes, strict=True)
        ]

    def close(self) -> None:
        """Stops the worker processes; a later score starts new ones."""
        _stop_all(self._workers)

    # -- processes --------------------------------------------------------------------------

    def _in_processes(self, items: Sequence[tuple[Hashable, str, str]]) -> list[_Outcome | None]:
        """Each item goes to the next idle worker; a worker past its item's deadline is killed
        and replaced, one that dies is replaced. None marks a timeout."""
        if not self._workers:
            self._workers.extend(self._start_worker() for _ in range(self._num_workers))
        outcomes: list[_Outcome | None] = [None] * len(items)
        waiting = collections.deque(range(len(items)))
        busy: dict[int, tuple[int, float]] = {}  # worker index -> (its item, the item's deadline)
        while waiting or busy:
            for w, worker in enumerate(self._workers):
                if waiting and worker.ready and w not in busy:
                    i = waiting.popleft()
                    if worker.send(items[i][1:]):
                        busy[w] = (i, time.monotonic() + self._timeout_s)
                    else:  # it died idle, since its last item: its replacement takes this one
                        waiting.appendleft(i)
                        self._replace(w)
            starts = [worker.deadline for worker in self._workers if not worker.ready]
            until = min([due for _, due in busy.values()] + starts)
            connections = [worker.connection for worker in self._workers]
            multiprocessing.connection.wait(connections, max(0.0, until - time.monotonic()))
            now = time.monotonic()
            for w, worker in enumerate(self._workers):
                message = worker.poll()
                item, due = busy.pop(w, (None, math.inf))
                if isinstance(message, _Outcome):
                    outcomes[item] = message
                    continue
                died, late = message is _Worker.DIED, now >= due
                if not worker.ready and (died or now >= worker.deadline):
                    raise RuntimeError(f"a reward worker did not start: {worker.failure()}")
                if not (died or late):
                    if item is not None:
                        busy[w] = (item, due)
                    continue
                if item is not None:
                    outcomes[item] = _Outcome(True, math.nan, "its worker died") if died else None
                self._replace(w)
        return outcomes

    def _start_worker(self) -> _Worker:
        return self._starter.run(_Worker, self._pickled)

    def _replace(self, w: int) -> None:
        self._workers[w].stop()
        self._workers[w] = self._start_worker()

    # -- threads ----------------------------------------------------------------------------

    def _in_threads(self, items: Sequence[tuple[Hashable, str, str]]) -> list[_Outcome | None]:
        outcomes: list[_Outcome | None] = []
        for start in range(0, len(items), self._num_workers):
            outcomes.extend(self._thread_chunk(items[start : start + self._num_workers]))
        return outcomes

    def _thread_chunk(self, items: Sequence[tuple[Hashable, str, str]]) -> list[_Outcome | None]:
        outcomes: list[_Outcome | None] = [None] * len(items)

        def run(i: int, completion: str, answer: str) -> None:
            outcomes[i] = _call(self._fn, completion, answer)

        threads = []
        for i, (_, completion, answer) in enumerate(items):
            thread = threading.Thread(target=run, args=(i, completion, answer), daemon=True)
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + self._timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [None if t.is_alive() else o for t, o in zip(threads, outcomes, strict=True)]

    def _settle(
        self, sample_id: Hashable, outcome: _Outcome | None, counters: RewardCounters
    ) -> float:
        counters.calls += 1
        if outcome is not None and outcome.seconds > self._timeout_s:
            outcome = None  # it ran past the timeout; only the runner's wait was late to see it
        if outcome is None:
            counters.timeouts += 1
            _log.warning("reward for sample %s timed out after %.3gs", sample_id, self._timeout_s)
            return 0.0
        if outcome.raised:
            counters.errors += 1
            _log.warning("reward for sample %s failed (%s); scoring 0", sample_id, outcome.shown)
            return 0.0
        if math.isfinite(outcome.reward):
            return outcome.reward
        counters.errors += 1
        _log.warning(
            "reward for sample %s returned %s, not a finite number", sample_id, outcome.shown
        )
        return 0.0


class _Worker:
    """One worker process: it loads the reward, says it is ready, then answers each
    (completion, answer) it is sent with an `_Outcome`.

    A fresh interpreter running this module, not a `multiprocessing` child: those re-import the
    parent's `__main__`, which in a user's script without a `__main__` guard starts the whole
    run again (and a forked JAX runtime is not safe). It finds modules where this process does,
    in the same order (`-P`: the working directory is not put first, unless it is here).
    """

    DIED = object()  # what `poll` returns once the process is gone

    def __init__(self, pickled_fn: bytes):
        ours, theirs = socket.socketpair()
        command = (
            f"from {__name__} import serve_worker; serve_worker({theirs.fileno()}, {os.getpid()})"
        )
        path = [p or os.getcwd() for p in sys.path]  # "" is the working directory
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-c", command],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.connection = multiprocessing.connection.Connection(ours.detach())
        self.connection.send_bytes(pickled_fn)
        self.ready = False
        self.deadline = time.monotonic() + _START_TIMEOUT_S  # until ready; then the items'
        self._error = ""

    def send(self, message: Any) -> bool:
        """Whether `message` went out: False once the process is gone (killed while idle)."""
        try:
            self.connection.send(message)
        except OSError:
            return False
        return True

    def poll(self) -> Any:
        """The next message if one is there (marking the worker ready on its first), else None."""
        try:
            if not self.connection.poll():
                return None
            message = self.connection.recv()
        except (EOFError, OSError):
            return self.DIED
        if message == "ready":
            self.ready, self.deadline = True, math.inf
            return None
        if isinstance(message, str):  # the reward could not be loaded
            self._error = message
            return self.DIED
        return message

    def failure(self) -> str:
        if self._error:
            return self._error
        code = self.process.poll()
        if code is None:
            return f"no ready message in {_START_TIMEOUT_S:g} s"
        return f"the worker process exited with code {code}"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.connection.close()


def _stop_all(workers: list[_Worker], starter: _Starter | None = None) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()
    if starter is not None:
        starter.stop()


class _Starter:
    """The thread that starts a runner's worker processes. A worker dies with the thread that
    started it (`_die_with`), so one thread that lives as long as the runner starts them all,
    whichever thread scores. A daemon thread of its own: a ThreadPoolExecutor's is stopped
    when the main thread ends, which took the workers of a runner that another thread was
    still using down with it."""

    def __init__(self):
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started with the first worker

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the starter thread."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=_serve_jobs, args=(self._jobs,), daemon=True, name="reward-worker-starter"
            )
            self._thread.start()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((done, fn, args))
        return done.result()

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None


def _serve_jobs(jobs: queue.SimpleQueue[Any]) -> None:
    while (job := jobs.get()) is not None:
        done, fn, args = job
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.set_exception(e)


def serve_worker(fd: int, runner_pid: int) -> None:
    """A worker process's main loop, on the socket `fd` its runner handed it."""
    _die_with(runner_pid)
    # Ctrl-C reaches the whole process group: the runner stops its workers, and a worker's own
    # KeyboardInterrupt only printed a traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    connection = multiprocessing.connection.Connection(fd)
    try:
        fn = pickle.loads(connection.recv_bytes())
    except Exception as e:  # e.g. the module defining it does not import here
        connection.send(f"loading the reward failed: {e!r}")
        return
    connection.send("ready")
    while True:
        try:
            completion, answer = connection.recv()
        except EOFError:
            return
        connection.send(_call(fn, completion, answer))


def _die_with(runner_pid: int) -> None:
    """Has the kernel kill this worker when the runner's thread that started it ends, however
    it ends: a call stuck in C code would never see its connection close, and it outlived a
    SIGKILLed controller (burning a core until the call returned). Linux only (prctl);
    elsewhere a worker outlives a killed runner until its call ends."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != runner_pid:  # the runner was gone before the prctl took effect
        os._exit(1)


def _as_reward(value: object) -> float:
    """`value` as a float, NaN when it is not a real number a float can hold.

    NumPy / JAX scalars and size-1 arrays are taken through `.item()` (a reward written with
    NumPy returns `np.bool_` or a 0-d array), and a mapping through its "score", as verl's
    `compute_score` may return one with extra info. The conversion is user code too: a huge int
    or Fraction overflows a float, and that must score 0 like any other failure, not stop the
    run.
    """
    try:
        if isinstance(value, collections.abc.Mapping):
            value = value.get("score")
        if hasattr(value, "item"):
            value = value.item()
        return float(value) if isinstance(value, numbers.Real) else math.nan
    except Exception:
        return math.nan
