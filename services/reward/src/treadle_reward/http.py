"""The reward service's HTTP API (people and tools; rollout scores over NATS, `worker.py`).

POST /v1/score        one request -> its result
POST /v1/score:batch  several -> their results, in order
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Request

from treadle_common.api.reward import MAX_BATCH, ScoreBatchOut, ScoreBody, ScoreOut
from treadle_common.auth import policy as auth
from treadle_common.proto.treadle.v1 import reward_pb2 as pb
from treadle_reward.errors import UnknownScorer
from treadle_reward.worker import ScoringService

router = APIRouter(prefix="/v1", tags=["score"])
WORKERS = auth.roles(auth.WORKERS)


def scoring_service(request: Request) -> ScoringService:
    return request.app.state.scoring


Scoring = Annotated[ScoringService, Depends(scoring_service)]


def to_request(scoring: ScoringService, body: ScoreBody) -> pb.ScoreRequest:
    if body.scorer not in scoring.scorers:
        raise UnknownScorer(f"unknown scorer {body.scorer!r}; known: {sorted(scoring.scorers)}")
    return pb.ScoreRequest(
        scorer=body.scorer,
        task_json=json.dumps(body.task),
        answer=body.answer,
        info_json=json.dumps(body.info),
        options_json=json.dumps(body.options),
    )


@router.post("/score", openapi_extra=WORKERS)
async def score(body: ScoreBody, scoring: Scoring) -> ScoreOut:
    return ScoreOut.from_proto(await scoring.score(to_request(scoring, body)))


@router.post("/score:batch", openapi_extra=WORKERS)
async def score_batch(
    bodies: Annotated[list[ScoreBody], Body(max_length=MAX_BATCH)], scoring: Scoring
) -> ScoreBatchOut:
    batch = pb.ScoreBatchRequest(requests=[to_request(scoring, b) for b in bodies])
    results = (await scoring.score_batch(batch)).results
    return ScoreBatchOut(results=[ScoreOut.from_proto(r) for r in results])
