"""Reward client: NATS request-reply to `treadle.reward.{scorer}` (queue group `reward`).

Failures come back as a `ScoreResult` with status TIMEOUT/ERROR and a message, never as a
silent reward of 0. While no replica answers (restarting), a request is retried with backoff
within its timeout. A timeout (no reply in `timeout_s`, or the scorer timed out on the
replica) is asked again, up to `attempts` in all (counted in
`treadle_reward_retries_total`): a busy or stalled replica costs the episode time, not its
trajectory. With `batch=True`, the `score` calls made in the same event-loop turn go as one
`treadle.reward._batch` message (see `coalesce.py`).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Hashable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client import Counter

from treadle_common import names
from treadle_common.clients.coalesce import Coalescer, Pending
from treadle_common.proto.treadle.v1 import reward_pb2 as pb
from treadle_common.runtime import tracing

RETRIES = Counter("treadle_reward_retries_total", "Reward requests asked again after a timeout")


class RewardClient:
    def __init__(self, nc: NATS, timeout_s: float = 30.0, batch: bool = False, attempts: int = 3):
        self.nc = nc
        self.timeout_s = timeout_s
        self.batch = batch
        self.attempts = max(1, attempts)
        self._batches: Coalescer[pb.ScoreRequest, pb.ScoreResult] = Coalescer(self._send)

    async def _send(self, _key: Hashable, items: Pending) -> None:
        results = await self.score_batch([request for request, _ in items])
        for (_, future), result in zip(items, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def _request(self, subject: str, data: bytes) -> Msg:
        """Request-reply within `timeout_s`; while no replica listens (all restarting, or
        resubscribing after a NATS restart) it asks again with backoff until the time is up."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.1
        while True:
            left = deadline - time.monotonic()
            try:
                return await self.nc.request(
                    subject, data, timeout=max(left, 0.01), headers=tracing.nats_headers()
                )
            except NoRespondersError:
                if left < delay:
                    raise
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, 2.0)

    async def score(self, request: pb.ScoreRequest) -> pb.ScoreResult:
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        delay = 0.2
        for attempt in range(1, self.attempts + 1):
            result = await self._score_once(request)
            if result.status != pb.SCORE_STATUS_TIMEOUT or attempt == self.attempts:
                return result
            RETRIES.inc()
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")

    async def _score_once(self, request: pb.ScoreRequest) -> pb.ScoreResult:
        if self.batch:  # each request of the batch keeps its episode's trace
            tracing.inject_proto(request.trace)
            return await self._batches.submit(None, request)
        subject = names.reward_subject(request.scorer)
        try:
            reply = await self._request(subject, request.SerializeToString())
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
            reply = await self._request(names.REWARD_BATCH_SUBJECT, batch.SerializeToString())
        except NoRespondersError:
            return [
                _failed(r, pb.SCORE_STATUS_ERROR, "no reward replica serves batches")
                for r in requests
            ]
        except NatsTimeout:
            message = f"no reply to the batch in {self.timeout_s}s"
            return [_failed(r, pb.SCORE_STATUS_TIMEOUT, message) for r in requests]
        return list(pb.ScoreBatchResult.FromString(reply.data).results)


def _failed(request: pb.ScoreRequest, status: pb.ScoreStatus, message: str) -> pb.ScoreResult:
    return pb.ScoreResult(request_id=request.request_id, status=status, message=message)
