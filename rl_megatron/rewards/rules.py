"""Rule-based rewards: 1.0 when a response's final answer matches the sample's reference.

Each rule is `fn(response_text, sample, answer_key="answer") -> float` and reads the
reference from `sample[answer_key]` (`data.answer_key`). A response without an answer in
the expected form scores 0.0; a sample whose reference is missing or unusable raises,
so that `scoring.score_batch` counts it as an error instead of hiding a data problem.

    gsm8k        the number after the last `####`, compared numerically with the reference's
    gsm8k_flexible  the same, or the response's last number when it has no `####` answer
    boxed_math   the last `\\boxed{...}`, compared after LaTeX normalisation
    exact_match  stripped string equality
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

__all__ = [
    "RULES",
    "RuleFn",
    "gsm8k",
    "gsm8k_flexible",
    "boxed_math",
    "exact_match",
    "extract_gsm8k_answer",
    "extract_last_number",
    "extract_boxed",
    "normalize_math_answer",
]

RuleFn = Callable[..., float]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# A number in running text: "1,234.5", "-3", "72" in "72." — not the "5" of "3-5" or "x5",
# whose "-" is a dash and whose letter makes it a name.
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?:\.\d+)?")


def _reference(sample: Mapping[str, Any], answer_key: str) -> str:
    if answer_key not in sample or sample[answer_key] is None:
        raise ValueError(
            f"the sample has no {answer_key!r} field to compare with (data.answer_key)"
        )
    return str(sample[answer_key])


def _same_number(a: str, b: str) -> bool:
    # Decimal, not float: "72" == "72.0" but large integers are compared exactly.
    return Decimal(a) == Decimal(b)


# ---------------------------------------------------------------------------------------
# GSM8K: "... #### 1,234"


def extract_gsm8k_answer(text: str, require_marker: bool = True) -> str | None:
    """The first number after the last `####` in `text` (commas, `$` and spaces removed).

    With `require_marker=False` a text without `####` is searched whole (for references
    that hold the bare number). Returns None when there is no number.
    """
    marker = text.rfind("####")
    if marker < 0:
        if require_marker:
            return None
        tail = text
    else:
        tail = text[marker + 4 :]
    # The answer sits on the marker's line; later lines are chatter, not the answer.
    tail = tail.strip().split("\n", 1)[0]
    tail = tail.replace(",", "").replace("$", "").replace("\u2212", "-")
    tail = re.sub(r"-\s+(?=\d)", "-", tail)
    match = _NUMBER.search(tail)
    return match.group(0) if match else None


def gsm8k(response: str, sample: Mapping[str, Any], answer_key: str = "answer") -> float:
    """1.0 when the number after the response's last `####` equals the reference's."""
    reference = extract_gsm8k_answer(_reference(sample, answer_key), require_marker=False)
    if reference is None:
        raise ValueError(f"the reference {answer_key!r} holds no number")
    predicted = extract_gsm8k_answer(response)
    if predicted is None:
        return 0.0
    return 1.0 if _same_number(predicted, reference) else 0.0


def extract_last_number(text: str) -> str | None:
    """The last number in `text` (thousands commas and `$` removed), or None when it has none."""
    text = text.replace("\u2212", "-").replace("$", "")
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def gsm8k_flexible(response: str, sample: Mapping[str, Any], answer_key: str = "answer") -> float:
    """`gsm8k`, but a response without a number after `####` is judged by its last number.

    For models that do not follow the preset's "#### answer" instruction, or ramble past
    `rollout.max_response_length` before writing it: the answer they worked out still
    counts (as in lm-evaluation-harness' "flexible-extract" of GSM8K).
    """
    reference = extract_gsm8k_answer(_reference(sample, answer_key), require_marker=False)
    if reference is None:
        raise ValueError(f"the reference {answer_key!r} holds no number")
    predicted = extract_gsm8k_answer(response)
    if predicted is None:
        predicted = extract_last_number(response)
    if predicted is None:
        return 0.0
    return 1.0 if _same_number(predicted, reference) else 0.0


# ---------------------------------------------------------------------------------------
# Boxed math answers: "... so the answer is $\boxed{\frac{1}{2}}$."


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included.

    Also accepts the brace-less `\\boxed 5` form. Returns None when there is no box or the
    last one is not closed (a response cut off mid-answer).
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    spaced = i < len(text) and text[i].isspace()
    while i < len(text) and text[i].isspace():
        i += 1
    if i < len(text) and text[i] != "{" and spaced:
        # `\boxed 5`: the argument runs to the next `$` or whitespace.
        match = re.match(r"[^\s$]+", text[i:])
        return match.group(0) if match else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    j = i
    while j < len(text):
        char = text[j]
        if char == "\\":
            # Escaped characters (`\{`, `\}`, `\\`) never open or close the box.
            j += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


# Applied in order; each removes notation that does not change the value.
_LATEX_REWRITES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\\(?:left|right)(?![a-zA-Z])"), ""),
    (re.compile(r"\\displaystyle"), ""),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\^\{?\\circ\}?"), ""),
    (re.compile(r"\\?%"), ""),
    (re.compile(r"\\[!,;:> ]|\\q?quad"), ""),
    (re.compile(r"\s+"), ""),
    # \frac12 → \frac{1}{2}, \frac{a}2 → \frac{a}{2}, \sqrt2 → \sqrt{2} (LaTeX shorthand)
    (re.compile(r"\\frac(\d)(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac(\d)\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac(\{[^{}]*\})(\d)"), r"\\frac\1{\2}"),
    (re.compile(r"\\sqrt(\d)"), r"\\sqrt{\1}"),
]


def normalize_math_answer(answer: str) -> str:
    """A canonical string for a LaTeX answer, so equal answers compare equal as strings.

    Removes `$`, `\\left`/`\\right`, thin spaces (`\\!`, `\\,`, ...), all whitespace,
    `\\text{}` wrappers, degree signs, `%`, a trailing `.`, and a leading `x =`;
    `\\dfrac`/`\\tfrac` become `\\frac`; `\\frac12` becomes `\\frac{1}{2}`; thousands
    separators in a plain number are dropped.
    """
    text = answer.strip().strip("$")
    for pattern, replacement in _LATEX_REWRITES:
        text = pattern.sub(replacement, text)
    text = text.rstrip(".")
    # "x=5" answers "5": a single-letter unknown on the left is not part of the value.
    if text.count("=") == 1 and re.fullmatch(r"[a-zA-Z]=.+", text):
        text = text[2:]
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return text


def _math_equal(predicted: str, reference: str) -> bool:
    a, b = normalize_math_answer(predicted), normalize_math_answer(reference)
    if _PLAIN_NUMBER.fullmatch(a) and _PLAIN_NUMBER.fullmatch(b):
        return _same_number(a, b)
    return a == b


def boxed_math(response: str, sample: Mapping[str, Any], answer_key: str = "answer") -> float:
    """1.0 when the response's last `\\boxed{}` equals the reference after normalisation.

    The reference may be the bare answer or a full solution with its own `\\boxed{}`.
    """
    reference = _reference(sample, answer_key)
    boxed_reference = extract_boxed(reference)
    if boxed_reference is not None:
        reference = boxed_reference
    if not normalize_math_answer(reference):
        raise ValueError(f"the reference {answer_key!r} is empty")
    predicted = extract_boxed(response)
    if predicted is None:
        return 0.0
    return 1.0 if _math_equal(predicted, reference) else 0.0


# ---------------------------------------------------------------------------------------


def exact_match(response: str, sample: Mapping[str, Any], answer_key: str = "answer") -> float:
    """1.0 when the stripped response equals the stripped reference."""
    return 1.0 if response.strip() == _reference(sample, answer_key).strip() else 0.0


def digit_echo(response: str, sample: Mapping[str, Any], answer_key: str = "answer") -> float:
    """The synthetic demo task (`data.synthetic_task: digit_echo`): repeat the answer digit.

    Mean over the response's characters of 1 for the answer digit, 0.2 for any other digit
    and 0 otherwise (0 for an empty response). The partial credit gives a randomly
    initialised model a gradient towards digits before it finds the right one.
    """
    answer = _reference(sample, answer_key).strip()
    if len(answer) != 1 or not answer.isdigit():
        raise ValueError(f"the reference {answer_key!r} must be one digit, got {answer!r}")
    if not response:
        return 0.0
    credit = [1.0 if c == answer else 0.2 if c in string.digits else 0.0 for c in response]
    return sum(credit) / len(credit)


# Names accepted by `reward.function`.
RULES: dict[str, RuleFn] = {
    "gsm8k": gsm8k,
    "boxed_math": boxed_math,
    "exact_match": exact_match,
    "digit_echo": digit_echo,
    "gsm8k_flexible": gsm8k_flexible,
}
