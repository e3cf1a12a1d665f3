"""User rewards loaded by dotted path (`app_rewards:NAME`) in the app tests."""

import threading


def flaky_exact_match(completion: str, answer: str) -> float:
    """Exact match that raises on answers starting with "1": the runner must count those."""
    if answer.startswith("1"):
        raise RuntimeError("this reward function fails on purpose")
    return float(completion.strip() == answer.strip())


def even_length(completion: str, answer: str) -> float:
    """1 for a completion of even length: rewards that differ within a group from the first
    step, so every RL update moves the policy without a warm-up."""
    del answer
    return float(len(completion) % 2 == 0)


MEETING = threading.Barrier(6)


def meets_five_others(completion: str, answer: str) -> float:
    """1 once six calls are in flight together; with fewer workers the barrier breaks."""
    MEETING.wait(timeout=10)
    return 1.0


SCORED: list[str] = []


def remembers_what_it_scores(completion: str, answer: str) -> float:
    """`even_length`, keeping every completion it scores (in-process, `isolation="thread"`)."""
    SCORED.append(completion)
    return even_length(completion, answer)
