"""The scorer interface and its registry.

A scorer turns a `ScoreInput` (task, final answer, transcript, env info, options) into a
`Score`. Scorers are stateless, so any replica can serve any request. Third-party packages
add scorers through the `treadle.scorers` entry point group.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any


@dataclass
class ScoreInput:
    task: dict[str, Any]
    answer: str
    transcript: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Score:
    reward: float
    breakdown: dict[str, float] = field(default_factory=dict)


def reference(request: ScoreInput) -> str:
    """The task's reference answer: its field `options.field` (default `answer`)."""
    key = request.options.get("field", "answer")
    if key not in request.task:
        raise ValueError(f"task has no reference field {key!r}")
    return str(request.task[key])


class Scorer(abc.ABC):
    name: str
    deterministic: bool = False
    """Same input, same score: results may be cached."""

    @abc.abstractmethod
    async def score(self, request: ScoreInput) -> Score:
        """Score one request. Raise to report an error; never return 0 for a failure."""

    async def score_batch(self, requests: list[ScoreInput]) -> list[Score]:
        return [await self.score(r) for r in requests]


_BUILTIN: dict[str, type[Scorer]] = {}


def register(name: str):
    def wrap(cls: type[Scorer]) -> type[Scorer]:
        cls.name = name
        _BUILTIN[name] = cls
        return cls

    return wrap


def registry(extra_modules: tuple[str, ...] = ()) -> dict[str, Scorer]:
    """Instances of the built-in scorers, those of installed packages (entry point group
    `treadle.scorers`) and those `extra_modules` register with `@register` when imported."""
    import importlib

    for module in extra_modules:
        importlib.import_module(module)
    from treadle_reward.scorers import (  # noqa: F401  (importing registers the built-ins)
        code_tests,
        composite,
        digit_match,
        exact_match,
        format_regex,
        llm_judge,
        math_verify,
        reward_model,
    )

    classes = dict(_BUILTIN)
    for ep in entry_points(group="treadle.scorers"):
        classes.setdefault(ep.name, ep.load())
    scorers = {name: cls() for name, cls in classes.items()}
    scorers["composite"].registry = scorers  # type: ignore[attr-defined]
    return scorers
