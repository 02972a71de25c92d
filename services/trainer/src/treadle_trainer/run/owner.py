"""`RunOwner`: one run's step loop, from its first task to its last checkpoint.

restore (last committed checkpoint) or base version --> per step:
    feed (feeder.py) --> collect complete groups (collector.py) --> build the batch
    (step.py) --> train --> weights to the background publisher (publishing.py; a sync
    run waits for them) --> every `checkpoint_every` steps: checkpoint + ledger commit
    (ledger.py) --> a sync run's evaluation hold
after the last step: cancel unstarted tasks, let groups in flight land, drop what no
step used as `run_ended`; the final checkpoint acks and ledgers them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from treadle_common import admission, fleet, names, retention, scheduling
from treadle_common.api.runs import FINAL_STATES, RunState, RunStatus
from treadle_common.clients import streams
from treadle_common.clients.env import EnvClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config import RunConfig
from treadle_common.logs import get_logger
from treadle_common.progress import Stage
from treadle_trainer import metrics as tm
from treadle_trainer.backends import (
    AdamParams,
    BackendSpec,
    TorchBackend,
    build_backend,
    on_torch_thread,
)
from treadle_trainer.backends.lora import LoraBackend
from treadle_trainer.backends.single import CorruptCheckpoint, verify_checkpoint
from treadle_trainer.batches import Datum, Group
from treadle_trainer.losses import LossParams
from treadle_trainer.publisher import Snapshot
from treadle_trainer.run import claims
from treadle_trainer.run.collector import Collector, Stopping
from treadle_trainer.run.feeder import Feeder, task_source
from treadle_trainer.run.lease import Fenced, Lease
from treadle_trainer.run.ledger import Drops, Ledger, LedgerEntry
from treadle_trainer.run.publishing import RunVersions, initial_model_dir
from treadle_trainer.run.step import EvaluationHold, build_batch, observe, step_record, trace_step
from treadle_trainer.train import train_batch

log = get_logger(__name__)
KEEP_CHECKPOINTS = 2
COMMITTED_COUNTERS = (
    "trajectories_consumed",
    "trajectories_trained",
    "trajectories_acked",
    "rejected",
    "duplicates",
    "dropped",
    "versions",
)
"""What a rollback to an older checkpoint takes from the last committed state instead."""


def retryable(exc: BaseException) -> bool:
    """An error that resuming the run later can fix: a service or Redis unreachable or
    restarting, a deadline, a batch that did not arrive in time (rollout away)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.ABORTED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.CANCELLED,
        )
    transient = (
        redis_errors.ConnectionError,
        redis_errors.TimeoutError,
        redis_errors.BusyLoadingError,
        httpx.TransportError,
        ConnectionError,
        TimeoutError,
    )
    return isinstance(exc, transient)


def _being_cancelled() -> bool:
    """This task was asked to stop (not: an awaited call ended in CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def intact_checkpoint(candidates: list[Path]) -> tuple[Path, dict]:
    """The first intact checkpoint of `candidates` (committed ones, newest first)."""
    errors = []
    for path in candidates:
        try:
            return path, verify_checkpoint(path)
        except CorruptCheckpoint as exc:
            log.error("checkpoint damaged", error=str(exc))
            errors.append(str(exc))
    raise CorruptCheckpoint("no intact checkpoint to restore: " + "; ".join(errors))


class RunOwner:
    def __init__(
        self,
        config: RunConfig,
        r: aioredis.Redis,
        store: WeightStoreClient,
        env: EnvClient,
        lease: Lease,
        consumer: str = names.TRAINER_CONSUMER,
        stages: tuple[Stage, Stage] | None = None,
        retention_s: float = 7 * 24 * 3600.0,
        turns: scheduling.FairTurns | None = None,
        tenant: str = "default",
    ):
        self.turns = turns or scheduling.FairTurns(scheduling.Fifo())
        """The trainer process's torch thread, shared with its other runs' steps."""
        self.claim = scheduling.Claim(
            config.run_id, config.scheduling.weight, config.scheduling.priority
        )
        read_stage, self.step_stage = stages or (
            Stage("trainer", "trajectories"),
            Stage("trainer", "step"),
        )
        self.config, self.r, self.store, self.env = config, r, store, env
        self.lease = lease
        self.retention_s = retention_s  # a finished run's keys expire after this
        self.lost = False  # another trainer took the run over (set by whoever renews the lease)
        self.handing_off = False
        self._rolled_back = 0
        self._steps_saved = 0  # status.steps[:this] are in Redis (run_steps)
        self._kept: list[Path] = []  # committed checkpoints kept, newest first
        self.status = RunStatus(run_id=config.run_id, tenant=tenant)
        self.backend: TorchBackend | None = None
        self.run_dir = config.output_dir / config.run_id
        self.ledger = Ledger(r, config.run_id, lease)
        self.drops = Drops(self.status)
        self.feeder = Feeder(config, r, self.status, lease)
        self.collector = Collector(
            config,
            r,
            consumer,
            self.status,
            self.ledger,
            self.drops,
            self.feeder.fed,
            read_stage,
            lease,
        )
        self.versions = RunVersions(config, store, self.status)
        self.holds = EvaluationHold(config)
        self._v0 = 0  # the version before step 1: step s publishes version V0 + s
        t = config.trainer
        self.loss_params = LossParams(
            clip_low=t.clip_low,
            clip_high=t.clip_high,
            is_cap=t.is_cap,
            kl_coef=t.kl_coef,
            temperature=config.rollout.sampling.temperature or 1.0,  # 0 = greedy: plain logits
        )
        self.adam = AdamParams(learning_rate=t.lr, max_grad_norm=t.max_grad_norm)

    @property
    def max_staleness(self) -> int:
        t = self.config.trainer
        # sync: a batch is generated with the last published version, up to K - 1 steps old
        return t.publish_every - 1 if self.config.mode == "sync" else t.max_staleness

    @property
    def collecting(self) -> bool:
        return self.collector.collecting

    def hand_off(self) -> None:
        """Stop at the next step boundary, checkpointed, leaving the run to another trainer
        (this one is shutting down)."""
        self.handing_off = True
        self.collector.stopping = True

    async def execute(self, last_attempt: bool = True) -> RunStatus:
        """Run to the end. An infrastructure error (`retryable`) leaves the run `retrying`
        (nothing is marked in Redis; the caller resumes it from its last checkpoint with a
        new owner) unless this is the `last_attempt`."""
        self.status.state = "running"
        self.status.owner = self.lease.value
        outcome: RunState = "failed"
        try:
            await self.r.hset(names.run_state(self.config.run_id), "state", "running")
            await self._save_status()
            await self._execute()
            finished = self.status.step >= self.config.trainer.num_steps
            outcome = "succeeded" if finished else "handed_off"
        except (Fenced, asyncio.CancelledError) as exc:
            stray = isinstance(exc, asyncio.CancelledError) and not self.lost
            if stray and _being_cancelled():
                raise
            if stray:  # a library cancelled a call under us: an interruption, not a verdict
                self.status.error = "CancelledError: a call was cancelled under the run"
                outcome = "failed" if last_attempt else "retrying"
                log.warning("run interrupted; resuming", run=self.config.run_id, error=repr(exc))
            else:
                outcome, self.status.error = "lost", str(exc) or "the run's lease was taken over"
                log.warning("run lost to another trainer", run=self.config.run_id, error=str(exc))
        except Exception as exc:
            self.status.error = f"{type(exc).__name__}: {exc}"
            if retryable(exc) and not last_attempt:
                outcome = "retrying"
                log.warning("run interrupted; resuming", run=self.config.run_id, error=repr(exc))
            else:
                log.error("run failed", run=self.config.run_id, error=self.status.error)
        finally:
            await self.versions.publisher.close()
            if outcome in FINAL_STATES:
                try:
                    outcome = await self._end(outcome)
                except Exception as exc:  # Redis away at the very end: resume, then end
                    log.warning("ending the run failed", run=self.config.run_id, error=repr(exc))
                    self.status.error = self.status.error or f"ending the run failed: {exc!r}"
                    outcome = "failed" if last_attempt else "retrying"
            self.status.state = outcome
            if self.backend is not None:
                await on_torch_thread(self.backend.close)
        return self.status

    async def _end(self, outcome: RunState) -> RunState:
        """The run is over: its final counts and state, unless another trainer owns it."""
        run = self.config.run_id
        await self._final_counts()  # before the final state: readers see complete counts

        self.status.state = outcome

        async def final(pipe) -> None:
            pipe.srem(names.RUNS_KEY, run)
            pipe.hdel(names.RUN_POLICIES, run)
            pipe.hset(names.run_state(run), "state", outcome)
            self._queue_status(pipe)
            await retention.expire_run(pipe, run, self.retention_s)

        try:
            await self.lease.transaction(final)
        except Fenced as exc:
            log.warning("run ended elsewhere meanwhile", run=run, error=str(exc))
            return "lost"
        return outcome

    # --- the status any trainer can answer for ----------------------------------------------------
    def _queue_status(self, pipe: aioredis.client.Pipeline) -> None:
        """Queue the status (without step records) and the step records not written yet."""
        run = self.config.run_id
        new = self.status.steps[self._steps_saved :]
        if new:
            pipe.hset(names.run_steps(run), mapping={str(r.step): r.model_dump_json() for r in new})
        pipe.set(names.run_status(run), self.status.model_dump_json(exclude={"steps"}))

    async def _save_status(self) -> None:
        """Write the status for `GET /v1/runs/{id}` on any trainer; fenced (a stale owner's
        write is refused and it stops); a Redis error only skips this write."""

        def queue(pipe: aioredis.client.Pipeline) -> None:
            self._queue_status(pipe)

        try:
            await self.lease.transaction(queue)
        except Fenced:
            raise
        except Exception as exc:
            log.warning("saving the run's status failed", run=self.config.run_id, error=repr(exc))
            return
        self._steps_saved = len(self.status.steps)

    # --- setup and restore -----------------------------------------------------------------------
    async def _execute(self) -> None:
        cfg, t = self.config, self.config.trainer
        model_dir = await initial_model_dir(cfg, self.store, self.run_dir)
        spec = BackendSpec(
            model_dir=str(model_dir),
            seed=t.seed,
            reference=t.kl_coef > 0,
            bf16=t.bf16,
            kind=t.backend,
            tensor_parallel=t.tensor_parallel,
            pipeline_parallel=t.pipeline_parallel,
            lora=t.lora.model_dump() if t.lora else None,
        )
        self.backend = backend = await on_torch_thread(build_backend, spec)
        log.info("backend ready", run=cfg.run_id, **backend.layout_info())
        self.collector.vocab_size = backend.vocab_size
        count = (t.num_steps + self.max_staleness) * t.tasks_per_step
        source = await task_source(cfg, self.env, count)
        await streams.ensure_group(self.r, self.collector.stream, names.TRAINER_GROUP)
        await self.r.set(names.run_config(cfg.run_id), cfg.model_dump_json())
        restored = await self._restore()
        if isinstance(self.backend, LoraBackend):  # versions are adapters on a full base
            await self.versions.adapter_base(self.backend, self.r)
        if restored:
            version = await self._publish_now(step=self.status.step)  # rollout goes back to it
        else:
            assert self.backend is not None
            state = await on_torch_thread(self.backend.state_dict_cpu)
            if isinstance(self.backend, LoraBackend):  # the new adapter (B = 0: the base)
                version = await self.versions.publish_now(state, step=0)
            else:
                version = await self.versions.base_version(state)
            self.status.base_version = version
        self._v0 = version - self.status.step
        served = version  # what rollout generates the next batch with (sync: must hold)
        await admission.configure(
            self.r,
            cfg.run_id,
            groups_per_step=t.tasks_per_step,
            max_staleness=self.max_staleness,
            base_version=self._v0,
        )
        await fleet.register(self.r, claims.policy_of(cfg, self.status.tenant))  # before rollout
        await self.r.sadd(names.RUNS_KEY, cfg.run_id)
        await self.collector.replay_pending()
        while self.status.step < t.num_steps and not self.handing_off:
            step = self.status.step + 1
            started = time.perf_counter()
            # async keeps S steps of work fed, up to the last step (as a longer run would)
            upto = (step + self.max_staleness) * t.tasks_per_step
            await self._feed(source, upto, served)
            try:
                groups = await self.collector.collect(
                    t.tasks_per_step,
                    version,
                    self.max_staleness,
                    refill=lambda: self._feed(source, upto, served),  # noqa: B023
                )
            except Stopping:
                break
            wait_s = time.perf_counter() - started
            feed_next: Callable[[], Awaitable[None]] | None = None
            if step == t.num_steps:
                await admission.close(self.r, cfg.run_id)  # no later group would be trained
            elif self._feeds_next(step):
                # the next step's tasks, demanding this step's weights: rollout reads them
                # while they are published and generates as soon as the store has them
                feed_next = functools.partial(
                    self._feed, source, (step + 1) * t.tasks_per_step, self._v0 + step
                )
            version = await self._step(step, groups, version, started, wait_s, feed_next)
            if self.versions.publishes(step):
                served = version
            await self._save_status()
            if step % t.checkpoint_every == 0 and step < t.num_steps:
                await self._checkpoint(version)
            await self.holds.wait(step)
        if self.handing_off and self.status.step < t.num_steps:
            if self.ledger.uncommitted or self.status.checkpoint_step < self.status.step:
                await self._checkpoint(version)
            await self.versions.publisher.flush()
            log.info("run handed off", run=cfg.run_id, step=self.status.step)
            return
        await admission.close(self.r, cfg.run_id)
        await self.collector.finish(self.feeder, self.status.step, version)
        if self.ledger.uncommitted or self.status.checkpoint_step < self.status.step:
            await self._checkpoint(version)
        await self.versions.publisher.flush()  # the run's last weights are in the store

    async def _feed(self, source, upto: int, version: int) -> None:
        await self.feeder.feed(source, upto, version if self.max_staleness == 0 else 0)

    def _feeds_next(self, step: int) -> bool:
        """A sync run feeds step + 1's tasks before `step`'s weights are published (they wait
        in rollout for that version): while they are published, or with `trainer.feed_ahead`
        before `step` trains. Not when an evaluation of `step`'s weights comes first: nothing
        may generate beside it."""
        return (
            self.max_staleness == 0 and self.versions.publishes(step) and not self.holds.after(step)
        )

    async def _restore(self) -> bool:
        """Load the last committed checkpoint of this run, if any; True when restored."""
        run = self.config.run_id
        await self.feeder.restore()
        raw = await self.r.hget(names.run_state(run), "checkpoint_path")
        if raw is None:
            return False
        committed = Path(streams.text(raw))
        candidates = [committed, *await self.ledger.checkpoints()]
        candidates = list(dict.fromkeys(candidates))  # committed ones only, newest first
        path, meta = await asyncio.to_thread(intact_checkpoint, candidates)
        self._kept = candidates[:KEEP_CHECKPOINTS]
        assert self.backend is not None
        await on_torch_thread(self.backend.load, path)
        restored = RunStatus.model_validate(meta["run"])
        restored.tasks_fed, restored.state = self.status.tasks_fed, "running"
        restored.resumed += 1
        restored.owner = self.lease.value
        for name in RunStatus.model_fields:  # in place: every part holds this status
            setattr(self.status, name, getattr(restored, name))
        self._steps_saved = len(self.status.steps)  # the previous owner wrote these
        self.collector.seen = set(meta["seen"])
        if path != committed:
            await self._roll_back(restored.step, int(meta["version"]))
        self.drops.reload()
        if path != committed:
            for _ in range(self._rolled_back):
                self.drops.count("checkpoint_lost")
        log.info("run restored", run=run, step=restored.step, checkpoint=str(path))
        return True

    async def _roll_back(self, step: int, version: int) -> None:
        """The committed checkpoint was damaged and an older one (at `step`) restored: the
        steps after it are undone. Their entries were acked, so their trajectories cannot be
        trained again: a `rollback` ledger entry (committed with the next checkpoint) drops
        them as `checkpoint_lost`, and the counters go on from the committed state."""
        run = self.config.run_id
        lost: list[str] = []
        handled: set[str] = set()
        records: Any = await self.r.xrange(names.ledger_stream(run))
        for _, fields in records:
            if int(fields[b"step"]) > step and fields[b"kind"] != b"rollback":
                trained = json.loads(fields[b"trained"])
                lost += trained
                handled |= set(trained) | set(json.loads(fields[b"dropped"]))
        raw = await self.r.hget(names.run_state(run), "committed_status")
        if raw:
            committed = RunStatus.model_validate_json(raw)
            for name in COMMITTED_COUNTERS:
                setattr(self.status, name, getattr(committed, name))
        self.status.trajectories_trained -= len(lost)
        self.collector.seen |= handled
        self._rolled_back = len(lost)
        dropped = dict.fromkeys(lost, "checkpoint_lost")
        self.ledger.uncommitted.append(LedgerEntry(step, "rollback", version, [], [], dropped))
        log.error("committed checkpoint damaged: rolled back", run=run, step=step, lost=len(lost))

    async def _publish_now(self, step: int) -> int:
        assert self.backend is not None
        state = await on_torch_thread(self.backend.state_dict_cpu)
        return await self.versions.publish_now(state, step)

    # --- one step -------------------------------------------------------------------------------
    async def _step(
        self,
        step: int,
        groups: list[Group],
        version: int,
        started: float,
        wait_s: float,
        feed_next: Callable[[], Awaitable[None]] | None = None,
    ) -> int:
        """Train `step` on `groups` and publish its weights; `feed_next` feeds the next
        step's tasks meanwhile (before training with `trainer.feed_ahead`, else after)."""
        assert self.backend is not None
        batch = build_batch(groups, version, self.max_staleness, self.config.trainer)
        for reason in batch.dropped.values():
            self.drops.count(reason)
        feeding: asyncio.Future[None] | None = None
        if feed_next is not None and self.config.trainer.feed_ahead:
            feeding = asyncio.ensure_future(feed_next())
        try:
            if self.backend.device == "cpu":
                # a publish still in flight (async) finishes first: on the CPU it takes the
                # cores and the GIL from training, which then ran 75 % slower on the 2-core dev
                # VM (`treadle bench step`); on a GPU they overlap
                await self.versions.publisher.flush()
            async with self.turns.turn(self.claim):  # runs share the torch thread fairly
                train_start = time.perf_counter()
                with self.step_stage.track():
                    stats = await on_torch_thread(self._train, batch.data)
                train_s = time.perf_counter() - train_start
            publish_start = time.perf_counter()
            if feed_next is not None and feeding is None:
                feeding = asyncio.ensure_future(feed_next())
            version = self._v0 + step
            if self.versions.publishes(step):
                state = await on_torch_thread(self.backend.snapshot_cpu)
                # a sync run's next batch is generated with these weights: it waits for them
                await self.versions.submit(
                    Snapshot(step, version, state), wait=self.config.mode == "sync"
                )
            publish_s = time.perf_counter() - publish_start
        finally:
            if feeding is not None:
                await feeding
        self.status.trajectories_trained += len(batch.trained)
        self.ledger.add(
            LedgerEntry(step, "step", version, batch.entries, batch.trained, batch.dropped)
        )
        duration = time.perf_counter() - started
        trace_step(batch, step, version, train_start, duration - (train_start - started))
        timings = {
            "wait_for_batch_s": wait_s,
            "train_s": train_s,
            "publish_s": publish_s,
            "duration_s": duration,
        }
        record = step_record(step, version, batch, timings, stats)
        self.status.step = step
        self.status.steps.append(record)
        self.status.usage.add_step(record)
        if self.versions.publishes(step):
            self.versions.record(record)
        observe(self.config.run_id, record, batch.stale)
        return version

    def _train(self, data: list[Datum]) -> dict[str, float]:
        assert self.backend is not None
        t = self.config.trainer
        return train_batch(self.backend, data, t, self.loss_params, self.adam, self.status.step + 1)

    # --- run end, checkpoint and commit -----------------------------------------------------------
    async def _checkpoint(self, version: int) -> None:
        """Checkpoint, then ack and ledger every entry of the steps since the last one."""
        assert self.backend is not None
        run, step = self.config.run_id, self.status.step
        started = time.perf_counter()
        await self.versions.publisher.flush()  # the checkpoint's versions are all in the store
        # the lease's token in the name: a stale owner (its commit refused) never writes over
        # the directory of the run's real owner
        name = f"step-{step:06d}-t{self.lease.token}"
        path = (self.run_dir / "checkpoints" / name).resolve()
        self.status.trajectories_acked += self.ledger.pending_acks
        # buffered (read, not yet trained) entries stay pending: a restored owner re-reads them
        buffered = self.collector.buffer.trajectory_ids()
        run_state = self.status.model_dump(mode="json")
        run_state["trajectories_consumed"] -= len(buffered)
        run_state["checkpoint_step"] = step
        committed = {k: v for k, v in run_state.items() if k != "steps"}
        meta = {
            "run": run_state,
            "seen": sorted(self.collector.seen - buffered),
            "version": version,
            "model": self.config.model.name,
        }
        await on_torch_thread(self.backend.save, path, meta)
        await self.ledger.commit(step, path, json.dumps(committed))
        self.status.checkpoint_step = step
        await self._trim()
        # only the owner gets here (a stale one's commit was refused): keep the last
        # KEEP_CHECKPOINTS committed, delete every other directory (stale owners' too)
        self._kept = [path, *self._kept][:KEEP_CHECKPOINTS]
        for stale_dir in (self.run_dir / "checkpoints").glob("step-*"):
            if stale_dir.resolve() not in self._kept:
                shutil.rmtree(stale_dir, ignore_errors=True)
        tm.CHECKPOINT_SECONDS.labels(run).observe(time.perf_counter() - started)

    async def _trim(self) -> None:
        """Drop the stream entries their consumers acked (bounded Redis); a failure only
        leaves them for the next checkpoint."""
        run = self.config.run_id
        try:
            await streams.trim_acked(self.r, names.trajectories_stream(run), names.TRAINER_GROUP)
            await streams.trim_acked(self.r, names.tasks_stream(run), names.ROLLOUT_GROUP)
        except Exception as exc:
            log.warning("trimming the run's streams failed", run=run, error=repr(exc))

    async def _final_counts(self) -> None:
        state = await self.r.hgetall(names.run_state(self.config.run_id))
        self.status.trajectories_produced = int(state.get(b"trajectories_produced", 0))
        await self.feeder.refresh()
        try:
            pending = await self.r.xpending(self.collector.stream, names.TRAINER_GROUP)
            self.status.pending_after_run = int(pending["pending"])
        except Exception:  # the stream never existed (the run failed early)
            self.status.pending_after_run = None
