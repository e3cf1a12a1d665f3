"""A user reward loaded by dotted path (`app_rewards:flaky_exact_match`) in the app tests."""


def flaky_exact_match(completion: str, answer: str) -> float:
    """Exact match that raises on answers starting with "1": the runner must count those."""
    if answer.startswith("1"):
        raise RuntimeError("this reward function fails on purpose")
    return float(completion.strip() == answer.strip())
