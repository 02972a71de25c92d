"""The reward service's HTTP API (people and tools; rollout scores over NATS, `worker.py`).

POST /v1/score        one request -> its result
POST /v1/score:batch  several -> their results, in order
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import Body, FastAPI, HTTPException

from treadle_common import auth
from treadle_common.api.reward import MAX_BATCH, ScoreBatchOut, ScoreBody, ScoreOut
from treadle_common.proto.treadle.v1 import reward_pb2 as pb
from treadle_reward.worker import ScoringService


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

    @app.post("/v1/score", tags=["score"], openapi_extra=auth.roles(auth.WORKERS))
    async def score(body: ScoreBody) -> ScoreOut:
        return ScoreOut.from_proto(await scoring.score(to_request(body)))

    @app.post("/v1/score:batch", tags=["score"], openapi_extra=auth.roles(auth.WORKERS))
    async def score_batch(
        bodies: Annotated[list[ScoreBody], Body(max_length=MAX_BATCH)],
    ) -> ScoreBatchOut:
        batch = pb.ScoreBatchRequest(requests=[to_request(b) for b in bodies])
        results = (await scoring.score_batch(batch)).results
        return ScoreBatchOut(results=[ScoreOut.from_proto(r) for r in results])
