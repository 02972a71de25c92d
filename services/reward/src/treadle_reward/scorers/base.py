"""The scorer interface (the registry is the package's: `treadle_reward.scorers`).

A scorer turns a `ScoreInput` (task, final answer, transcript, env info, options) into a
`Score`. Scorers are stateless, so any replica can serve any request. Third-party packages
add scorers through the `treadle.scorers` entry-point group.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treadle_reward.settings import RewardSettings

if TYPE_CHECKING:
    from treadle_reward.pool import ScorerPool


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

    @classmethod
    def from_settings(cls, settings: RewardSettings) -> Scorer:
        """The scorer, configured from the reward service's settings (most need none)."""
        return cls()

    async def score_batch(self, requests: list[ScoreInput]) -> list[Score]:
        return [await self.score(r) for r in requests]


class CpuScorer(Scorer):
    """A scorer that only computes (parsing, arithmetic, regular expressions): `compute` is a
    pure function of the request, run in a worker process that a timeout kills
    (`treadle_reward.pool`) once the service gives the scorer its `pool`."""

    deterministic = True
    pool: ScorerPool | None = None

    @classmethod
    @abc.abstractmethod
    def compute(cls, request: ScoreInput) -> Score:
        """Score one request, synchronously; raise to report an error."""

    async def score(self, request: ScoreInput) -> Score:
        if self.pool is None:
            return self.compute(request)
        return await self.pool.compute(self, request)
