"""Task worker: Redis tasks in, a group of episodes per task, trajectories out.

    treadle:runs (set) -> for each active run: XREADGROUP treadle:{run}:tasks (group `rollout`)
      -> one task read per run and held ready; when a slot frees, the scheduling policy
       (`treadle_common.fleet.scheduling`: priority, then weighted fair share of slot-seconds)
       picks whose starts
    -> validate (a malformed task is acked and counted as invalid, with its reason)
      -> staleness admission (shared Redis bound; a refused group waits for a newer version)
      -> group_size episodes concurrently; each waits for the task's minimum policy version
         (if the engine lacks it) after opening its env session, before generating;
         failed episodes played again (`failures.py`); a group with one that still fails is
         quarantined whole (`dead_letters.py`), a task of an env whose breaker is open for
         the run dead-lettered unplayed (`fleet.breaker`)
      -> one Lua script, only while this replica still owns the task: XADD each trajectory
         to treadle:{run}:trajectories + count them + XACK the task (the task is acked
         exactly when its trajectories are in Redis, and by its owner only)

Exactly once: while a task is in progress its replica heartbeats it (`streams.heartbeat`,
every `reclaim_idle_ms` / 4), so a task that legitimately waits (admission, a version not
published yet) is never reclaimed. A replica that dies or stalls stops heartbeating: after
`reclaim_idle_ms` another replica reclaims the task, and the stalled one, should it wake,
can neither heartbeat nor commit it (it drops its work, counted `not_owner`). A task whose
handling raises stays pending (its last error in treadle:{run}:task_errors) and is retried
once reclaimed; delivered more than `max_deliveries` times, or invalid, it goes to the
dead-letter stream treadle:{run}:dead with its reason and last error, acked and counted in
the run's state (`tasks_dead`, `dead:{reason}`); the trainer feeds a task in its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from opentelemetry.trace import SpanKind

from treadle_common import names
from treadle_common.clients import streams
from treadle_common.fleet import breaker, scheduling
from treadle_common.fleet import runs as fleet
from treadle_common.fleet.quotas import TenantQuotas
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_common.runtime import metrics, tracing
from treadle_common.runtime.logs import get_logger
from treadle_rollout import usage
from treadle_rollout.dead_letters import give_up
from treadle_rollout.episodes import EpisodeRunner
from treadle_rollout.failures import GroupOutcome, status_name
from treadle_rollout.fair_share import FairShare
from treadle_rollout.groups import Groups
from treadle_rollout.policies import RunPolicies
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
        max_deliveries: int = 3,
        policies: RunPolicies | None = None,
        policy: scheduling.Policy | None = None,
        model: str | None = None,
        quotas: TenantQuotas | None = None,
    ):
        self.r = r
        self.quotas = quotas
        self.share = FairShare(policy, quotas)
        """Whose ready task starts when a slot frees, and what each run's tasks hold."""
        self.model = model
        """The base model this replica serves (None: it takes every run's tasks)."""
        self.runner = runner
        self.groups = Groups(r, runner, sync, policies)
        """Admits and plays each task's group of episodes."""
        self.consumer = consumer
        self.max_concurrent_tasks = max_concurrent_tasks
        self.slots = asyncio.Semaphore(max_concurrent_tasks)
        self.reclaim_idle_ms = reclaim_idle_ms
        self.max_deliveries = max_deliveries
        self.in_flight: set[asyncio.Task] = set()
        self.stopping = False
        self.tasks_done = 0
        self.trajectories_pushed = 0
        self.invalid_tasks = 0
        self.cancelled_tasks = 0
        self.dead_lettered = 0
        self.lost_tasks = 0  # reclaimed by another replica while this one worked on them
        self._grouped: set[str] = set()
        self._resumed: set[str] = set()  # streams whose own pending entries were taken back
        self.on_task_done: Callable[[], None] = lambda: None

    async def active_streams(self) -> list[str]:
        """The task streams of the active runs this replica can serve: those whose policy's
        base model is its engine's (`fleet.RunPolicy`; a run that registered none: all).
        Each one's scheduling claim (weight, priority, tenant) is kept for `_dispatch`."""
        runs = sorted(streams.text(m) for m in await self.r.smembers(names.RUNS_KEY))
        policies = await fleet.active(self.r)
        model = self.model
        runs = [r for r in runs if model is None or r not in policies or policies[r].base == model]
        out = []
        for run in runs:
            stream = names.tasks_stream(run)
            if stream not in self._grouped:
                await streams.ensure_group(self.r, stream, names.ROLLOUT_GROUP)
                self._grouped.add(stream)
            p = policies.get(run)
            self.share.claims[stream] = (
                scheduling.Claim(run, p.weight, p.priority, p.tenant)
                if p is not None
                else scheduling.Claim(run)
            )
            out.append(stream)
        return out

    async def run(self) -> None:
        """Take tasks until drained. A Redis error (down, restarting, loading) never ends
        the loop: it backs off (jittered, up to 10 s) and goes on."""
        backoff = 0.5
        while not self.stopping:
            try:
                await self._take()
                backoff = 0.5
            except Exception as exc:
                log.warning("taking tasks failed; retrying", error=repr(exc), in_s=backoff)
                self._grouped.clear()  # a Redis that lost its data lost the groups too
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, 10.0)

    async def _take(self) -> None:
        """One round: reclaim abandoned tasks and start them; read a task of each active run
        that has none ready; once a slot is free, start the ready task of the run the
        scheduling policy picks (`_dispatch`)."""
        stream_keys = await self.active_streams()
        if not stream_keys and not any(self.share.ready.values()):
            await asyncio.sleep(0.2)
            return
        owed = []
        for stream in stream_keys:
            if stream not in self._resumed:  # once per stream and process: our past life's
                owed += await self._resume_own(stream)
                self._resumed.add(stream)
            owed += await self._reclaim(stream)
        for stream, entry_id, task in owed:  # already ours: no turn to wait for
            await self._start(stream, entry_id, task)
        await self.slots.acquire()
        self.slots.release()
        await self._keep_ready_claims()
        empty = [s for s in stream_keys if not self.share.ready.get(s)]
        got = await streams.read_group(  # one per run: the policy chooses among them
            self.r,
            empty,
            names.ROLLOUT_GROUP,
            self.consumer,
            task_pb2.Task,
            count=1,
            block_ms=None if any(self.share.ready.values()) else 500,
        )
        now = time.monotonic()
        for stream, entry_id, task in got:
            self.share.ready.setdefault(stream, []).append((entry_id, task, now))
        if not await self._dispatch(set(stream_keys)) and any(self.share.ready.values()):
            await asyncio.sleep(0.05)  # only lower priorities ready: wait, do not spin

    async def _dispatch(self, active: set[str]) -> int:
        """Start ready tasks while slots are free: the scheduling policy picks whose (a run
        that ended: at once, its tasks are cancelled), among the runs of the highest
        priority that has work (`_eligible`); how many started."""
        started = 0
        while not self.slots.locked():
            gone, eligible = self.share.contenders(active)
            eligible = gone or eligible
            if not eligible:
                break
            if not gone:
                eligible = await self.share.within_quota(eligible)
                if not eligible:
                    break
            if gone:
                stream = gone[0]
            else:
                stream = self.share.pick(eligible)
            entry_id, task, _ = self.share.ready[stream][0]
            lease = await self.share.lease(stream, entry_id, task) if not gone else []
            if lease is None:  # its tenant's last episodes went to another replica
                break
            self.share.ready[stream].pop(0)
            charge = None
            if isinstance(task, task_pb2.Task):
                charge = self.share.charge(self.share.claims[stream])
            await self._start(stream, entry_id, task, charge, lease)
            started += 1
        return started

    async def _keep_ready_claims(self) -> None:
        """Ready tasks waiting their turn are ours: heartbeat them like running ones (one
        reclaimed meanwhile by another replica is dropped here: that replica plays it)."""
        now, every = time.monotonic(), self.reclaim_idle_ms / 4000
        for stream, queue in self.share.ready.items():
            for item in list(queue):
                entry_id, task, since = item
                if now - since < every:
                    continue
                owned = await streams.heartbeat(
                    self.r, stream, names.ROLLOUT_GROUP, self.consumer, entry_id
                )
                queue.remove(item)
                if owned:
                    queue.append((entry_id, task, now))

    async def _start(
        self,
        stream: str,
        entry_id: str,
        task,
        settle: Callable[[], None] | None = None,
        lease: list[str] | None = None,
    ) -> None:
        await self.slots.acquire()
        job = asyncio.create_task(self._run_task(stream, entry_id, task, lease or []))
        self.in_flight.add(job)
        job.add_done_callback(self.in_flight.discard)
        if settle is not None:
            job.add_done_callback(lambda _: settle())

    async def _resume_own(self, stream: str) -> list:
        """Tasks still pending for this consumer name when the process starts were left by
        its previous life (a replica restarted under the same `TREADLE_INSTANCE`): taken
        back at once instead of after `reclaim_idle_ms`."""
        pending = await streams.pending_own(
            self.r, stream, names.ROLLOUT_GROUP, self.consumer, task_pb2.Task
        )
        out = await self._within_deliveries(stream, pending)
        if out:
            log.info("resuming this replica's unfinished tasks", stream=stream, tasks=len(out))
        return out

    async def _reclaim(self, stream: str) -> list:
        """Tasks whose replica stopped heartbeating them; those delivered more than
        `max_deliveries` times go to the dead letters instead."""
        claimed = await streams.reclaim(
            self.r,
            stream,
            names.ROLLOUT_GROUP,
            self.consumer,
            task_pb2.Task,
            min_idle_ms=self.reclaim_idle_ms,
        )
        return await self._within_deliveries(stream, claimed)

    async def _within_deliveries(self, stream: str, entries: list) -> list:
        """`entries` delivered at most `max_deliveries` times; the others go to the dead
        letters (a task that keeps failing its replica)."""
        out = []
        for entry in entries:
            _, entry_id, task = entry
            count = await streams.deliveries(self.r, stream, names.ROLLOUT_GROUP, entry_id)
            if count > self.max_deliveries:
                await self._dead_letter(stream, entry_id, task, "max_deliveries", count)
            else:
                out.append(entry)
        return out

    async def _run_task(
        self,
        stream: str,
        entry_id: str,
        task: task_pb2.Task | streams.InvalidEntry,
        lease: list[str] | None = None,
    ) -> None:
        heartbeat = asyncio.create_task(self._heartbeat(stream, entry_id, asyncio.current_task()))
        try:
            reason = invalid_reason(task)
            if reason is not None:
                await self._reject(stream, entry_id, task, reason)
                return
            assert isinstance(task, task_pb2.Task)
            why = await breaker.why_open(self.r, task.run_id, task.env)
            if why is not None:  # the env keeps failing this run: not played again
                await self._dead_letter(stream, entry_id, task, "env_circuit_open", 1, why)
                return
            outcome = await self._traced_play(stream, entry_id, task)
            if outcome is None:
                return
            heartbeat.cancel()
            if outcome.failed:
                await self._quarantine(stream, entry_id, task, outcome)
                return
            if not await self._commit(stream, entry_id, task, outcome.trajectories):
                return
            self.on_task_done()
        except asyncio.CancelledError:
            if not heartbeat.done() or heartbeat.cancelled() or not heartbeat.result():
                raise  # not a lost lease: the worker is being cancelled
            self._lost(entry_id)
        except Exception as exc:  # the task stays pending and is retried (reclaimed)
            metrics.DROPPED.labels(SERVICE, "task_attempt", type(exc).__name__).inc()
            log.error("task failed; left pending for retry", entry=entry_id, error=repr(exc))
            with contextlib.suppress(Exception):
                run = names.run_of(stream)
                await self.r.hset(names.task_errors(run), entry_id, repr(exc)[:2000])
        finally:
            heartbeat.cancel()
            self.slots.release()
            if lease and self.quotas is not None:
                with contextlib.suppress(Exception):  # the lease lapses by itself otherwise
                    await self.quotas.release_episodes(
                        self.share.tenant_of(names.run_of(stream)), lease
                    )

    async def _traced_play(
        self, stream: str, entry_id: str, task: task_pb2.Task
    ) -> GroupOutcome | None:
        """Admit and play a task in its trace (its queueing as a span of its own); its group,
        or None when admission cancelled it."""
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
                if not await self.groups.admit(task):
                    span.set_attribute("treadle.cancelled", True)
                    await self._cancel(stream, entry_id)
                    return None
            return await self.groups.play(task)

    async def _commit(self, stream: str, entry_id: str, task: task_pb2.Task, group: list) -> bool:
        """The group's trajectories pushed with the task's ack, in one step, and accounted;
        False when the task was no longer ours (another replica took it)."""
        if not await streams.commit_owned(
            self.r,
            stream,
            names.ROLLOUT_GROUP,
            self.consumer,
            entry_id,
            out_stream=names.trajectories_stream(task.run_id),
            messages=group,
            counter=(names.run_state(task.run_id), "trajectories_produced"),
        ):
            self._lost(entry_id)
            return False
        self.tasks_done += 1
        self.trajectories_pushed += len(group)
        tenant = self.share.tenant_of(task.run_id)
        with contextlib.suppress(Exception):  # accounting never fails a committed task
            counts = usage.of_group(group)
            await usage.record(self.r, task.run_id, tenant, counts)
            if self.quotas is not None:
                await self.quotas.add_tokens(tenant, int(counts["generated_tokens"]))
        return True

    async def _heartbeat(self, stream: str, entry_id: str, work: asyncio.Task | None) -> bool:
        """Keep the task ours while we work on it; True (after cancelling `work`) once it is
        not ours any more. A Redis error only skips a beat (the next may succeed)."""
        while True:
            await asyncio.sleep(self.reclaim_idle_ms / 4000)
            try:
                owned = await streams.heartbeat(
                    self.r, stream, names.ROLLOUT_GROUP, self.consumer, entry_id
                )
            except Exception as exc:
                log.warning("task heartbeat failed", entry=entry_id, error=repr(exc))
                continue
            if not owned:
                if work is not None:
                    work.cancel()
                return True

    def _lost(self, entry_id: str) -> None:
        """Another replica reclaimed the task (this one stalled): its work is dropped."""
        self.lost_tasks += 1
        metrics.DROPPED.labels(SERVICE, "task", "not_owner").inc()
        log.warning("task reclaimed by another replica; this attempt is dropped", entry=entry_id)

    async def _reject(
        self, stream: str, entry_id: str, task: task_pb2.Task | streams.InvalidEntry, reason: str
    ) -> None:
        log.warning("invalid task dead-lettered", entry=entry_id, reason=reason)
        run = names.run_of(stream)
        await self.r.hset(names.run_state(run), "last_invalid_task", f"{entry_id}: {reason}")
        await self._dead_letter(stream, entry_id, task, "invalid", 1, error=reason)
        self.invalid_tasks += 1  # once it is all in Redis

    async def _dead_letter(
        self,
        stream: str,
        entry_id: str,
        task: task_pb2.Task | streams.InvalidEntry,
        reason: str,
        deliveries: int,
        error: str | None = None,
    ) -> None:
        """Give up on a task (`dead_letters.give_up`), counted here too."""
        self.dead_lettered += 1
        await give_up(self.r, stream, entry_id, task, reason, deliveries, self.consumer, error)

    async def _quarantine(
        self, stream: str, entry_id: str, task: task_pb2.Task, outcome: GroupOutcome
    ) -> None:
        """A group with an episode that failed past its retries: not trained on its survivors
        only; its failed episodes quarantined, the others discarded, its task dead-lettered
        (the trainer feeds one in its place)."""
        failed = outcome.failed
        first = outcome.trajectories[failed[0]]
        discarded = len(outcome.trajectories) - len(failed)
        metrics.DROPPED.labels(SERVICE, "trajectory", "group_incomplete").inc(discarded)
        self.dead_lettered += 1
        await give_up(
            self.r,
            stream,
            entry_id,
            task,
            "episodes_failed",
            1,
            self.consumer,
            f"{len(failed)} of {len(outcome.trajectories)} episodes failed "
            f"{outcome.attempts[failed[0]]} times; {status_name(first)}: {first.error}",
            quarantined=[(outcome.trajectories[i], outcome.attempts[i]) for i in failed],
            discarded=discarded,
        )

    async def _cancel(self, stream: str, entry_id: str) -> None:
        """The run needs no more groups (its trainer closed admission): ack, count."""
        self.cancelled_tasks += 1
        metrics.DROPPED.labels(SERVICE, "task", "run_closed").inc()
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hincrby(names.run_state(names.run_of(stream)), "tasks_cancelled", 1)
            pipe.xack(stream, names.ROLLOUT_GROUP, entry_id)
            await pipe.execute()

    async def drain(self) -> None:
        """Stop taking tasks; finish the ones in flight (their trajectories land, then ack)."""
        self.stopping = True
        if self.in_flight:
            await asyncio.gather(*self.in_flight, return_exceptions=True)
