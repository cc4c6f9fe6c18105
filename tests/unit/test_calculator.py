"""The calculator tool: arithmetic, and nothing else."""

from __future__ import annotations

import time

import pytest

from rl_megatron.environments.calculator import (
    MAX_CHARS,
    MAX_INT_BITS,
    CalculatorError,
    calculate,
    evaluate,
)


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 ** 3 ** 2", 512),  # ** is right-associative
        ("-2 ** 2", -4),  # unary minus binds looser than **
        ("(-2) ** 2", 4),
        ("7 // 2 + 7 % 2", 4),
        ("-7 // 2", -4),
        ("7 / 2", 3.5),
        ("2 ** -1", 0.5),
        ("3 × 4 − 10 ÷ 4", 9.5),
        ("1e3 + .5", 1000.5),
        ("+5 - -5", 10),
    ],
)
def test_values_and_precedence(expression, value):
    result = evaluate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("2 ^ 3", "operator BitXor is not allowed (use ** for powers)"),
        ("1 << 3", "operator LShift is not allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j * 2", "only numbers are allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("10.0 ** 400", "result too large"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 1001, "longer than 1000 characters"),
    ],
)
def test_refusals(expression, reason):
    with pytest.raises(CalculatorError, match=None) as info:
        evaluate(expression)
    assert reason in str(info.value)


def test_huge_powers_are_refused_quickly():
    start = time.monotonic()
    for expression in ("9**9**9", "2**5000", "(10**1000) * (10**1000)", "10**400 / 3"):
        assert calculate(expression).startswith("error: "), expression
    assert time.monotonic() - start < 0.5
    assert calculate("2**4000") == str(2**4000)  # under the bound it is exact


def test_answers_are_text():
    assert calculate("0.1 + 0.2") == "0.3"
    assert calculate("2 ** 100") == "1267650600228229401496703205376"
    assert calculate("1 / 3") == "0.333333333333333"
    assert calculate("foo") == "error: Name is not allowed (numbers and + - * / // % ** only)"


def test_the_bounds_are_inclusive():
    # MAX_CHARS characters and MAX_INT_BITS-bit integers are computed; one more is refused.
    longest = "1" + "+1" * ((MAX_CHARS - 1) // 2)
    assert evaluate(longest.ljust(MAX_CHARS)) == (MAX_CHARS + 1) // 2  # spaces fill it out
    with pytest.raises(CalculatorError, match=f"longer than {MAX_CHARS} characters"):
        evaluate(longest.ljust(MAX_CHARS + 1))
    assert evaluate(f"2**{MAX_INT_BITS - 1}").bit_length() == MAX_INT_BITS
    with pytest.raises(CalculatorError, match=f"larger than {MAX_INT_BITS} bits"):
        evaluate(f"2**{MAX_INT_BITS}")
