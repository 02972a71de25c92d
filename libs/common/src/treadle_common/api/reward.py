"""The reward service's HTTP API (rollout scores over NATS, `reward.proto`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

MAX_BATCH = 1024
"""Requests in one `POST /v1/score:batch`."""
MAX_ANSWER_CHARS = 1_000_000


class ScoreBody(BaseModel):
    """`POST /v1/score` (and each item of `POST /v1/score:batch`)."""

    scorer: str = Field(description="Scorer name")
    task: dict[str, Any] = Field(default_factory=dict, description="Task, with its reference")
    answer: str = Field(
        "", max_length=MAX_ANSWER_CHARS, description="The trajectory's final answer"
    )
    info: dict[str, Any] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)


class ScoreOut(BaseModel):
    """One result, as `reward.proto`'s `ScoreResult` (status by its enum name)."""

    request_id: str = ""
    reward: float
    breakdown: dict[str, float] = Field(default_factory=dict)
    status: str = Field(description="SCORE_STATUS_OK, or why not (see `message`)")
    message: str = ""

    @classmethod
    def from_proto(cls, result: Any) -> ScoreOut:
        """From `reward_pb2.ScoreResult`."""
        from treadle_common.proto.treadle.v1 import reward_pb2

        return cls(
            request_id=result.request_id,
            reward=result.reward,
            breakdown=dict(result.breakdown),
            status=reward_pb2.ScoreStatus.Name(result.status),
            message=result.message,
        )


class ScoreBatchOut(BaseModel):
    results: list[ScoreOut]
