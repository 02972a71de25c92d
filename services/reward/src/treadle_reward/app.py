"""Reward service: scorers behind NATS request-reply (queue group) and HTTP.

rollout --NATS request treadle.reward.{scorer}--> ScoringService.handle --> Scorer.score
people  --POST /v1/score--------------------------> ScoringService.score
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, Field

from treadle_common.proto.treadle.v1 import reward_pb2 as pb
from treadle_common.service import ServiceRuntime
from treadle_reward.scorers import registry
from treadle_reward.settings import RewardSettings
from treadle_reward.worker import SERVICE, ScoringService


class ScoreBody(BaseModel):
    scorer: str = Field(description="Scorer name")
    task: dict[str, Any] = Field(default_factory=dict, description="Task, with its reference")
    answer: str = Field("", description="The trajectory's final answer")
    info: dict[str, Any] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)


def build(settings: RewardSettings) -> tuple[ServiceRuntime, ScoringService]:
    runtime = ServiceRuntime(SERVICE, settings)
    modules = tuple(m.strip() for m in settings.scorer_modules.split(",") if m.strip())
    scoring = ScoringService(
        registry(settings, modules),
        timeout_s=settings.reward_timeout_s,
        max_concurrency=settings.reward_max_concurrency,
        cache_size=settings.reward_cache_size,
        stage=runtime.progress.stage("score"),
    )
    runtime.set_info(lambda: {"scorers": sorted(scoring.scorers)})

    def to_request(body: ScoreBody) -> pb.ScoreRequest:
        if body.scorer not in scoring.scorers:
            raise HTTPException(
                404, f"unknown scorer {body.scorer!r}; known: {sorted(scoring.scorers)}"
            )
        return pb.ScoreRequest(
            scorer=body.scorer,
            task_json=json.dumps(body.task),
            answer=body.answer,
            info_json=json.dumps(body.info),
            options_json=json.dumps(body.options),
        )

    def as_dict(result: pb.ScoreResult) -> dict:
        return MessageToDict(
            result, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )

    @runtime.app.post("/v1/score", tags=["score"])
    async def score(body: ScoreBody) -> dict:
        return as_dict(await scoring.score(to_request(body)))

    @runtime.app.post("/v1/score:batch", tags=["score"])
    async def score_batch(bodies: list[ScoreBody]) -> dict:
        batch = pb.ScoreBatchRequest(requests=[to_request(b) for b in bodies])
        return {"results": [as_dict(r) for r in (await scoring.score_batch(batch)).results]}

    return runtime, scoring


async def main(settings: RewardSettings) -> None:
    runtime, scoring = build(settings)

    async def subscribe() -> None:
        await scoring.subscribe(await runtime.wait_nats())

    await runtime.serve(subscribe())
