"""A user reward module, imported by dotted path in the registry tests."""


def length_reward(completion: str, answer: str, scale: float = 1.0) -> float:
    return scale * len(completion)


def needs_prompt(prompt: str, completion: str, answer: str) -> float:
    return float(completion == answer)


def one_arg(completion: str) -> float:
    return 1.0
