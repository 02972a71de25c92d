"""Task worker: Redis tasks in, a group of episodes per task, trajectories out.

    treadle:runs (set) -> for each active run: XREADGROUP treadle:{run}:tasks (group `rollout`)
      -> validate (a malformed task is acked and counted as invalid, with its reason)
      -> staleness admission (shared Redis bound; a refused group waits for a newer version)
      -> group_size episodes concurrently; each waits for the task's minimum policy version
         (if the engine lacks it) after opening its env session, before generating
      -> MULTI: XADD each trajectory to treadle:{run}:trajectories + count them + XACK the
         task -> EXEC (the task is acked exactly when its trajectories are in Redis)

Tasks left pending by a dead replica are reclaimed after `reclaim_idle_ms`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from opentelemetry.trace import SpanKind

from treadle_common import admission, metrics, names, tracing
from treadle_common.clients import streams
from treadle_common.logs import get_logger
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_rollout import metrics as rollout_metrics
from treadle_rollout.episodes import EpisodeRunner
from treadle_rollout.weight_sync import WeightSync

log = get_logger(__name__)
SERVICE = "rollout"
MAX_GROUP_SIZE = 1024


def invalid_reason(task: task_pb2.Task | streams.InvalidEntry) -> str | None:
    """Why a task cannot be played, or None if it can."""
    if isinstance(task, streams.InvalidEntry):
        return task.reason
    for name in ("task_id", "run_id", "env", "scorer"):
        if not getattr(task, name):
            return f"task has no {name}"
    if not 1 <= task.group_size <= MAX_GROUP_SIZE:
        return f"group_size {task.group_size} is not in 1..{MAX_GROUP_SIZE}"
    try:
        payload = json.loads(task.payload_json or "{}")
    except json.JSONDecodeError as exc:
        return f"payload_json is not JSON: {exc}"
    if not isinstance(payload, dict):
        return "payload_json is not a JSON object"
    s = task.sampling
    if s.temperature < 0 or not 0 <= s.top_p <= 1 or s.max_new_tokens < 0:
        return "sampling parameters out of range"
    return None


class TaskWorker:
    def __init__(
        self,
        r: aioredis.Redis,
        runner: EpisodeRunner,
        sync: WeightSync,
        consumer: str,
        max_concurrent_tasks: int = 8,
        reclaim_idle_ms: int = 60_000,
    ):
        self.r = r
        self.runner = runner
        self.sync = sync
        self.consumer = consumer
        self.max_concurrent_tasks = max_concurrent_tasks
        self.slots = asyncio.Semaphore(max_concurrent_tasks)
        self.reclaim_idle_ms = reclaim_idle_ms
        self.in_flight: set[asyncio.Task] = set()
        self.stopping = False
        self.tasks_done = 0
        self.trajectories_pushed = 0
        self.invalid_tasks = 0
        self.cancelled_tasks = 0
        self.admission_waits = 0
        self._groups: set[str] = set()
        self.on_task_done: Callable[[], None] = lambda: None

    async def active_streams(self) -> list[str]:
        runs = sorted(streams.text(m) for m in await self.r.smembers(names.RUNS_KEY))
        out = []
        for run in runs:
            stream = names.tasks_stream(run)
            if stream not in self._groups:
                await streams.ensure_group(self.r, stream, names.ROLLOUT_GROUP)
                self._groups.add(stream)
            out.append(stream)
        return out

    async def run(self) -> None:
        while not self.stopping:
            stream_keys = await self.active_streams()
            if not stream_keys:
                await asyncio.sleep(0.2)
                continue
            entries = []
            for stream in stream_keys:
                entries += await streams.reclaim(
                    self.r,
                    stream,
                    names.ROLLOUT_GROUP,
                    self.consumer,
                    task_pb2.Task,
                    min_idle_ms=self.reclaim_idle_ms,
                )
            await self.slots.acquire()
            self.slots.release()
            entries += await streams.read_group(  # as many as there are free slots
                self.r,
                stream_keys,
                names.ROLLOUT_GROUP,
                self.consumer,
                task_pb2.Task,
                count=max(1, self.max_concurrent_tasks - len(self.in_flight) - len(entries)),
                block_ms=500,
            )
            for stream, entry_id, task in entries:  # task may be an InvalidEntry
                await self.slots.acquire()
                job = asyncio.create_task(self._run_task(stream, entry_id, task))
                self.in_flight.add(job)
                job.add_done_callback(self.in_flight.discard)

    async def _run_task(
        self, stream: str, entry_id: str, task: task_pb2.Task | streams.InvalidEntry
    ) -> None:
        try:
            reason = invalid_reason(task)
            if reason is not None:
                await self._reject(stream, entry_id, reason)
                return
            assert isinstance(task, task_pb2.Task)
            parent = tracing.from_proto(task.trace)
            picked_up = time.time()
            tracer = tracing.tracer()
            tracer.start_span(
                "rollout.queued", context=parent, start_time=tracing.ns(task.created_at)
            ).end(end_time=tracing.ns(picked_up))
            with tracer.start_as_current_span(
                "rollout.task", context=parent, kind=SpanKind.CONSUMER
            ) as span:
                span.set_attributes(
                    {"treadle.task_id": task.task_id, "treadle.group_size": task.group_size}
                )
                with tracer.start_as_current_span("rollout.admission"):
                    if not await self._admit(task):
                        span.set_attribute("treadle.cancelled", True)
                        await self._cancel(stream, entry_id)
                        return
                group = await self._play(task)
            async with self.r.pipeline(transaction=True) as pipe:
                for traj in group:
                    await streams.add(pipe, names.trajectories_stream(task.run_id), traj)
                pipe.hincrby(names.run_state(task.run_id), "trajectories_produced", len(group))
                pipe.xack(stream, names.ROLLOUT_GROUP, entry_id)  # with its trajectories
                await pipe.execute()
            self.tasks_done += 1
            self.trajectories_pushed += len(group)
            self.on_task_done()
        except Exception as exc:  # the task stays pending and is retried (reclaimed)
            metrics.DROPPED.labels(SERVICE, "task_attempt", type(exc).__name__).inc()
            log.error("task failed; left pending for retry", entry=entry_id, error=repr(exc))
        finally:
            self.slots.release()

    async def _play(self, task: task_pb2.Task) -> list:
        """The task's episodes. A task that demands a version the engine does not hold yet (a
        sync run's next step, fed while the trainer trains the step that publishes it) starts
        its episodes at once: they open their env sessions and render their prompts, then
        wait for that version before their first generation (`EpisodeRunner.run`'s gate)."""
        gate = None
        if self.sync.engine.version < task.min_policy_version:
            gate = asyncio.ensure_future(self._weights(task.min_policy_version))
        try:
            return await asyncio.gather(
                *(self.runner.run(task, i, gate) for i in range(task.group_size))
            )
        finally:
            if gate is not None and not gate.done():
                gate.cancel()

    async def _weights(self, version: int) -> None:
        with tracing.tracer().start_as_current_span("rollout.wait_for_weights"):
            await self.sync.ensure_version(version)

    async def _reject(self, stream: str, entry_id: str, reason: str) -> None:
        self.invalid_tasks += 1
        metrics.DROPPED.labels(SERVICE, "task", "invalid").inc()
        log.warning("invalid task acked", entry=entry_id, reason=reason)
        run = names.run_of(stream)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hincrby(names.run_state(run), "tasks_invalid", 1)
            pipe.hset(names.run_state(run), "last_invalid_task", f"{entry_id}: {reason}")
            pipe.xack(stream, names.ROLLOUT_GROUP, entry_id)
            await pipe.execute()

    async def _cancel(self, stream: str, entry_id: str) -> None:
        """The run needs no more groups (its trainer closed admission): ack, count."""
        self.cancelled_tasks += 1
        metrics.DROPPED.labels(SERVICE, "task", "run_closed").inc()
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hincrby(names.run_state(names.run_of(stream)), "tasks_cancelled", 1)
            pipe.xack(stream, names.ROLLOUT_GROUP, entry_id)
            await pipe.execute()

    async def _admit(self, task: task_pb2.Task) -> bool:
        """Wait until the run's staleness bound lets this group start; False: cancelled.

        A task's episodes generate with at least its `min_policy_version` (they wait for it),
        so that version, when the engine holds an older one, is what the bound is checked
        against: a sync run's next step is admitted before its weights arrive."""
        while True:
            version = max(self.sync.engine.version, task.min_policy_version)
            decision = await admission.admit(self.r, task.run_id, task.task_id, version)
            if decision.closed:
                return False
            if decision.admitted:
                return True
            self.admission_waits += 1
            rollout_metrics.ADMISSION_WAITS.inc()
            await self.sync.wait_for_newer(version, timeout_s=2.0)

    async def drain(self) -> None:
        """Stop taking tasks; finish the ones in flight (their trajectories land, then ack)."""
        self.stopping = True
        if self.in_flight:
            await asyncio.gather(*self.in_flight, return_exceptions=True)
