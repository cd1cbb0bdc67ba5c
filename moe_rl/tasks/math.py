"""The `"math"` reward: the final answer of a response against the reference answer.

The final answer is the content of the last `\\boxed{...}` (nested braces allowed), or else the
last number in the text. Answers compare as numbers when both parse (so "0.5" == "1/2" ==
"\\frac{1}{2}"), otherwise as strings with spaces, `$` and a trailing period removed.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from moe_rl.sample import Sample
from moe_rl.tasks.registry import register_reward

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in `text`, braces balanced; None when there is none."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1 : i]
    return None


def extract_answer(text: str) -> str | None:
    """The boxed answer, else the last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(answer: str) -> str:
    answer = _FRAC.sub(r"\1/\2", str(answer))
    return answer.replace(" ", "").replace("$", "").replace(",", "").rstrip(".")


def _as_number(answer: str) -> Fraction | None:
    try:
        return Fraction(answer)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, reference: Any) -> bool:
    a, b = _normalize(predicted), _normalize(str(reference))
    x, y = _as_number(a), _as_number(b)
    return x == y if x is not None and y is not None else a == b


@register_reward("math")
def math_reward(response: str, answer: Any, sample: Sample) -> float:
    """1.0 when the response's final answer equals `answer`, else 0.0."""
    predicted = extract_answer(response)
    return float(predicted is not None and answers_match(predicted, answer))
