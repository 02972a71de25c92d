"""`vf-tiny-arith`: two-digit addition as a `verifiers` environment, written against the
verifiers 0.1.14 API the way environment packages on PyPI and the Environments Hub are:
`load_environment()` returns a `vf.SingleTurnEnv` with a dataset and a rubric.

The prompt is `a+b=` as the user message (the tiny models Treadle's tests build read it); the
rubric gives 1 for the exact sum and a partial credit for each digit in its place, weighted
like the demo's scorer. A `tool` variant (`load_environment(tools=True)`) is a `vf.ToolEnv`
whose model may call `add(a, b)` before answering.
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset


def _problems(n: int, seed: int, low: int, high: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def exact(completion, answer, **_) -> float:
    return 1.0 if _final(completion) == answer else 0.0


def digits(completion, answer, **_) -> float:
    text = _final(completion)
    hits = sum(1 for i, ch in enumerate(answer) if i < len(text) and text[i] == ch)
    return hits / max(len(answer), len(text), 1)


def _final(completion) -> str:
    if isinstance(completion, str):
        return completion.strip()
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return str(message.get("content") or "").strip()
    return ""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def load_environment(
    num_train: int = 2000,
    num_eval: int = 100,
    low: int = 10,
    high: int = 99,
    tools: bool = False,
    max_turns: int = 3,
) -> vf.Environment:
    train = Dataset.from_list(_problems(num_train, 0, low, high))
    held_out = Dataset.from_list(_problems(num_eval, 1, low, high))
    rubric = vf.Rubric(funcs=[exact, digits], weights=[0.5, 0.5])
    if tools:
        return vf.ToolEnv(
            dataset=train, eval_dataset=held_out, tools=[add], rubric=rubric, max_turns=max_turns
        )
    return vf.SingleTurnEnv(dataset=train, eval_dataset=held_out, rubric=rubric)
