"""Rule rewards, the reward-function registry (user `module:function`) and batch scoring."""

from __future__ import annotations

import logging
import math
import re
import sys
import textwrap

import numpy as np
import pytest
import torch

from rl_megatron.config import Config
from rl_megatron.rewards.registry import RewardError, get_reward_fn, reward_fn_from_config
from rl_megatron.rewards.rules import (
    boxed_math,
    digit_echo,
    exact_match,
    extract_boxed,
    extract_last_number,
    gsm8k,
    gsm8k_flexible,
    normalize_math_answer,
)
from rl_megatron.rewards.scoring import score_batch

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


# --------------------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    ("response", "reference", "score"),
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", GSM8K_SOLUTION, 1.0),
        ("#### 71", GSM8K_SOLUTION, 0.0),
        ("#### 1,234", "1234", 1.0),  # thousands separator
        ("#### $1,234.00", "#### 1234", 1.0),  # dollar sign, trailing zeros
        ("#### -5", "#### -5", 1.0),  # negative
        ("#### 5", "#### -5", 0.0),  # the sign matters
        ("#### \u22125", "-5", 1.0),  # unicode minus
        ("#### $-3", "-3", 1.0),
        ("first try #### 3, no wait, recount\n#### 4", "4", 1.0),  # last occurrence wins
        ("first try #### 4\nthen #### 3", "4", 0.0),
        ("#### 72.", "72", 1.0),  # sentence full stop
        ("#### 72.5", "72", 0.0),
        ("####72 apples", "72", 1.0),
        ("The answer is 72.", "72", 0.0),  # no marker, no answer
        ("#### the answer is unclear", "72", 0.0),  # marker without a number
        ("", "72", 0.0),
        ("#### 123456789012345678901", "123456789012345678901", 1.0),  # beyond float precision
        ("#### 123456789012345678900", "123456789012345678901", 0.0),
    ],
)
def test_gsm8k(response, reference, score):
    assert gsm8k(response, {"answer": reference}) == score


def test_gsm8k_unusable_reference_raises():
    with pytest.raises(ValueError, match="holds no number"):
        gsm8k("#### 3", {"answer": "#### none"})
    with pytest.raises(ValueError, match="no 'answer' field"):
        gsm8k("#### 3", {"question": "?"})
    assert gsm8k("#### 3", {"answer": 3}) == 1.0  # numeric references (Parquet ints)


@pytest.mark.parametrize(
    ("response", "reference", "strict", "flexible"),
    [
        # a "####" answer decides for both, even when an earlier or later number differs
        ("3 + 4 = 7 apples, plus 65 more\n#### 72", "#### 72", 1.0, 1.0),
        ("#### 71\nso 72 in total", "72", 0.0, 0.0),
        # no marker: only the flexible rule reads the last number
        ("She sold 48 + 24 = 72 clips.", GSM8K_SOLUTION, 0.0, 1.0),
        ("72 is wrong; recounting gives 71", "72", 0.0, 0.0),  # the last number, not any
        ("The total is 1,234 dollars.", "1234", 0.0, 1.0),  # thousands separator
        ("It costs $1,234.00.", "#### 1234", 0.0, 1.0),  # dollar, trailing zeros, full stop
        ("The change in temperature is -5 degrees", "-5", 0.0, 1.0),
        ("The change in temperature is \u22125", "-5", 0.0, 1.0),  # unicode minus
        ("x = -3", "-3", 0.0, 1.0),
        ("From pages 3-5", "-5", 0.0, 0.0),  # a dash between numbers is no sign
        ("The average is 2.5", "2.5", 0.0, 1.0),
        ("The average is 2.5", "2", 0.0, 0.0),
        ("so 72 apples\n#### (not sure)", "72", 0.0, 1.0),  # a marker without a number
        ("Step 2: the answer is 72", "72", 0.0, 1.0),
        ("Let's think step by step. First, the", "72", 0.0, 0.0),  # cut off before a number
        ("", "72", 0.0, 0.0),
    ],
)
def test_gsm8k_flexible_reads_the_last_number_when_there_is_no_marked_answer(
    response, reference, strict, flexible
):
    assert gsm8k(response, {"answer": reference}) == strict
    assert gsm8k_flexible(response, {"answer": reference}) == flexible
    assert get_reward_fn("gsm8k_flexible")(response, {"answer": reference}) == flexible


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("1,234,567 and 8", "8"),
        ("1,234,567", "1234567"),
        ("1,2", "2"),  # a list, not a thousands separator
        ("version x5", None),  # part of a name
        ("a.5", None),
        ("3.14.", "3.14"),
        ("no digits", None),
    ],
)
def test_extract_last_number(text, number):
    assert extract_last_number(text) == number


def test_gsm8k_flexible_unusable_reference_raises():
    with pytest.raises(ValueError, match="holds no number"):
        gsm8k_flexible("72", {"answer": "#### none"})


# --------------------------------------------------------------------------- boxed


@pytest.mark.parametrize(
    ("response", "reference", "score"),
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),  # nested braces
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),  # two levels + shorthand
        (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),  # \dfrac and \frac12
        (r"\boxed{\tfrac{a}{b}}", r"\frac{a}{b}", 1.0),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", 1.0),
        (r"\boxed{1} no wait \boxed{2}", "2", 1.0),  # the last box counts
        (r"\boxed{2} no wait \boxed{1}", "2", 0.0),
        (r"\boxed{2}", "3", 0.0),
        (r"The answer is \boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),  # cut off: not closed
        ("The answer is 1/2", r"\frac{1}{2}", 0.0),  # no box
        (r"\boxed{5.}", "5", 1.0),  # trailing full stop
        (r"\boxed{x = 5}", "5", 1.0),  # a single-letter unknown
        (r"\boxed{10\%}", "10", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{0.5}", ".5", 1.0),  # numbers compare as numbers
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{1,2}", "12", 0.0),  # not a thousands separator
        (r"\boxed{\{1, 2\}}", r"\{1,2\}", 1.0),  # escaped braces do not close the box
        (r"\boxed{3\!\cdot\,4}", r"3\cdot4", 1.0),
        (r"\boxed{\text{(B)}}", "(B)", 1.0),
        (r"\boxed 5$", "5", 1.0),  # brace-less form
        (r"\fbox{7}", "7", 1.0),
        (r"\boxed{-\frac{3}{4}}", r"-\dfrac34", 1.0),
        (r"\boxed{x \rightarrow 0}", r"x\rightarrow0", 1.0),  # \right inside \rightarrow kept
        (r"\boxed{6}", r"Solution: so we get $\boxed{6}$.", 1.0),  # a full reference solution
    ],
)
def test_boxed_math(response, reference, score):
    assert boxed_math(response, {"answer": reference}) == score


def test_boxed_helpers():
    assert extract_boxed(r"a \boxed{b{c}{d{e}}} f") == "b{c}{d{e}}"
    assert extract_boxed("nothing here") is None
    assert extract_boxed(r"\boxed{a\}b} c") == r"a\}b"  # an escaped, unpaired brace
    assert normalize_math_answer(r"$ \left[ 1 , 2 \right) $") == "[1,2)"
    assert normalize_math_answer(r"a\rightarrow b") == r"a\rightarrowb"
    with pytest.raises(ValueError, match="is empty"):
        boxed_math(r"\boxed{1}", {"answer": "  "})
    # A box at the very end of the text, or followed by nothing but spaces: cut off.
    for text in (r"the answer is \boxed", "\\boxed  ", r"\fbox", r"\boxed{"):
        assert extract_boxed(text) is None, text
    assert extract_boxed(r"\boxed5") is None  # neither a brace nor the spaced form
    assert extract_boxed("\\boxed \n 7 ") == "7"
    # Only a single-letter unknown before one "=" is dropped.
    assert normalize_math_answer("x=5") == "5"
    assert normalize_math_answer("xy=5") == "xy=5"
    assert normalize_math_answer("a=b=5") == "a=b=5"


def test_digit_echo_credits_each_character():
    # 1 for the answer digit, 0.2 for another digit, 0 for anything else; mean over chars.
    assert digit_echo("7a33", {"answer": "7"}) == pytest.approx((1 + 0 + 0.2 + 0.2) / 4)
    assert digit_echo("777", {"answer": " 7 "}) == 1.0
    assert digit_echo("", {"answer": "7"}) == 0.0
    for bad in ("12", "x", ""):
        with pytest.raises(ValueError, match="'answer' must be one digit"):
            digit_echo("7", {"answer": bad})


# --------------------------------------------------------------------------- exact match


def test_exact_match():
    assert exact_match("  Paris \n", {"answer": "Paris"}) == 1.0
    assert exact_match("paris", {"answer": "Paris"}) == 0.0
    assert exact_match("42", {"answer": 42}) == 1.0
    assert exact_match("", {"answer": "x"}) == 0.0


# --------------------------------------------------------------------------- registry


def test_registry_names_and_answer_key():
    assert get_reward_fn("gsm8k")("#### 7", {"answer": "7"}) == 1.0
    fn = get_reward_fn("exact_match", answer_key="target")
    assert fn("7", {"target": "7", "answer": "8"}) == 1.0
    assert fn.__name__ == "exact_match"
    with pytest.raises(RewardError, match="unknown reward 'gsm9k'; use one of gsm8k, boxed_math"):
        get_reward_fn("gsm9k")


def write_module(directory, name, source):
    (directory / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("rmtest_")]:
        del sys.modules[name]


def test_user_function_by_module_and_function_imported_once(user_dir):
    write_module(
        user_dir,
        "rmtest_counting",
        """
        IMPORTS = []
        IMPORTS.append(1)

        def length_reward(response_text, sample):
            return len(response_text) / sample["scale"]
        """,
    )
    fn = get_reward_fn("rmtest_counting:length_reward")
    assert fn("abcd", {"scale": 2}) == 2.0
    assert get_reward_fn("rmtest_counting:length_reward") is fn
    assert sys.modules["rmtest_counting"].IMPORTS == [1]  # executed once


def test_user_function_from_a_file_path(tmp_path):
    write_module(tmp_path, "my_reward", "def score(response_text, sample):\n    return 0.5\n")
    fn = get_reward_fn(f"{tmp_path / 'my_reward.py'}:score")
    assert fn("x", {}) == 0.5


@pytest.mark.parametrize(
    ("source", "spec", "expected"),
    [
        (None, "rmtest_absent:fn", "cannot import 'rmtest_absent' for 'rmtest_absent:fn' "
         "(ModuleNotFoundError: No module named 'rmtest_absent')"),
        ("x = 1\n", "rmtest_noattr:fn", "module 'rmtest_noattr' has no attribute 'fn'"),
        ("fn = 3\n", "rmtest_notcallable:fn", "'rmtest_notcallable:fn' is a int, not a function"),
        ("def fn(text):\n    return 1.0\n", "rmtest_arity:fn",
         "must accept (response_text, sample), its signature is fn(text)"),
        ("raise RuntimeError('boom\\nsecond line')\n", "rmtest_broken:fn",
         "cannot import 'rmtest_broken' for 'rmtest_broken:fn' (RuntimeError: boom)"),
        ("def fn(a, b):\n  return 1\n", ":fn", "must look like 'package.module:function'"),
    ],
)  # fmt: skip
def test_user_function_errors_are_one_line(user_dir, source, spec, expected):
    if source is not None:
        write_module(user_dir, spec.split(":")[0] or "rmtest_unused", source)
    with pytest.raises(RewardError) as info:
        get_reward_fn(spec)
    message = str(info.value)
    assert message.startswith("reward.function: ") and expected in message
    assert "\n" not in message


def test_reward_fn_from_config():
    config = Config()
    config.reward.function = "exact_match"
    config.data.answer_key = "solution"
    assert reward_fn_from_config(config)("a", {"solution": "a"}) == 1.0


# --------------------------------------------------------------------------- scoring


def flaky(response_text, sample):
    if sample.get("bad"):
        raise KeyError("no field 'x'\nin this sample")
    return float(response_text)


def test_raising_sample_scored_and_counted(caplog):
    samples = [{}, {}, {"bad": True}, {}]
    with caplog.at_level(logging.WARNING, logger="rl_megatron"):
        scores, metrics = score_batch(flaky, ["1", "0", "1", "1"], samples, error_score=-1.0)
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.0, -1.0, 1.0]
    assert metrics["reward/errors"] == 1.0
    assert metrics["reward/mean"] == pytest.approx(0.25)
    assert metrics["reward/std"] == pytest.approx(float(np.std([1, 0, -1, 1])))
    assert "1 of 4 samples failed in 'flaky' and scored -1.0; first: sample 2: KeyError" in (
        caplog.text
    )


def test_raise_mode_names_the_sample_in_one_line():
    samples = [{}, {}, {"bad": True}]
    with pytest.raises(RewardError) as info:
        score_batch(flaky, ["1", "1", "1"], samples, on_error="raise", names=["a:1", "a:2", "a:3"])
    message = str(info.value)
    assert "reward function 'flaky' failed on sample 2 (a:3): KeyError:" in message
    assert "in this sample" in message and "\n" not in message
    assert isinstance(info.value.__cause__, KeyError)  # the traceback is kept for debugging


def exits(response_text, sample):
    sys.exit(sample.get("code"))


def test_sys_exit_in_the_function_is_a_failed_sample():
    """SystemExit is a BaseException: uncaught, it would end one rank and leave the others
    waiting in a collective. It is counted (score) or stops the run in one line (raise)."""
    samples = [{"code": 3}, {}]
    scores, metrics = score_batch(exits, ["a", "b"], samples, error_score=-1.0)
    assert scores.tolist() == [-1.0, -1.0] and metrics["reward/errors"] == 2.0
    with pytest.raises(RewardError) as info:
        score_batch(exits, ["a"], samples[:1], on_error="raise", names=["t.jsonl:4"])
    assert str(info.value) == (
        "reward function 'exits' failed on sample 0 (t.jsonl:4): called sys.exit(3) "
        "(set reward.on_error=score to score such samples reward.error_score)"
    )


def test_keyboard_interrupt_in_the_function_is_not_swallowed():
    def interrupted(response_text, sample):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_batch(interrupted, ["a"], [{}])


def test_sys_exit_when_importing_a_user_module_is_one_line(tmp_path):
    module = tmp_path / "exits_on_import.py"
    module.write_text("import sys\nsys.exit('no GPU here')\n\ndef score(r, s):\n    return 1.0\n")
    with pytest.raises(RewardError) as info:
        get_reward_fn(f"{module}:score")
    assert str(info.value) == (
        f"reward.function: cannot import {str(module)!r} for '{module}:score' "
        "(SystemExit: no GPU here)"
    )


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (math.nan, "returned nan, not a finite number"),
        (math.inf, "returned inf, not a finite number"),
        ("1.0", "returned str '1.0', not a number"),
        (None, "returned NoneType None, not a number"),
        ([1.0], "returned list [1.0], not a number"),
        (torch.ones(2), "returned a tensor of shape (2,), not a number"),
    ],
)
def test_non_numeric_or_non_finite_returns_are_errors(value, reason):
    scores, metrics = score_batch(lambda r, s: value, ["x"], [{}], error_score=0.0)
    assert scores.tolist() == [0.0] and metrics["reward/errors"] == 1.0
    pattern = r"failed on sample 0: (TypeError|ValueError): " + re.escape(reason)
    with pytest.raises(RewardError, match=pattern):
        score_batch(lambda r, s: value, ["x"], [{}], on_error="raise")


def test_numeric_return_types_are_accepted():
    values = [True, 2, np.float32(0.5), np.int64(3), torch.tensor(1.5), torch.tensor([0.25])]
    fns = [lambda r, s, v=v: v for v in values]
    for fn, expected in zip(fns, [1.0, 2.0, 0.5, 3.0, 1.5, 0.25]):
        scores, metrics = score_batch(fn, ["x"], [{}])
        assert scores.tolist() == [expected] and metrics["reward/errors"] == 0.0


def test_builtin_rule_on_a_sample_without_the_answer_is_counted():
    fn = get_reward_fn("gsm8k")
    scores, metrics = score_batch(fn, ["#### 1", "#### 2"], [{"answer": "1"}, {"question": "?"}])
    assert scores.tolist() == [1.0, 0.0] and metrics["reward/errors"] == 1.0


def test_empty_batch_and_length_mismatch():
    scores, metrics = score_batch(flaky, [], [])
    assert scores.shape == (0,) and math.isnan(metrics["reward/mean"])
    with pytest.raises(ValueError, match="2 responses but 1 samples"):
        score_batch(flaky, ["1", "2"], [{}])
