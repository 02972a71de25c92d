"""The reward service's HTTP API (people and tools; rollout scores over NATS, `worker.py`).

POST /v1/score        one request -> its result
POST /v1/score:batch  several -> their results, in order
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, HTTPException
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, Field

from treadle_common.proto.treadle.v1 import reward_pb2 as pb
from treadle_reward.worker import ScoringService


class ScoreBody(BaseModel):
    scorer: str = Field(description="Scorer name")
    task: dict[str, Any] = Field(default_factory=dict, description="Task, with its reference")
    answer: str = Field("", description="The trajectory's final answer")
    info: dict[str, Any] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)


def mount(app: FastAPI, scoring: ScoringService) -> None:
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

    @app.post("/v1/score", tags=["score"])
    async def score(body: ScoreBody) -> dict:
        return as_dict(await scoring.score(to_request(body)))

    @app.post("/v1/score:batch", tags=["score"])
    async def score_batch(bodies: list[ScoreBody]) -> dict:
        batch = pb.ScoreBatchRequest(requests=[to_request(b) for b in bodies])
        return {"results": [as_dict(r) for r in (await scoring.score_batch(batch)).results]}
