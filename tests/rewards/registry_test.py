"""Reward registry: built-ins against known truths, dotted paths, options, clear errors."""

from __future__ import annotations

import sys
import threading

import pytest
import sympy

from dora_jax.rewards import get_reward, register_reward, registered_rewards


def test_builtins_are_registered():
    assert {"exact_match", "format", "math"} <= set(registered_rewards())


def test_exact_match():
    fn = get_reward("exact_match")
    assert fn("  abc\n", "abc") == 1.0
    assert fn("abcd", "abc") == 0.0
    assert fn("ABC", "abc") == 0.0
    assert fn("", "") == fn(" \n", " ") == 0.0  # a row without an answer rewards no silence


def test_format_reward_with_a_configured_pattern():
    boxed = get_reward("format")
    assert boxed("so \\boxed{42}.", "") == 1.0
    assert boxed("so 42", "") == 0.0
    assert boxed("\\boxed{}", "") == 0.0
    tagged = get_reward("format", pattern=r"<answer>.+?</answer>")
    assert tagged("think... <answer>\n7\n</answer>", "") == 1.0
    assert tagged("<answer></answer>", "") == 0.0


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{2}{4}", 1.0),
        ("so x = \\boxed{3}", "3", 1.0),
        ("so x = \\boxed{4}", "3", 0.0),
        ("$\\sqrt{2}$", "\\sqrt{2}", 1.0),
        ("no number here", "3", 0.0),
        ("\\boxed{1,2}", "3", 0.0),
    ],
)
def test_math_reward(completion, answer, expected):
    assert get_reward("math")(completion, answer) == expected


@pytest.mark.parametrize(
    "gold,gold_sympy",
    [
        (r"2\sqrt{2}", "2*sqrt(2)"),
        (r"3\pi", "3*pi"),
        (r"2^{10}", "2**10"),
        (r"\frac{\sqrt{3}}{2}", "sqrt(3)/2"),
        (r"12\%", "12/100"),
        ("1.5", "3/2"),
    ],
)
@pytest.mark.parametrize(
    "boxed,boxed_sympy",
    [("2", "2"), ("3", "3"), (r"2\sqrt{2}", "2*sqrt(2)"), (r"3\pi", "3*pi"), ("1024", "1024"),
     ("0.12", "12/100"), ("1.5", "3/2")],
)  # fmt: skip
def test_math_reward_parses_latex_golds_as_latex(gold, gold_sympy, boxed, boxed_sympy):
    r"""Plain-text parsing of a LaTeX gold keeps only its first number (`2\sqrt{2}` -> 2), which
    scored wrong answers 1 and right ones 0; sympy on both written by hand is the reference."""
    expected = sympy.simplify(sympy.sympify(gold_sympy) - sympy.sympify(boxed_sympy)) == 0
    assert get_reward("math")(f"so \\boxed{{{boxed}}}", gold) == float(expected)


def test_math_reward_latex_gold_forms():
    math = get_reward("math")
    assert math("\\boxed{(1,2)}", "(1, 2)") == 1.0
    assert math("\\boxed{(2,1)}", "(1, 2)") == 0.0
    assert math("\\boxed{3x+2}", "3x+2") == 1.0
    assert math("\\boxed{3}", "3x+2") == 0.0


def test_math_reward_still_scores_small_and_symbolic_powers():
    math = get_reward("math")
    assert math(r"\boxed{2^{10}}", "1024") == 1.0
    assert math(r"\boxed{2^{2^{3}}}", "256") == 0.0  # a tower of numbers is refused, even small
    assert math(r"\boxed{2^{2^{n}}+1}", "2^{2^n}+1") == 1.0
    assert math(r"\boxed{e^{-x^2}}", "e^{-x^2}") == 1.0
    assert math(r"\boxed{3^{1000}}", str(3**1000)) == 1.0


def test_math_reward_works_off_the_main_thread():
    """math-verify's own signal.alarm timeouts would raise in a worker thread."""
    results = []
    thread = threading.Thread(target=lambda: results.append(get_reward("math")("\\boxed{2}", "2")))
    thread.start()
    thread.join(30)
    assert results == [1.0]


def test_user_functions_by_dotted_path_with_options():
    colon = get_reward("reward_helpers:length_reward")
    dotted = get_reward("reward_helpers.length_reward", scale=2.0)
    assert colon("abc", "") == 3.0
    assert dotted("abc", "") == 6.0


def test_a_module_in_the_working_directory_is_found_without_it_on_the_path(tmp_path, monkeypatch):
    # The installed `dora-jax` script starts with its bin directory on the path, not the cwd.
    (tmp_path / "my_cwd_reward.py").write_text("def score(c, a):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert get_reward("my_cwd_reward:score")("x", "y") == 0.5
    assert sys.path[-1] == str(tmp_path)  # after the installed packages, which win


def test_register_reward_decorator():
    @register_reward("test_registry_always_half")
    def half(completion: str, answer: str) -> float:
        return 0.5

    assert get_reward("test_registry_always_half")("x", "y") == 0.5
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_registry_always_half")(half)


def test_errors_name_the_reward_and_option():
    with pytest.raises(ValueError, match="'nope'.*neither a registered reward"):
        get_reward("nope")
    with pytest.raises(ValueError, match="cannot import 'missing'"):
        get_reward("reward_helpers:missing")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("no_such_module_xyz.fn")
    with pytest.raises(
        ValueError, match=r"reward\.options\.patern: reward 'format' takes no such option"
    ):
        get_reward("format", patern="x")


@pytest.mark.parametrize("name", ["reward_helpers:needs_prompt", "reward_helpers:one_arg"])
def test_a_function_the_runner_cannot_call_is_refused_naming_the_field(name):
    """It passed the start-up check, then raised on every call: a whole run scored 0."""
    with pytest.raises(ValueError, match=rf"reward\.name='{name}'.*fn\(completion, answer"):
        get_reward(name)
