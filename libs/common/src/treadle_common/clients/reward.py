"""Reward client: NATS request-reply to `treadle.reward.{scorer}` (queue group `reward`).

Failures come back as a `ScoreResult` with status TIMEOUT/ERROR and a message, never as a
silent reward of 0.
"""

from __future__ import annotations

import uuid

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from treadle_common import names, tracing
from treadle_common.proto.treadle.v1 import reward_pb2 as pb


class RewardClient:
    def __init__(self, nc: NATS, timeout_s: float = 30.0):
        self.nc = nc
        self.timeout_s = timeout_s

    async def score(self, request: pb.ScoreRequest) -> pb.ScoreResult:
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        subject = names.reward_subject(request.scorer)
        try:
            reply = await self.nc.request(
                subject,
                request.SerializeToString(),
                timeout=self.timeout_s,
                headers=tracing.nats_headers(),
            )
        except NoRespondersError:
            return _failed(request, pb.SCORE_STATUS_ERROR, f"no reward replica serves {subject}")
        except NatsTimeout:
            return _failed(
                request, pb.SCORE_STATUS_TIMEOUT, f"no reply on {subject} in {self.timeout_s}s"
            )
        result = pb.ScoreResult()
        result.ParseFromString(reply.data)
        return result

    async def score_batch(self, requests: list[pb.ScoreRequest]) -> list[pb.ScoreResult]:
        """Many requests in one message (`treadle.reward._batch`); results in request order."""
        batch = pb.ScoreBatchRequest(requests=requests)
        try:
            reply = await self.nc.request(
                names.REWARD_BATCH_SUBJECT, batch.SerializeToString(), timeout=self.timeout_s
            )
        except (NoRespondersError, NatsTimeout) as exc:
            return [
                _failed(r, pb.SCORE_STATUS_ERROR, f"batch scoring failed: {type(exc).__name__}")
                for r in requests
            ]
        return list(pb.ScoreBatchResult.FromString(reply.data).results)


def _failed(request: pb.ScoreRequest, status: pb.ScoreStatus, message: str) -> pb.ScoreResult:
    return pb.ScoreResult(request_id=request.request_id, status=status, message=message)
