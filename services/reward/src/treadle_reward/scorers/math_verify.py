"""`math_verify`: numeric and symbolic equivalence of the final answer and the reference.

The answer is extracted from the last `\\boxed{...}`, else from "answer is ...", else the last
number. Both sides are parsed safely (`treadle_common.tasks.safe_math`, no eval): LaTeX fractions,
percentages and thousands separators are understood; expressions with single-letter
variables are compared at several random rational points (symbolic equivalence).
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

from treadle_common.tasks.safe_math import ExpressionError, evaluate
from treadle_reward.scorers import register
from treadle_reward.scorers.base import CpuScorer, Score, ScoreInput, reference

_ANSWER_IS = re.compile(r"answer is[:\s]*\$?([^\n$]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_VARIABLE = re.compile(r"(?<![A-Za-z])([a-z])(?![A-Za-z])")


def last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    stated = _ANSWER_IS.findall(text)
    if stated:
        return stated[-1].strip().rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def to_expression(text: str) -> str:
    """LaTeX-ish math to the safe_math syntax."""
    text = text.strip().strip("$").replace("\\left", "").replace("\\right", "").replace("\\!", "")
    while _FRAC.search(text):
        text = _FRAC.sub(r"((\1)/(\2))", text)
    text = (
        text.replace("\\cdot", "*")
        .replace("\\times", "*")
        .replace("^", "**")
        .replace("{", "(")
        .replace("}", ")")
    )
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,000 -> 1000
    if text.endswith("%"):
        text = f"({text[:-1]})/100"
    return re.sub(r"(\d)\s*([a-z(])", r"\1*\2", text)  # 2x -> 2*x


def equivalent(answer: str, reference: str, trials: int = 5) -> bool:
    a, b = to_expression(answer), to_expression(reference)
    names = sorted(set(_VARIABLE.findall(a)) | set(_VARIABLE.findall(b)))
    rng = random.Random(0)
    for _ in range(trials if names else 1):
        point = {n: Fraction(rng.randint(-50, 50), rng.randint(1, 7)) for n in names}
        left = evaluate(a, point, allow_pow=True, allow_decimals=True)[0]
        right = evaluate(b, point, allow_pow=True, allow_decimals=True)[0]
        if left != right:
            return False
    return True


@register("math_verify")
class MathVerify(CpuScorer):
    """Options: `field` (task key of the reference, default `answer`)."""

    @classmethod
    def compute(cls, request: ScoreInput) -> Score:
        target = reference(request)
        answer = extract_answer(request.answer)
        try:
            hit = equivalent(answer, target)
        except (ExpressionError, ZeroDivisionError):
            hit = answer.strip() == target.strip()  # not math: compare as text
        return Score(reward=float(hit), breakdown={"math_verify": float(hit)})
