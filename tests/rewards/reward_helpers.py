"""A user reward module, imported by dotted path in the registry tests."""

import os
import re
import sys


def length_reward(completion: str, answer: str, scale: float = 1.0) -> float:
    return scale * len(completion)


def needs_prompt(prompt: str, completion: str, answer: str) -> float:
    return float(completion == answer)


def one_arg(completion: str) -> float:
    return 1.0


def backtracks(completion: str, answer: str) -> float:
    """Exponential backtracking on 'aaa...ab', inside `re`, which holds the GIL throughout."""
    return float(re.match(r"(a+)+$", completion) is not None)


def exits_on_exit(completion: str, answer: str) -> float:
    if completion == "exit":
        os._exit(3)  # the worker process ends mid-call, as a crash in C code would end it
    return 1.0


def calls_sys_exit(completion: str, answer: str) -> float:
    if completion == "exit":
        sys.exit("a reward that calls sys.exit")
    return 1.0


def spins(completion: str, answer: str) -> float:
    while True:  # a call that never returns, as one stuck in C code never does
        pass


class Unshowable:
    """A returned value whose `repr` raises, as a user's own result type might."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def unprintable(completion: str, answer: str) -> object:
    if completion == "huge":
        return 10**5000  # an int Python refuses to print (over 4,300 digits)
    if completion == "odd":
        return Unshowable()
    return 1.0
