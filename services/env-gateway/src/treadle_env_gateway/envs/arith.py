"""`arith`: single-turn arithmetic. The policy reads `a op b` and answers with the result.

The problem space is every `(a, op, b)` with operands in `[min_operand, max_operand]`. A
stable hash of each problem puts `eval_fraction` of the space in a held-out part: split `eval`
draws distinct problems from it (at most as many as it holds), every other split (`train`,
`sft`, ...) draws from the rest, so no held-out problem is ever trained on or demonstrated,
whatever the seeds and sizes.

Option `question` words the problem for an instruction-tuned model, a template with the
fields `{a}`, `{op}` and `{b}` only (default `{a}{op}{b}=`, for a model trained from scratch):
for example `"What is {a}{op}{b}? Answer with the number only."`. A task carries its question.
"""

from __future__ import annotations

import hashlib
import random
import string
from typing import Any

from treadle_env_gateway.envs import register
from treadle_env_gateway.envs.base import Action, Env, EnvError, Message, StepResult, option

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
EVAL_SPLIT = "eval"
MAX_PROBLEMS = 1_000_000
"""The largest problem space `sample_tasks` enumerates (operand range squared times ops)."""
QUESTION = "{a}{op}{b}="
FIELDS = {"a", "op", "b"}


def question_template(options: dict[str, Any]) -> str:
    """The `question` option, if it is a template of `{a}`, `{op}` and `{b}` only (no
    attributes, indexes, conversions or format specs)."""
    template = options.get("question", QUESTION)
    refused = EnvError(
        "arith option 'question' must be text (at most 1000 characters) with the fields "
        "{a}, {op} and {b} only"
    )
    if not isinstance(template, str) or len(template) > 1000:
        raise refused
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise refused from exc
    for _, name, spec, conversion in parsed:
        if name is not None and (name not in FIELDS or spec or conversion):
            raise refused
    return template


def is_held_out(a: int, op: str, b: int, eval_fraction: float) -> bool:
    """Whether a problem is in the held-out part: a hash of it, not of any seed."""
    digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < eval_fraction


@register("arith")
class Arith(Env):
    @classmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        lo = option(options, "min_operand", 0, 0, MAX_PROBLEMS)
        hi = option(options, "max_operand", 9, 0, MAX_PROBLEMS)
        ops = options.get("ops", ["+"])
        if not isinstance(ops, list):
            raise EnvError(f"arith option 'ops' must be a list of {sorted(OPS)}")
        eval_fraction = option(options, "eval_fraction", 0.2, 0.0, 1.0)
        if not 0 <= lo <= hi or (hi - lo + 1) ** 2 * len(ops) > MAX_PROBLEMS:
            raise EnvError(
                f"arith needs 0 <= min_operand <= max_operand and at most {MAX_PROBLEMS} "
                f"problems; got [{lo}, {hi}] with {len(ops)} ops"
            )
        if not ops or any(op not in OPS for op in ops) or not 0 < eval_fraction < 1:
            raise EnvError(f"arith ops must be among {sorted(OPS)}, eval_fraction in (0, 1)")
        template = question_template(options)
        held_out = split == EVAL_SPLIT
        space = [
            (a, op, b)
            for a in range(lo, hi + 1)
            for op in ops
            for b in range(lo, hi + 1)
            if is_held_out(a, op, b, eval_fraction) == held_out
        ]
        rng = random.Random(f"arith-{split}-{seed}")
        if held_out:  # distinct problems: every one counts once in an evaluation
            problems = rng.sample(space, min(num_tasks, len(space)))
        else:
            problems = [rng.choice(space) for _ in range(num_tasks)] if space else []
        return [
            {
                "a": a,
                "b": b,
                "op": op,
                "answer": str(OPS[op](a, b)),
                **({} if template == QUESTION else {"question": template.format(a=a, op=op, b=b)}),
            }
            for a, op, b in problems
        ]

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        try:
            a, b, op = int(task["a"]), int(task["b"]), str(task["op"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(f"arith task needs integer 'a', 'b' and an 'op': {exc}") from exc
        if op not in OPS:
            raise EnvError(f"arith op {op!r} is not one of {sorted(OPS)}")
        self.task = task
        question = task.get("question", QUESTION.format(a=a, op=op, b=b))
        if not isinstance(question, str):
            raise EnvError("arith task 'question' must be text")
        return [Message("user", question)]

    async def step(self, action: Action) -> StepResult:
        answer = action.text.strip()
        return StepResult(
            observation=[], done=True, info={"answer": answer, "target": self.task.get("answer")}
        )
