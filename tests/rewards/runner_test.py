"""RewardRunner: failures and timeouts score 0, are counted and logged; the rest is scored."""

from __future__ import annotations

import fractions
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import reward_helpers
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_jax.rewards import RewardCounters, RewardRunner, get_reward

RELEASE = threading.Event()  # lets the hung calls finish once the test is over


def flaky(completion: str, answer: str) -> float:
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "hang":
        RELEASE.wait(30)
        return 1.0
    if completion == "nan":
        return math.nan
    if completion == "text":
        return "1"  # type: ignore[return-value]
    return float(completion == answer)


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_failures_and_timeouts_score_zero_are_counted_and_logged(caplog, isolation):
    items = [("ok-1", "a", "a"), ("raise-2", "raise", "a"), ("hang-3", "hang", "a"),
             ("ok-4", "b", "a"), ("nan-5", "nan", "a"), ("text-6", "text", "a"),
             ("hang-7", "hang", "a"), ("ok-8", "c", "c")]  # fmt: skip
    RELEASE.clear()
    runner = RewardRunner(flaky, timeout_s=0.3, workers=4, isolation=isolation)
    runner.score([("warm-up", "a", "a")] * 4)  # worker processes start on the first score
    runner.counters = RewardCounters()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        rewards = runner.score(items)
    elapsed = time.monotonic() - start
    RELEASE.set()
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert runner.metrics() == {"reward/calls": 8, "reward/errors": 3, "reward/timeouts": 2}
    # At most two timeouts in a row (threads: two chunks of 4; processes: a killed worker's
    # replacement starts while the others go on), not one timeout per hung sample.
    assert elapsed < 2 * 0.3 + 0.5
    runner.close()
    for sample_id in ["raise-2", "hang-3", "nan-5", "text-6", "hang-7"]:
        assert any(sample_id in m for m in caplog.messages), sample_id
    assert not any("ok-" in m for m in caplog.messages)


_RUNNERS: dict[int, RewardRunner] = {}


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="ab", max_size=3), st.text(alphabet="ab", max_size=3)),
                max_size=12), st.integers(1, 5))  # fmt: skip
def test_scores_keep_input_order_and_equal_direct_calls(pairs, workers):
    if workers not in _RUNNERS:  # worker processes start once, not once per example
        _RUNNERS[workers] = RewardRunner(get_reward("exact_match"), 5.0, workers=workers)
    runner = _RUNNERS[workers]
    runner.counters = RewardCounters()
    items = [(i, c, a) for i, (c, a) in enumerate(pairs)]
    want = [float(bool(a.strip()) and c.strip() == a.strip()) for c, a in pairs]
    assert runner.score(items) == want
    assert runner.counters.calls == len(pairs) and runner.counters.errors == 0


@pytest.mark.parametrize(
    "value,expected",
    [
        (np.bool_(True), 1.0),
        (np.float32(0.5), 0.5),
        (np.array(1.0), 1.0),
        (np.array([0.25]), 0.25),
        (fractions.Fraction(1, 2), 0.5),
        (True, 1.0),
        (np.array([1.0, 2.0]), None),
        (np.array(np.nan), None),
        # float() overflows: this raised out of score() and stopped the run.
        pytest.param(10**400, None, id="huge-int"),
        pytest.param(fractions.Fraction(10**400), None, id="huge-fraction"),
        (None, None),
        ({"score": np.float32(0.75), "acc": True}, 0.75),  # verl's compute_score may return it
        ({"acc": 1.0}, None),
    ],
)
def test_return_values_convert_or_count_as_errors(value, expected):
    """None = an error scoring 0; NumPy scalars and size-1 arrays are numbers, as `.item()` says."""
    # One conversion for both isolations (`runner_lib._call`); a closure pickles only here.
    runner = RewardRunner(lambda completion, answer: value, timeout_s=5.0, isolation="thread")
    assert runner.score([("id", "x", "y")]) == [0.0 if expected is None else expected]
    assert runner.counters.errors == (expected is None)


def test_math_reward_through_the_runner():
    runner = RewardRunner(get_reward("math"), timeout_s=20.0)
    assert runner.score([(0, "\\boxed{6}", "6"), (1, "\\boxed{5}", "6")]) == [1.0, 0.0]


def test_a_huge_power_cannot_freeze_the_run():
    """sympy computes these holding the GIL, where the timeout never fires: the run froze. A
    child process, so that a regression fails this test instead of hanging the suite."""
    completions = [r"\boxed{10^{10^{8}}}", r"\boxed{9^9^9}", "2**2**40", r"\boxed{7^{99999999}}"]
    script = (
        "from dora_jax.rewards import RewardCounters, RewardRunner, get_reward\n"
        "runner = RewardRunner(get_reward('math'), timeout_s=2.0)\n"
        f"print(runner.score([(i, c, '1') for i, c in enumerate({completions!r})]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == str([0.0] * len(completions))


def test_invalid_settings_name_the_field():
    for timeout_s in (0.0, -1.0, math.inf, math.nan, threading.TIMEOUT_MAX * 2):
        with pytest.raises(ValueError, match="timeout_s"):
            RewardRunner(flaky, timeout_s=timeout_s)
    with pytest.raises(ValueError, match="workers=0"):
        RewardRunner(flaky, workers=0)


def test_a_call_holding_the_gil_is_stopped_and_its_worker_replaced():
    """Only a process can be stopped: `re` on a catastrophic pattern never releases the GIL,
    so in a thread it froze the controller (a child interpreter, so that a regression fails
    this test instead of hanging the suite)."""
    script = (
        "from reward_helpers import backtracks\n"
        "from dora_jax.rewards import RewardRunner\n"
        "runner = RewardRunner(backtracks, timeout_s=1.0, workers=2)\n"
        "items = [(0, 'a' * 64 + 'b', ''), (1, 'aaa', ''), (2, 'a' * 64 + 'b', ''), (3, 'a', '')]\n"
        "print(runner.score(items), runner.counters.timeouts)\n"
        "print(runner.score([(4, 'aa', '')]), runner.counters.timeouts)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
        cwd=os.path.dirname(__file__),
    )  # fmt: skip
    assert done.stdout.split("\n")[:2] == ["[0.0, 1.0, 0.0, 1.0] 2", "[1.0] 2"]


def test_a_worker_that_dies_scores_zero_and_is_replaced(caplog):
    runner = RewardRunner(reward_helpers.exits_on_exit, timeout_s=30.0, workers=2)
    items = [(0, "exit", ""), (1, "x", ""), (2, "exit", ""), (3, "y", ""), (4, "z", "")]
    with caplog.at_level(logging.WARNING):
        assert runner.score(items) == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert runner.counters.errors == 2 and runner.counters.timeouts == 0
    assert "reward for sample 0 failed (its worker died); scoring 0" in caplog.messages
    assert runner.score([(5, "w", "")]) == [1.0]
    runner.close()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_sys_exit_in_a_reward_is_an_error_not_a_timeout(isolation):
    runner = RewardRunner(
        reward_helpers.calls_sys_exit, timeout_s=30.0, workers=2, isolation=isolation
    )
    assert runner.score([(0, "exit", ""), (1, "x", "")]) == [0.0, 1.0]
    assert runner.counters.errors == 1 and runner.counters.timeouts == 0
    runner.close()


def test_a_reward_that_does_not_pickle_needs_threads():
    with pytest.raises(ValueError, match="isolation='thread'"):
        RewardRunner(lambda completion, answer: 1.0)
    with pytest.raises(ValueError, match="isolation='fork'"):
        RewardRunner(flaky, isolation="fork")


def test_a_script_without_a_main_guard_scores_once(tmp_path):
    """multiprocessing's spawned children re-import the parent's `__main__`: in a user's
    script without a guard that started the whole run again inside every worker."""
    script = tmp_path / "train.py"
    script.write_text(
        "from dora_jax.rewards import RewardRunner, get_reward\n"
        "runner = RewardRunner(get_reward('exact_match'), timeout_s=30.0, workers=2)\n"
        "print(runner.score([(0, 'a', 'a'), (1, 'b', 'a')]))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert done.stdout.splitlines() == ["[1.0, 0.0]"]


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_workers_die_with_a_killed_controller():
    """A call that never returns never sees its connection close: its worker outlived a
    SIGKILLed controller, burning a core, until the kernel was asked to kill it."""
    script = (
        "import sys, threading, time\n"
        "from reward_helpers import spins\n"
        "from dora_jax.rewards import RewardRunner\n"
        "runner = RewardRunner(spins, timeout_s=600.0, workers=2)\n"
        "items = [(0, 'a', ''), (1, 'b', '')]\n"
        "threading.Thread(target=runner.score, args=(items,), daemon=True).start()\n"
        "while len(runner._workers) < 2 or not all(w.ready for w in runner._workers):\n"
        "    time.sleep(0.05)\n"
        "print(*(w.process.pid for w in runner._workers), flush=True)\n"
        "time.sleep(600)\n"
    )
    controller = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
        cwd=os.path.dirname(__file__),
    )  # fmt: skip
    try:
        pids = [int(p) for p in controller.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        controller.kill()
        controller.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if _alive(p)]
    for pid in survivors:  # a regression must not leave them spinning after the suite
        os.kill(pid, signal.SIGKILL)
    assert not survivors


def test_workers_outlive_the_thread_that_first_scored():
    """Workers die with the thread that started them, so a runner first used from a thread
    that has since ended must not lose them (they score, they are not replaced)."""
    runner = RewardRunner(reward_helpers.length_reward, timeout_s=30.0, workers=2)
    first = threading.Thread(target=runner.score, args=([(0, "ab", "")],))
    first.start()
    first.join()
    pids = [w.process.pid for w in runner._workers]
    time.sleep(0.5)  # a worker killed when `first` ended would be dead by now
    assert runner.score([(1, "abc", ""), (2, "a", "")]) == [3.0, 1.0]
    assert [w.process.pid for w in runner._workers] == pids and all(map(_alive, pids))
    assert runner.counters.errors == 0
    runner.close()


def test_workers_outlive_a_main_thread_that_ends_while_another_thread_scores():
    """A ThreadPoolExecutor started the workers at first: its thread stops when the main
    thread ends, and took the workers of a runner still scoring on another thread with it."""
    script = (
        "import threading, time\n"
        "from dora_jax.rewards import RewardRunner, get_reward\n"
        "def work():\n"
        "    runner = RewardRunner(get_reward('exact_match'), timeout_s=30.0, workers=2)\n"
        "    for turn in range(3):\n"
        "        print(runner.score([(i, '4', '4') for i in range(4)]), flush=True)\n"
        "        time.sleep(1.0)\n"
        "    runner.close()\n"
        "threading.Thread(target=work).start()\n"
        "time.sleep(1.5)\n"  # the main thread ends here, between the turns
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert done.stdout.splitlines() == ["[1.0, 1.0, 1.0, 1.0]"] * 3


def test_a_worker_that_died_idle_is_replaced_and_its_item_scored():
    """A worker killed between scores (the OOM killer, say) used to make the next score raise
    BrokenPipeError, which ended the run; its item goes to a replacement now, no error."""
    runner = RewardRunner(reward_helpers.length_reward, timeout_s=30.0, workers=2)
    assert runner.score([(0, "ab", ""), (1, "abc", "")]) == [2.0, 3.0]
    while not all(w.ready for w in runner._workers):
        runner.score([(2, "a", "")])
    os.kill(runner._workers[0].process.pid, signal.SIGKILL)
    runner._workers[0].process.wait()
    assert runner.score([(3, "abcd", ""), (4, "a", "")]) == [4.0, 1.0]
    assert runner.counters.errors == 0
    runner.close()


def test_uncounted_scores_leave_the_counters_alone():
    """Held-out scoring goes through the run's runner, but `reward/*` count the run's own
    samples: a failing held-out call is scored 0 without being counted."""
    runner = RewardRunner(flaky, timeout_s=5.0, isolation="thread")
    assert runner.score([(0, "raise", ""), (1, "1.0", "")], counted=False)[0] == 0.0
    assert runner.counters == RewardCounters()
    runner.score([(2, "raise", "")])
    assert runner.counters == RewardCounters(calls=1, errors=1)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_returned_value_that_cannot_be_shown_is_an_error_and_its_worker_stays(caplog, isolation):
    """The log shows what a reward returned, and showing it is user code too: a `repr` that
    raises, or an int too long to print, was a lost call (a thread counted as timed out, a
    worker process dead and restarted)."""
    runner = RewardRunner(
        reward_helpers.unprintable, timeout_s=30.0, workers=1, isolation=isolation
    )
    with caplog.at_level(logging.WARNING):
        assert runner.score([(0, "huge", ""), (1, "odd", ""), (2, "x", "")]) == [0.0, 0.0, 1.0]
    assert (runner.counters.errors, runner.counters.timeouts) == (2, 0)
    assert not any("died" in m for m in caplog.messages)
    assert any("Unshowable that cannot be shown" in m for m in caplog.messages)
    runner.close()


def test_a_worker_imports_the_reward_module_the_controller_imported(tmp_path, monkeypatch):
    """A worker unpickles the reward by module name: it must find the controller's module, not
    a file of the same name in the working directory (which `python -c` puts first)."""
    mine, stale = tmp_path / "mine", tmp_path / "cwd"
    for directory, value in ((mine, 1.0), (stale, -7.0)):
        directory.mkdir()
        (directory / "probe_reward_module.py").write_text(
            f"def score(completion, answer):\n    return {value}\n"
        )
    monkeypatch.syspath_prepend(str(mine))
    monkeypatch.chdir(stale)
    import probe_reward_module

    try:
        runner = RewardRunner(probe_reward_module.score, timeout_s=30.0, workers=1)
        assert runner.score([(0, "x", "")]) == [1.0]
        runner.close()
    finally:
        del sys.modules["probe_reward_module"]


def _sleeps_then_scores(completion: str, answer: str) -> float:
    time.sleep(float(completion))
    return 1.0


def test_a_call_past_its_timeout_is_a_timeout_even_when_the_wait_for_it_overran(monkeypatch):
    """On a busy host the runner can look for a result after the deadline, and find it there:
    it was taken as scored. A call is judged by its own duration, timed where it ran. Here the
    wait overruns for sure: every join waits for its thread."""
    join = threading.Thread.join
    monkeypatch.setattr(threading.Thread, "join", lambda self, timeout=None: join(self))
    runner = RewardRunner(_sleeps_then_scores, timeout_s=0.2, workers=2, isolation="thread")
    assert runner.score([(0, "0.5", ""), (1, "0", "")]) == [0.0, 1.0]
    assert (runner.counters.timeouts, runner.counters.errors) == (1, 0)
