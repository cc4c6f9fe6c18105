"""The calculator tool: arithmetic over an `ast` walk, never `eval`.

Numbers, + - * / // % **, unary minus and plus, parentheses; nothing else (no names, calls,
attributes, comparisons), so there is nothing to escape into. Bounded: an expression past
`MAX_CHARS` or an integer past `MAX_INT_BITS` is refused before it is computed, so
`9**9**9` is an error in microseconds instead of a hang.
"""

from __future__ import annotations

import ast
import math
import operator

__all__ = ["CalculatorError", "evaluate", "calculate"]

MAX_CHARS = 1000  # a longer expression is not arithmetic a model needs a tool for
MAX_INT_BITS = 4096  # ~1233 decimal digits; bounds every intermediate integer

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# The symbols people (and models) write for the same operators.
_SPELLINGS = str.maketrans({"×": "*", "÷": "/", "−": "-"})


class CalculatorError(ValueError):
    """The expression is not arithmetic this calculator computes (the message says why)."""


def evaluate(expression: str) -> int | float:
    """The value of `expression`; raises CalculatorError for anything else."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.translate(_SPELLINGS).strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    return _value(tree.body)


def calculate(expression: str) -> str:
    """The tool's answer: the value as text, or `error: <why>`."""
    try:
        value = evaluate(expression)
    except CalculatorError as e:
        return f"error: {e}"
    if isinstance(value, float):
        return format(value, ".15g")  # 15 digits: what a double holds exactly
    return str(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        # bool is an int subclass and complex a number; neither is arithmetic input here.
        if type(node.value) in (int, float):
            return _checked(node.value)
        raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(result, complex):  # (-8) ** 0.5
            raise CalculatorError("result is not a real number")
        return _checked(result)
    if isinstance(node, ast.BinOp):
        hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
        raise CalculatorError(f"operator {type(node.op).__name__} is not allowed{hint}")
    raise CalculatorError(
        f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)"
    )


def _check_power(base: int | float, exponent: int | float) -> None:
    # Refuse before computing: an integer power has at least (bits(base) - 1) × exponent
    # bits, and computing 9**387420489 is the hang this prevents. What passes is at most
    # twice the bound, cheap to compute; `_checked` then applies the exact bound.
    integers = isinstance(base, int) and isinstance(exponent, int)
    if integers and exponent > 0 and (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
        raise CalculatorError(f"result larger than {MAX_INT_BITS} bits")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result larger than {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    return value
