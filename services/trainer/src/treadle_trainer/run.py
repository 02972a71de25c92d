"""Run ownership: feed tasks, assemble groups, train, publish, checkpoint, ack exactly once.

    dataset / env generator --cursor--> MULTI: XADD treadle:{run}:tasks + cursor + fed ids
        (fed up to (step + max_staleness) * tasks_per_step; rollout admission does the rest;
        with `feed_ahead` a sync run feeds the next step's tasks, demanding the version this
        step will publish, before it trains this step, so rollout prepares them meanwhile)
    treadle:{run}:trajectories --XREADGROUP (group `trainer`, consumer `owner`)--> validate
        --> GroupBuffer (complete groups) --> staleness / status drops --> advantages
        --> micro-batches by token budget --> backend.forward_backward + optim_step
        --> a copy of the new weights to the background publisher (`publisher.py`): it
            publishes them (delta) to the weight-store, which announces on NATS; version
            V0 + step, every `publish_every` steps, newest first. Sync runs wait for it
            (the next batch is generated with it); async runs go on at once
    every `checkpoint_every` steps: checkpoint (model, optimizer, RNG, cursor, run state) -->
        MULTI: XACK every entry those steps used or dropped + one ledger entry per step -> EXEC
    sync mode, every `eval.every` steps: wait until the client has evaluated this step's
        weights (POST /v1/runs/{id}/evaluations), so nothing trains beside the evaluation
    after the last step: close admission, cancel unstarted tasks, let groups in flight land,
        drop the unused trajectories as `run_ended`; the final checkpoint acks and ledgers them

A crash loses only uncommitted steps: the restarted owner loads the last committed checkpoint,
re-publishes its weights, and replays its still-pending entries, so the ledger holds every
trajectory exactly once (trained, or dropped with its reason).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
import statistics
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from treadle_common import admission, metrics, names, tracing
from treadle_common.api.runs import RunStatus, StepRecord
from treadle_common.clients import streams
from treadle_common.clients.env import EnvClient
from treadle_common.clients.torch_weights import model_assets, state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient, build_manifest, chunk_positions
from treadle_common.config import RunConfig
from treadle_common.evaluation import held_out_tasks, without_held_out
from treadle_common.logs import get_logger
from treadle_common.progress import Stage
from treadle_common.proto.treadle.v1 import common_pb2, task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_common.weights_export import export_hf
from treadle_trainer import metrics as tm
from treadle_trainer.backends import (
    AdamParams,
    BackendSpec,
    TorchBackend,
    build_backend,
    on_torch_thread,
)
from treadle_trainer.batches import (
    Datum,
    Entry,
    Group,
    GroupBuffer,
    drop_reason,
    group_advantages,
    in_feed_order,
    invalid_reason,
    is_constant,
    staleness,
)
from treadle_trainer.data import DatasetError, TaskSource, load_rows
from treadle_trainer.losses import LossParams
from treadle_trainer.publisher import Published, Publisher, Snapshot
from treadle_trainer.train import train_batch

log = get_logger(__name__)
SERVICE = "trainer"
KEEP_CHECKPOINTS = 2


def task_seed(run_seed: int, index: int, group_size: int) -> int:
    """The sampling seed of the run's `index`-th task: its episodes take seed + 0 .. seed +
    group_size - 1, so no two episodes of a run share one (and 0, unseeded, is never used)."""
    return (run_seed % 2**20) * 2**40 + index * group_size + 1


class RunOwner:
    def __init__(
        self,
        config: RunConfig,
        r: aioredis.Redis,
        store: WeightStoreClient,
        env: EnvClient,
        consumer: str = names.TRAINER_CONSUMER,
        stages: tuple[Stage, Stage] | None = None,
    ):
        self.config = config
        self.read_stage, self.step_stage = stages or (
            Stage("trainer", "trajectories"),
            Stage("trainer", "step"),
        )
        self.collecting = False
        self.r = r
        self.store = store
        self.env = env
        self.consumer = consumer
        self.status = RunStatus(run_id=config.run_id)
        self.backend: TorchBackend | None = None
        self.run_dir = config.output_dir / config.run_id
        self._stream = names.trajectories_stream(config.run_id)
        self._seen: set[str] = set()
        self._fed: set[str] = set()
        self._dropped: Counter[str] = Counter()
        self._buffer = GroupBuffer(config.rollout.group_size)
        self._uncommitted: list[dict[str, Any]] = []  # steps trained since the last checkpoint
        self._loose_drops: list[tuple[str, str, str]] = []  # (entry, trajectory, reason)
        self.publisher = Publisher(self._publish_snapshot, self._published)
        self._records: dict[int, StepRecord] = {}  # steps whose publish is not recorded yet
        self._publish_done: dict[int, Published] = {}
        self._v0 = 0  # the version before step 1: step s publishes version V0 + s
        self.evaluated_step = 0
        self._evaluated = asyncio.Condition()
        self._assets = model_assets(config.model.path)  # config + tokenizer travel with weights
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
    def total_tasks(self) -> int:
        return self.config.trainer.num_steps * self.config.trainer.tasks_per_step

    async def execute(self) -> RunStatus:
        self.status.state = "running"
        await self.r.hset(names.run_state(self.config.run_id), "state", "running")
        outcome = "failed"
        try:
            await self._execute()
            outcome = "succeeded"
        except Exception as exc:
            self.status.error = f"{type(exc).__name__}: {exc}"
            log.error("run failed", run=self.config.run_id, error=self.status.error)
        finally:
            run = self.config.run_id
            await self.publisher.close()
            await self.r.srem(names.RUNS_KEY, run)
            await self._final_counts()  # before the final state: readers see complete counts
            self.status.state = outcome
            await self.r.hset(names.run_state(run), "state", outcome)
            if self.backend is not None:
                await on_torch_thread(self.backend.close)
        return self.status

    # --- setup and restore -----------------------------------------------------------------------
    async def _execute(self) -> None:
        cfg, t = self.config, self.config.trainer
        model_dir = await self._initial_model_dir()
        spec = BackendSpec(
            model_dir=str(model_dir), seed=t.seed, reference=t.kl_coef > 0, bf16=t.bf16
        )
        self.backend = await on_torch_thread(build_backend, spec)
        source = await self._task_source()
        await streams.ensure_group(self.r, self._stream, names.TRAINER_GROUP)
        await self.r.set(names.run_config(cfg.run_id), cfg.model_dump_json())
        if await self._restore():
            version = await self._publish(step=self.status.step)  # rollout goes back to it
        else:
            version = await self._base_version()
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
        await self.r.sadd(names.RUNS_KEY, cfg.run_id)
        for _, entry_id, traj in await streams.pending_own(
            self.r, self._stream, names.TRAINER_GROUP, self.consumer, tpb.Trajectory, 1_000_000
        ):
            self._accept(entry_id, traj)  # replay what the last owner read but never committed
        while self.status.step < t.num_steps:
            step = self.status.step + 1
            started = time.perf_counter()
            # async keeps S steps of work fed, up to the last step (as a longer run would)
            await self._feed(source, (step + self.max_staleness) * t.tasks_per_step, served)
            groups = await self._collect(t.tasks_per_step, version)
            wait_s = time.perf_counter() - started
            feeding = None
            if step == t.num_steps:
                await admission.close(self.r, cfg.run_id)  # no later group would be trained
            elif self._feeds_ahead(step):
                # the next step's tasks, demanding this step's weights, fed while this step
                # trains: rollout picks them up, opens their sessions and renders their prompts
                feeding = asyncio.ensure_future(
                    self._feed(source, (step + 1) * t.tasks_per_step, self._v0 + step)
                )
            try:
                version = await self._step(step, groups, version, started, wait_s)
            finally:
                if feeding is not None:
                    await feeding
            if self._publishes(step):
                served = version
            if step % t.checkpoint_every == 0 and step < t.num_steps:
                await self._checkpoint(version)
            await self._hold_for_evaluation(step)
        await self._end_feeding(version)
        if self._uncommitted or self.status.checkpoint_step < self.status.step:
            await self._checkpoint(version)
        await self.publisher.flush()  # the run's last weights are in the store when it ends

    async def _task_source(self) -> TaskSource:
        """The dataset or the env's generator, minus the held-out eval tasks."""
        cfg = self.config
        if cfg.data.path is not None:
            rows = await asyncio.to_thread(load_rows, cfg.data.path)
        else:
            count = self.total_tasks + self.max_staleness * cfg.trainer.tasks_per_step
            rows = await self.env.sample_tasks(
                cfg.env.name, count, seed=cfg.trainer.seed, options=cfg.env.options
            )
        rows = without_held_out(rows, await held_out_tasks(self.env, cfg))
        if not rows:
            raise DatasetError("every training task is in the held-out eval set")
        return TaskSource(rows, cfg.trainer.seed, cfg.data.path is not None and cfg.data.shuffle)

    async def _initial_model_dir(self) -> Path:
        """`model.path`, or `model.init_version` exported as an HF directory in the run dir."""
        m = self.config.model
        if m.init_version is None:
            return m.path
        out = self.run_dir / f"init-v{m.init_version}"
        if not (out / "model.safetensors").exists():
            tmp = out.with_name(out.name + ".tmp")
            await export_hf(self.store, m.name, m.init_version, tmp)
            tmp.rename(out)
        return out

    async def _restore(self) -> bool:
        """Load the last committed checkpoint of this run, if any; True when restored."""
        run = self.config.run_id
        state = await self.r.hgetall(names.run_state(run))
        self.status.tasks_fed = int(state.get(b"tasks_fed", 0))
        self._fed = {m.decode() for m in await self.r.smembers(names.fed_tasks(run))}
        path = state.get(b"checkpoint_path")
        if path is None:
            return False
        assert self.backend is not None
        meta = await on_torch_thread(self.backend.load, Path(path.decode()))
        restored = RunStatus.model_validate(meta["run"])
        restored.tasks_fed, restored.state = self.status.tasks_fed, "running"
        restored.resumed += 1
        self.status = restored
        self._seen = set(meta["seen"])
        self._dropped = Counter(restored.dropped)
        log.info("run restored", run=run, step=restored.step, checkpoint=path.decode())
        return True

    async def _base_version(self) -> int:
        """The version rollout must hold before generating for step 1.

        0 (the model directory itself) when the store has no version of this model; the
        latest version when it already holds exactly our initial weights; otherwise our
        initial weights are published as a new version.
        """
        assert self.backend is not None
        versions = await self.store.list_versions(self.config.model.name)
        if not versions:
            return 0
        latest = await self.store.get_manifest(self.config.model.name, versions[-1].version)
        state = await on_torch_thread(self.backend.state_dict_cpu)
        ours, _ = build_manifest(self.config.model.name, state_dict_to_raw(state))
        if chunk_positions(latest) == chunk_positions(ours):
            return latest.version
        return await self._publish(step=0)

    # --- evaluation holds -------------------------------------------------------------------------
    def evaluates_after(self, step: int) -> bool:
        """Whether the run waits after `step` for the client's evaluation of its weights."""
        cfg, e = self.config, self.config.eval
        return (
            cfg.mode == "sync"
            and e.num_tasks > 0
            and e.every > 0
            and e.hold_s > 0
            and step % e.every == 0
            and step < cfg.trainer.num_steps
        )

    async def mark_evaluated(self, step: int) -> None:
        """The client has evaluated the weights of `step`: the run may go on."""
        async with self._evaluated:
            self.evaluated_step = max(self.evaluated_step, step)
            self._evaluated.notify_all()

    async def _hold_for_evaluation(self, step: int) -> None:
        if not self.evaluates_after(step):
            return
        async with self._evaluated:
            try:
                await asyncio.wait_for(
                    self._evaluated.wait_for(lambda: self.evaluated_step >= step),
                    self.config.eval.hold_s,
                )
            except TimeoutError:
                log.warning("no evaluation reported; going on", run=self.config.run_id, step=step)

    # --- feeding ------------------------------------------------------------------------------
    def _feeds_ahead(self, step: int) -> bool:
        """With `trainer.feed_ahead`, a sync run feeds step + 1's tasks before training `step`
        (they wait in rollout for the version `step` publishes), unless an evaluation of
        `step`'s weights comes first: nothing may generate beside it."""
        return (
            self.config.trainer.feed_ahead
            and self.max_staleness == 0
            and self._publishes(step)
            and not self.evaluates_after(step)
        )

    async def _feed(self, source: TaskSource, upto: int, version: int) -> None:
        """Feed tasks until `upto` live ones were fed (cancelled ones are replaced); the
        cursor, the tasks and their ids move in one transaction."""
        cfg = self.config
        cursor = self.status.tasks_fed
        cancelled = int(await self.r.hget(names.run_state(cfg.run_id), "tasks_cancelled") or 0)
        if cursor - cancelled >= upto:
            return
        upto += cancelled  # the new cursor: cancelled tasks do not count toward the bound
        sampling = common_pb2.SamplingParams(
            temperature=cfg.rollout.sampling.temperature,
            top_p=cfg.rollout.sampling.top_p,
            max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        )
        # ids sort in feed order (a step trains its groups in that order, whatever order they
        # arrive in); the suffix keeps them unique if a run id is ever reused
        ids = [f"{i:09d}-{uuid.uuid4().hex[:12]}" for i in range(cursor, upto)]
        env_options = json.dumps(cfg.env.options)
        scorer_options = json.dumps(cfg.scorer_options)
        async with self.r.pipeline(transaction=True) as pipe:
            for i, (task_id, payload) in enumerate(
                zip(ids, source.take(cursor, upto - cursor), strict=True), start=cursor
            ):
                task = task_pb2.Task(
                    task_id=task_id,
                    run_id=cfg.run_id,
                    env=cfg.env.name,
                    payload_json=json.dumps(payload),
                    group_size=cfg.rollout.group_size,
                    max_turns=cfg.rollout.max_turns,
                    sampling=sampling,
                    scorer=cfg.scorer,
                    scorer_options_json=scorer_options,
                    model=cfg.model.name,
                    min_policy_version=version if self.max_staleness == 0 else 0,
                    created_at=time.time(),
                    env_options_json=env_options,
                )
                task.sampling.seed = task_seed(cfg.trainer.seed, i, cfg.rollout.group_size)
                tail = cfg.rollout.sampling.length_tail
                if tail is not None:
                    draw = random.Random(f"{cfg.trainer.seed}-{i}").lognormvariate(
                        math.log(tail.median), tail.sigma
                    )
                    task.sampling.max_new_tokens = max(1, min(sampling.max_new_tokens, round(draw)))
                with tracing.tracer().start_as_current_span(
                    "trainer.feed_task", context=Context(), kind=SpanKind.PRODUCER
                ) as span:  # the root of this task's trace
                    span.set_attributes({"treadle.run_id": cfg.run_id, "treadle.task_id": task_id})
                    tracing.inject_proto(task.trace)
                await streams.add(pipe, names.tasks_stream(cfg.run_id), task)
            pipe.sadd(names.fed_tasks(cfg.run_id), *ids)
            pipe.hset(names.run_state(cfg.run_id), "tasks_fed", upto)
            await pipe.execute()
        self._fed.update(ids)
        self.status.tasks_fed = upto

    # --- collecting -----------------------------------------------------------------------------
    def _accept(self, entry_id: str, traj: tpb.Trajectory | streams.InvalidEntry) -> None:
        """Validate one entry read from Redis: into the group buffer, or a counted drop."""
        assert self.backend is not None
        if isinstance(traj, streams.InvalidEntry):
            return self._drop(entry_id, "", "invalid_entry")
        reason = invalid_reason(traj, self.backend.vocab_size)
        if reason is None and traj.trajectory_id in self._seen:
            self.status.duplicates += 1
            reason = "duplicate"
        if reason is None and traj.group_id not in self._fed:
            if not self.config.trainer.external_groups:
                reason = "unknown_group"
        if reason is not None:
            return self._drop(entry_id, traj.trajectory_id, reason)
        self._seen.add(traj.trajectory_id)
        self.status.trajectories_consumed += 1
        self._buffer.add(Entry(entry_id, traj))

    def _drop(self, entry_id: str, trajectory_id: str, reason: str) -> None:
        self._loose_drops.append((entry_id, trajectory_id, reason))
        self.status.rejected += 1
        self._count_drop(reason)
        log.warning("trajectory dropped", entry=entry_id, reason=reason)

    async def _collect(self, num_groups: int, version: int) -> list[Group]:
        """Read until `num_groups` complete groups that are not wholly stale at `version` are
        buffered, then take them, with the wholly stale ones met on the way (the step drops
        those, counted): a stale group does not take the place of a trainable one."""
        t = self.config.trainer
        deadline = time.monotonic() + t.batch_timeout_s
        taken: list[Group] = []
        fresh = 0
        self.collecting = True
        try:
            while True:
                for group in self._buffer.take(num_groups - fresh):
                    taken.append(group)
                    fresh += any(
                        staleness(e.traj, version) <= self.max_staleness for e in group.entries
                    )
                if fresh >= num_groups:
                    return taken
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"only {fresh}/{num_groups} complete groups after {t.batch_timeout_s}s"
                    )
                await self._read(block_ms=1000)
        finally:
            self.collecting = False

    async def _read(self, block_ms: int | None) -> int:
        """Read new trajectories into the buffer (or counted drops); how many were read."""
        batch = await streams.read_group(
            self.r,
            [self._stream],
            names.TRAINER_GROUP,
            self.consumer,
            tpb.Trajectory,
            count=max(self.config.trainer.tasks_per_step * self.config.rollout.group_size, 64),
            block_ms=block_ms,
        )
        for _, entry_id, traj in batch:
            self._accept(entry_id, traj)
        if batch:
            self.read_stage.tick(len(batch))
        return len(batch)

    async def _end_feeding(self, version: int) -> None:
        """After the last step: cancel the fed tasks no replica started, let the groups in
        flight land, and drop every trajectory no step used as `run_ended`. The final
        checkpoint acks them with the run's last ledger entry, so the run ends with nothing
        pending and every produced trajectory accounted for once."""
        run = self.config.run_id
        tasks = names.tasks_stream(run)
        await admission.close(self.r, run)
        await streams.ensure_group(self.r, tasks, names.ROLLOUT_GROUP)
        while unread := await streams.read_group(
            self.r,
            [tasks],
            names.ROLLOUT_GROUP,
            f"{self.consumer}-end",
            task_pb2.Task,
            count=1000,
            block_ms=None,
        ):
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.xack(tasks, names.ROLLOUT_GROUP, *[entry for _, entry, _ in unread])
                pipe.hincrby(names.run_state(run), "tasks_cancelled", len(unread))
                await pipe.execute()
        deadline = time.monotonic() + self.config.trainer.batch_timeout_s
        while int((await self.r.xpending(tasks, names.ROLLOUT_GROUP))["pending"]) > 0:
            if time.monotonic() > deadline:
                log.warning("run end: tasks still in flight on rollout are left pending", run=run)
                break
            await self._read(block_ms=200)
        while await self._read(block_ms=None):
            pass
        unused = self._buffer.take_all()
        dropped = {e.traj.trajectory_id: "run_ended" for g in unused for e in g.entries}
        for reason in dropped.values():
            self._count_drop(reason)
        loose, self._loose_drops = self._loose_drops, []
        dropped.update({tid or entry: reason for entry, tid, reason in loose})
        entries = [e.entry_id for g in unused for e in g.entries] + [e for e, _, _ in loose]
        if entries:
            self._uncommitted.append(
                {
                    "step": self.status.step,
                    "kind": "run_end",
                    "version": version,
                    "entries": entries,
                    "trained": [],
                    "dropped": dropped,
                }
            )

    # --- one step -------------------------------------------------------------------------------
    async def _step(
        self, step: int, groups: list[Group], version: int, started: float, wait_s: float
    ) -> int:
        assert self.backend is not None
        t = self.config.trainer
        run = self.config.run_id
        data: list[Datum] = []
        trained: list[str] = []
        dropped: dict[str, str] = {}
        groups = in_feed_order(groups)
        entries = [e.entry_id for g in groups for e in g.entries]
        rewards = [
            e.traj.reward
            for g in groups
            for e in g.entries
            if e.traj.status in (tpb.TRAJECTORY_STATUS_OK, tpb.TRAJECTORY_STATUS_TRUNCATED)
        ]
        stale: list[int] = []
        for group in groups:
            kept = []
            for e in group.entries:
                reason = drop_reason(e.traj, version, self.max_staleness)
                if reason is None:
                    kept.append(e.traj)
                else:
                    dropped[e.traj.trajectory_id] = reason
            if kept and t.drop_constant_reward_groups and is_constant(kept):
                dropped.update({k.trajectory_id: "constant_reward" for k in kept})
                kept = []
            for traj, adv in zip(kept, group_advantages(kept, t.advantage), strict=True):
                data.append(Datum.from_trajectory(traj, adv))
                trained.append(traj.trajectory_id)
                stale.append(staleness(traj, version))
        for reason in dropped.values():
            self._count_drop(reason)
        train_start = time.perf_counter()
        with self.step_stage.track():
            stats = await on_torch_thread(self._train, data)
        train_s = time.perf_counter() - train_start
        publish_start = time.perf_counter()
        version = self._v0 + step
        if self._publishes(step):
            state = await on_torch_thread(self.backend.snapshot_cpu)
            await self.publisher.submit(Snapshot(step, version, state))
            if self.config.mode == "sync":  # the next batch is generated with these weights
                await self.publisher.wait_for(version)
        publish_s = time.perf_counter() - publish_start
        self.status.trajectories_trained += len(trained)
        loose, self._loose_drops = self._loose_drops, []
        entries += [entry for entry, _, _ in loose]
        dropped.update({tid or entry: reason for entry, tid, reason in loose})
        self._uncommitted.append(
            {
                "step": step,
                "kind": "step",
                "version": version,
                "entries": entries,
                "trained": trained,
                "dropped": dropped,
            }
        )
        duration = time.perf_counter() - started
        self._trace_step(groups, step, version, train_start, duration - (train_start - started))
        record = StepRecord(
            step=step,
            version=version,
            num_trajectories=len(trained),
            mean_reward=statistics.fmean(rewards) if rewards else 0.0,
            reward_std=statistics.pstdev(rewards) if rewards else 0.0,
            max_staleness=max(stale, default=0),
            wait_for_batch_s=wait_s,
            train_s=train_s,
            publish_s=publish_s,
            duration_s=duration,
            tokens_per_s=stats.get("num_tokens", 0.0) / duration if duration else 0.0,
            finished_at=time.time(),
            **stats,
        )
        self.status.step = step
        self.status.steps.append(record)
        if self._publishes(step):
            self._records[step] = record
            self._record_publish(step)
        self._observe(record, stale)
        log.info("step", run=run, **record.model_dump())
        return version

    def _trace_step(
        self, groups: list[Group], step: int, version: int, train_start: float, train_s: float
    ) -> None:
        """In each trajectory's trace: its wait in the queue and the step that consumed it."""
        tracer = tracing.tracer()
        now, mono = time.time(), time.perf_counter()
        start = now - (mono - train_start)
        for group in groups:
            for e in group.entries:
                if not tracing.recorded(e.traj.trace.traceparent):
                    continue  # not a recorded trace: no spans to add
                parent = tracing.from_proto(e.traj.trace)
                queued_at = int(e.entry_id.split("-")[0]) / 1000  # the stream entry's XADD time
                tracer.start_span(
                    "trainer.queued", context=parent, start_time=tracing.ns(queued_at)
                ).end(end_time=tracing.ns(start))
                span = tracer.start_span(
                    "trainer.step", context=parent, start_time=tracing.ns(start)
                )
                span.set_attributes(
                    {"treadle.step": step, "treadle.version": version, "treadle.entry": e.entry_id}
                )
                span.end(end_time=tracing.ns(start + train_s))

    def _train(self, data: list[Datum]) -> dict[str, float]:
        assert self.backend is not None
        t = self.config.trainer
        stats = train_batch(
            self.backend, data, t, self.loss_params, self.adam, self.status.step + 1
        )
        fields = set(StepRecord.model_fields)
        return {k: v for k, v in stats.items() if k in fields}

    def _observe(self, record: StepRecord, stale: list[int]) -> None:
        run = self.config.run_id
        values = record.model_dump()
        values["reward_mean"], values["policy_version"] = record.mean_reward, record.version
        for name, gauge in tm.STEP_GAUGES.items():
            gauge.labels(run).set(values.get(name, 0.0))
        for s in stale:
            tm.STALENESS.labels(run).observe(s)
        tm.WAIT_FOR_BATCH.labels(run).observe(record.wait_for_batch_s)
        tm.STEP_SECONDS.labels(run).observe(record.duration_s)
        tm.TOKENS.labels(run).inc(record.num_tokens)

    # --- publishing ---------------------------------------------------------------------------
    def _publishes(self, step: int) -> bool:
        t = self.config.trainer
        return step % t.publish_every == 0 or step == t.num_steps

    async def _publish(self, step: int, version: int = -1) -> int:
        """Publish the weights now (the base and restored weights: the next free version)."""
        assert self.backend is not None
        state = await on_torch_thread(self.backend.state_dict_cpu)
        response = await self._send(state, step, version)
        self.status.versions.append(response.version)
        return response.version

    async def _send(self, state: dict, step: int, version: int):
        response = await self.store.publish(
            self.config.model.name,
            state_dict_to_raw(state),
            version=version,
            trainer_step=step,
            parent_version=self.status.versions[-1] if self.status.versions else -1,
            assets=self._assets,
            metadata={"run_id": self.config.run_id},
        )
        if version >= 0 and response.version != version:
            raise RuntimeError(f"published version {response.version}, wanted {version}")
        return response

    async def _publish_snapshot(self, snapshot: Snapshot) -> int:
        """The background publisher's work: one step's weights as version V0 + step."""
        with tracing.tracer().start_as_current_span("trainer.publish", context=Context()) as span:
            span.set_attributes(
                {"treadle.step": snapshot.step, "treadle.version": snapshot.version}
            )
            response = await self._send(snapshot.state, snapshot.step, snapshot.version)
        return response.bytes_received

    def _published(self, done: Published) -> None:
        self.status.versions.append(done.version)
        self.status.publishes_coalesced = self.publisher.coalesced
        self._publish_done[done.step] = done
        self._record_publish(done.step)
        for step in [s for s in self._records if s < done.step]:  # coalesced: never published
            del self._records[step]
        tm.PUBLISH_SECONDS.labels(self.config.run_id).observe(done.publish_s)

    def _record_publish(self, step: int) -> None:
        """Fill in the step record's publish once both the record and the publish exist."""
        record, done = self._records.get(step), self._publish_done.get(step)
        if record is None or done is None:
            return
        record.published = True
        record.publish_duration_s = done.publish_s
        record.publish_latency_s = done.latency_s
        record.bytes_published = done.bytes_sent
        del self._records[step], self._publish_done[step]

    # --- checkpoint and commit ------------------------------------------------------------------
    async def _checkpoint(self, version: int) -> None:
        """Checkpoint, then ack and ledger every entry of the steps since the last one."""
        assert self.backend is not None
        run, step = self.config.run_id, self.status.step
        started = time.perf_counter()
        await self.publisher.flush()  # the checkpoint's versions are all in the store
        path = (self.run_dir / "checkpoints" / f"step-{step:06d}").resolve()
        acked = sum(len(s["entries"]) for s in self._uncommitted)
        self.status.checkpoint_step = step
        self.status.trajectories_acked += acked
        # buffered (read, not yet trained) entries stay pending: a restored owner re-reads them
        buffered = self._buffer.trajectory_ids()
        run_state = self.status.model_dump(mode="json")
        run_state["trajectories_consumed"] -= len(buffered)
        meta = {
            "run": run_state,
            "seen": sorted(self._seen - buffered),
            "version": version,
            "model": self.config.model.name,
        }
        await on_torch_thread(self.backend.save, path, meta)
        async with self.r.pipeline(transaction=True) as pipe:
            for s in self._uncommitted:
                if s["entries"]:
                    pipe.xack(self._stream, names.TRAINER_GROUP, *s["entries"])
                pipe.xadd(
                    names.ledger_stream(run),
                    {
                        "step": s["step"],
                        "kind": s["kind"],
                        "version": s["version"],
                        "checkpoint": str(path),
                        "trained": json.dumps(s["trained"]),
                        "dropped": json.dumps(s["dropped"]),
                    },
                )
            pipe.hset(
                names.run_state(run),
                mapping={"checkpoint_step": step, "checkpoint_path": str(path)},
            )
            await pipe.execute()
        self._uncommitted.clear()
        old = sorted((self.run_dir / "checkpoints").glob("step-*"))[:-KEEP_CHECKPOINTS]
        for stale_dir in old:
            shutil.rmtree(stale_dir, ignore_errors=True)
        tm.CHECKPOINT_SECONDS.labels(run).observe(time.perf_counter() - started)

    def _count_drop(self, reason: str) -> None:
        self._dropped[reason] += 1
        metrics.DROPPED.labels(SERVICE, "trajectory", reason).inc()
        self.status.dropped = dict(self._dropped)

    async def _final_counts(self) -> None:
        state = await self.r.hgetall(names.run_state(self.config.run_id))
        self.status.trajectories_produced = int(state.get(b"trajectories_produced", 0))
        self.status.tasks_cancelled = int(state.get(b"tasks_cancelled", 0))
        try:
            pending = await self.r.xpending(self._stream, names.TRAINER_GROUP)
            self.status.pending_after_run = int(pending["pending"])
        except Exception:  # the stream never existed (the run failed early)
            self.status.pending_after_run = None
