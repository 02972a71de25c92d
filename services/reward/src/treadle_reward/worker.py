"""Scoring over NATS: one subscription on `treadle.reward.*` in queue group `reward`.

Every replica joins the same queue group, so NATS spreads requests across replicas with no
coordinator: adding a replica adds capacity. Requests for a scorer this replica does not know
are answered with an error naming the known scorers; a scorer that raises or times out is
answered with status ERROR/TIMEOUT and the message.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict

from google.protobuf.message import DecodeError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind
from prometheus_client import Gauge

from treadle_common import names
from treadle_common.proto.treadle.v1 import reward_pb2 as pb
from treadle_common.runtime import metrics, tracing
from treadle_common.runtime.logs import get_logger
from treadle_common.runtime.progress import Stage
from treadle_reward.scorers.base import CpuScorer, ScoreInput, Scorer

log = get_logger(__name__)
SERVICE = "reward"
IN_FLIGHT = Gauge("treadle_reward_in_flight", "Scoring requests being processed", ["scorer"])
PENDING = Gauge(
    "treadle_reward_pending", "Scoring requests waiting for a concurrency slot", ["scorer"]
)
QUEUED = Gauge(
    "treadle_reward_queued",
    "Scoring requests delivered to this replica and waiting for one of its in-flight slots "
    "(TREADLE_REWARD_MAX_IN_FLIGHT): with `treadle_reward_pending`, the backlog the "
    "autoscaler adds replicas for",
)


def _json(text: str, what: str, default):
    if not text:
        return default
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from exc


class ScoringService:
    """Scores requests: per-scorer concurrency limits and timeouts, cached deterministic
    scorers; every failure is a status with a message."""

    def __init__(
        self,
        scorers: dict[str, Scorer],
        timeout_s: float = 30.0,
        max_concurrency: int = 64,
        cache_size: int = 10_000,
        stage: Stage | None = None,
        max_in_flight: int = 256,
    ):
        self.scorers = scorers
        self._admit = asyncio.Semaphore(max_in_flight)
        self._tasks: set[asyncio.Task[None]] = set()
        self.stage = stage or Stage(SERVICE, "score")
        self.timeout_s = timeout_s
        self.slots = {name: asyncio.Semaphore(max_concurrency) for name in scorers}
        self.cache: OrderedDict[bytes, pb.ScoreResult] = OrderedDict()
        self.cache_size = cache_size
        self.subscribed = False

    def _cache_key(self, request: pb.ScoreRequest) -> bytes:
        fields = (
            request.scorer,
            request.task_json,
            request.answer,
            request.info_json,
            request.options_json,
        )
        return hashlib.blake2b("\x00".join(fields).encode(), digest_size=16).digest()

    async def score(self, request: pb.ScoreRequest) -> pb.ScoreResult:
        scorer = self.scorers.get(request.scorer)
        cacheable = scorer is not None and scorer.deterministic and self.cache_size > 0
        key = self._cache_key(request) if cacheable else b""
        if cacheable and key in self.cache:
            self.cache.move_to_end(key)
            metrics.REQUESTS.labels(SERVICE, request.scorer, "cached").inc()
            return pb.ScoreResult(
                request_id=request.request_id,
                reward=self.cache[key].reward,
                breakdown=self.cache[key].breakdown,
                status=pb.SCORE_STATUS_OK,
            )
        result = await self._score(request)
        if cacheable and result.status == pb.SCORE_STATUS_OK:
            self.cache[key] = result
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return result

    async def score_batch(self, batch: pb.ScoreBatchRequest) -> pb.ScoreBatchResult:
        """Every request at once, each in its own `reward.score` span of its own trace."""

        async def one(request: pb.ScoreRequest) -> pb.ScoreResult:
            with tracing.item_span("reward.score", request.trace) as span:
                span.set_attribute("treadle.scorer", request.scorer)
                return await self.score(request)

        return pb.ScoreBatchResult(results=await asyncio.gather(*map(one, batch.requests)))

    async def _score(self, request: pb.ScoreRequest) -> pb.ScoreResult:
        result = pb.ScoreResult(request_id=request.request_id)
        scorer = self.scorers.get(request.scorer)
        if scorer is None:
            result.status = pb.SCORE_STATUS_ERROR
            result.message = f"unknown scorer {request.scorer!r}; known: {sorted(self.scorers)}"
            metrics.REQUESTS.labels(SERVICE, request.scorer, "unknown_scorer").inc()
            return result
        PENDING.labels(request.scorer).inc()
        with self.stage.track():
            async with self.slots[request.scorer]:
                PENDING.labels(request.scorer).dec()
                return await self._run(scorer, request, result)

    async def _run(
        self, scorer: Scorer, request: pb.ScoreRequest, result: pb.ScoreResult
    ) -> pb.ScoreResult:
        start = time.perf_counter()
        IN_FLIGHT.labels(request.scorer).inc()
        try:
            score_input = ScoreInput(
                task=_json(request.task_json, "task_json", {}),
                answer=request.answer,
                transcript=_json(request.transcript_json, "transcript_json", []),
                info=_json(request.info_json, "info_json", {}),
                options=_json(request.options_json, "options_json", {}),
            )
            # a pooled scorer's pool keeps the deadline itself, and kills a worker past it
            pooled = isinstance(scorer, CpuScorer) and scorer.pool is not None
            async with asyncio.timeout(None if pooled else self.timeout_s):
                score = await scorer.score(score_input)
            result.reward, result.status = score.reward, pb.SCORE_STATUS_OK
            result.breakdown.update(score.breakdown)
            outcome = "ok"
        except TimeoutError as exc:
            result.status, outcome = pb.SCORE_STATUS_TIMEOUT, "timeout"
            result.message = (
                str(exc) or f"scorer {request.scorer} took longer than {self.timeout_s}s"
            )
        except Exception as exc:  # a scorer's failure is reported, never a silent 0
            result.status, outcome = pb.SCORE_STATUS_ERROR, "error"
            result.message = f"{type(exc).__name__}: {exc}"
        finally:
            IN_FLIGHT.labels(request.scorer).dec()
        metrics.REQUESTS.labels(SERVICE, request.scorer, outcome).inc()
        metrics.LATENCY.labels(SERVICE, request.scorer).observe(time.perf_counter() - start)
        return result

    async def handle_batch(self, msg: Msg) -> None:
        try:
            batch = pb.ScoreBatchRequest.FromString(msg.data)
        except DecodeError as exc:
            metrics.DROPPED.labels(SERVICE, "request", "malformed").inc()
            await msg.respond(
                pb.ScoreBatchResult(
                    results=[
                        pb.ScoreResult(
                            status=pb.SCORE_STATUS_ERROR,
                            message=f"malformed ScoreBatchRequest: {exc}",
                        )
                    ]
                ).SerializeToString()
            )
            return
        await msg.respond((await self.score_batch(batch)).SerializeToString())

    async def handle(self, msg: Msg) -> None:
        if msg.subject == names.REWARD_BATCH_SUBJECT:
            await self.handle_batch(msg)
            return
        request = pb.ScoreRequest()
        try:
            request.ParseFromString(msg.data)
        except DecodeError as exc:
            metrics.DROPPED.labels(SERVICE, "request", "malformed").inc()
            reply = pb.ScoreResult(
                status=pb.SCORE_STATUS_ERROR, message=f"malformed ScoreRequest: {exc}"
            )
            await msg.respond(reply.SerializeToString())
            return
        subject_scorer = msg.subject.removeprefix("treadle.reward.")
        if not request.scorer:
            request.scorer = subject_scorer
        with tracing.tracer().start_as_current_span(
            "reward.score", context=tracing.from_headers(msg.headers), kind=SpanKind.SERVER
        ) as span:
            span.set_attribute("treadle.scorer", request.scorer)
            result = await self.score(request)
            span.set_attribute("treadle.reward", result.reward)
            span.set_attribute("treadle.status", pb.ScoreStatus.Name(result.status))
        await msg.respond(result.SerializeToString())

    async def dispatch(self, msg: Msg) -> None:
        """Each request in a task of its own: nats-py runs a subscription's callbacks one at a
        time, so one slow scorer held up every request behind it on the replica (and they
        timed out). Past `max_in_flight` requests the subscription waits, and messages queue
        in the client."""
        with QUEUED.track_inprogress():
            await self._admit.acquire()
        task = asyncio.create_task(self._handle_admitted(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_admitted(self, msg: Msg) -> None:
        try:
            await self.handle(msg)
        except Exception:  # e.g. the reply could not be sent: the requester times out
            log.exception("reward request failed", subject=msg.subject)
        finally:
            self._admit.release()

    async def subscribe(self, nc: NATS, ping_subject: str | None = None) -> None:
        """Serve the scorers' subjects (queue group), each request in a task of its own;
        answer `ping_subject` (this replica's own, for its readiness check: the server routes
        requests to it)."""
        await nc.subscribe(names.REWARD_WILDCARD, queue=names.REWARD_QUEUE, cb=self.dispatch)
        if ping_subject is not None:

            async def pong(msg: Msg) -> None:
                await msg.respond(b"pong")

            await nc.subscribe(ping_subject, cb=pong)
        self.subscribed = True
        log.info("scoring", subject=names.REWARD_WILDCARD, scorers=sorted(self.scorers))
