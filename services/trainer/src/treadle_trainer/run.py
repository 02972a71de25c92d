"""Run ownership: feed tasks, consume trajectories, train, publish, count everything.

    env-gateway SampleTasks --> tasks --XADD--> treadle:{run}:tasks  (min_policy_version = current)
    treadle:{run}:trajectories --XREADGROUP (group `trainer`)--> filter (status, staleness)
        --> GRPO advantages --> loss --> optimizer step
        --> publish the new weights to the weight-store (delta) --> it announces on NATS
        --> XACK the step's trajectories

Every trajectory read is counted exactly once as consumed; duplicates and drops are counted
with their reasons. (Checkpointing before the ack arrives with the trainer issue.)
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from treadle_common import metrics, names
from treadle_common.clients import streams
from treadle_common.clients.env import EnvClient
from treadle_common.clients.torch_weights import model_assets, state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient, build_manifest, chunk_positions
from treadle_common.config import RunConfig
from treadle_common.logs import get_logger
from treadle_common.proto.treadle.v1 import common_pb2, task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_trainer.batches import drop_reason, grpo_advantages, staleness, to_tensors
from treadle_trainer.policy import TorchPolicy

log = get_logger(__name__)
SERVICE = "trainer"


class StepRecord(BaseModel):
    step: int
    version: int
    mean_reward: float
    num_trajectories: int
    max_staleness: int
    loss: float
    grad_norm: float
    publish_s: float
    bytes_published: int
    duration_s: float


class RunStatus(BaseModel):
    run_id: str
    state: str = Field("pending", description="pending | running | succeeded | failed")
    error: str | None = None
    step: int = 0
    base_version: int | None = None
    versions: list[int] = Field(default_factory=list)
    tasks_fed: int = 0
    trajectories_produced: int = 0
    trajectories_consumed: int = 0
    trajectories_trained: int = 0
    trajectories_acked: int = 0
    duplicates: int = 0
    dropped: dict[str, int] = Field(default_factory=dict)
    pending_after_run: int | None = None
    steps: list[StepRecord] = Field(default_factory=list)


class RunOwner:
    def __init__(
        self,
        config: RunConfig,
        r: aioredis.Redis,
        store: WeightStoreClient,
        env: EnvClient,
        consumer: str,
    ):
        self.config = config
        self.r = r
        self.store = store
        self.env = env
        self.consumer = consumer
        self.status = RunStatus(run_id=config.run_id)
        self._seen: set[str] = set()
        self._dropped: Counter[str] = Counter()
        self._last_publish_bytes = 0
        self._assets = model_assets(config.model.path)  # config + tokenizer travel with weights

    @property
    def max_staleness(self) -> int:
        return 0 if self.config.mode == "sync" else self.config.trainer.max_staleness

    async def execute(self) -> RunStatus:
        self.status.state = "running"
        try:
            await self._execute()
            self.status.state = "succeeded"
        except Exception as exc:
            self.status.state, self.status.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("run failed", run=self.config.run_id, error=self.status.error)
        finally:
            await self.r.srem(names.RUNS_KEY, self.config.run_id)
            await self._final_counts()
        return self.status

    async def _execute(self) -> None:
        cfg = self.config
        policy = await asyncio.to_thread(
            TorchPolicy, cfg.model.path, cfg.trainer.lr, cfg.trainer.loss, cfg.trainer.seed
        )
        traj_stream = names.trajectories_stream(cfg.run_id)
        await streams.ensure_group(self.r, traj_stream, names.TRAINER_GROUP)
        version = await self._base_version(policy)
        self.status.base_version = version
        tasks = await self.env.sample_tasks(
            cfg.env.name,
            cfg.trainer.num_steps * cfg.trainer.tasks_per_step,
            seed=cfg.trainer.seed,
            options=cfg.env.options,
        )
        await self.r.sadd(names.RUNS_KEY, cfg.run_id)
        for step in range(1, cfg.trainer.num_steps + 1):
            started = time.perf_counter()
            chunk = tasks[
                (step - 1) * cfg.trainer.tasks_per_step : step * cfg.trainer.tasks_per_step
            ]
            await self._feed(chunk, version)
            entries = await self._collect(traj_stream, len(chunk) * cfg.rollout.group_size)
            trainable = self._filter([t for _, t in entries], version)
            stats = await asyncio.to_thread(self._train, policy, trainable)
            publish_start = time.perf_counter()
            version = await self._publish(policy, step=step)
            publish_s = time.perf_counter() - publish_start
            await self.r.xack(traj_stream, names.TRAINER_GROUP, *[eid for eid, _ in entries])
            self.status.trajectories_acked += len(entries)
            self.status.step = step
            rewards = [
                t.reward
                for _, t in entries
                if t.status in (tpb.TRAJECTORY_STATUS_OK, tpb.TRAJECTORY_STATUS_TRUNCATED)
            ]
            record = StepRecord(
                step=step,
                version=version,
                num_trajectories=len(trainable),
                mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
                max_staleness=max((staleness(t, version - 1) for t in trainable), default=0),
                publish_s=publish_s,
                bytes_published=self._last_publish_bytes,
                duration_s=time.perf_counter() - started,
                **stats,
            )
            self.status.steps.append(record)
            log.info("step", **record.model_dump())

    def _train(self, policy: TorchPolicy, trainable: list[tpb.Trajectory]) -> dict[str, float]:
        if not trainable:
            return {"loss": 0.0, "grad_norm": 0.0}
        batch = to_tensors(trainable, grpo_advantages(trainable), policy.pad_id)
        stats = policy.train_step(batch)
        self.status.trajectories_trained += len(trainable)
        return {"loss": stats["loss"], "grad_norm": stats["grad_norm"]}

    async def _base_version(self, policy: TorchPolicy) -> int:
        """The version rollout must hold before generating for step 1.

        0 (the model directory itself) when the store has no version of this model; the
        latest version when it already holds exactly our initial weights; otherwise our
        initial weights are published as a new version.
        """
        versions = await self.store.list_versions(self.config.model.name)
        if not versions:
            return 0
        latest = await self.store.get_manifest(self.config.model.name, versions[-1].version)
        ours, _ = build_manifest(self.config.model.name, state_dict_to_raw(policy.state_dict_cpu()))
        if chunk_positions(latest) == chunk_positions(ours):
            return latest.version
        return await self._publish(policy, step=0)

    async def _publish(self, policy: TorchPolicy, step: int) -> int:
        state = policy.state_dict_cpu()
        response = await self.store.publish(
            self.config.model.name,
            state_dict_to_raw(state),
            trainer_step=step,
            parent_version=self.status.versions[-1] if self.status.versions else -1,
            assets=self._assets,
            metadata={"run_id": self.config.run_id},
        )
        self._last_publish_bytes = response.bytes_received
        self.status.versions.append(response.version)
        return response.version

    async def _feed(self, tasks: list[dict[str, Any]], min_version: int) -> None:
        cfg = self.config
        sampling = common_pb2.SamplingParams(
            temperature=cfg.rollout.sampling.temperature,
            top_p=cfg.rollout.sampling.top_p,
            max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        )
        async with self.r.pipeline(transaction=True) as pipe:
            for payload in tasks:
                task = task_pb2.Task(
                    task_id=uuid.uuid4().hex,
                    run_id=cfg.run_id,
                    env=cfg.env.name,
                    payload_json=json.dumps(payload),
                    group_size=cfg.rollout.group_size,
                    max_turns=cfg.rollout.max_turns,
                    sampling=sampling,
                    scorer=cfg.scorer,
                    model=cfg.model.name,
                    min_policy_version=min_version,
                    created_at=time.time(),
                )
                await streams.add(pipe, names.tasks_stream(cfg.run_id), task)
            pipe.hincrby(names.run_state(cfg.run_id), "tasks_fed", len(tasks))
            await pipe.execute()
        self.status.tasks_fed += len(tasks)

    async def _collect(self, stream: str, needed: int) -> list[tuple[str, tpb.Trajectory]]:
        """Read until `needed` distinct trajectories arrived; duplicates are counted and acked."""
        out: list[tuple[str, tpb.Trajectory]] = []
        deadline = time.monotonic() + self.config.trainer.batch_timeout_s
        while len(out) < needed:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(out)}/{needed} trajectories after "
                    f"{self.config.trainer.batch_timeout_s}s"
                )
            batch = await streams.read_group(
                self.r,
                [stream],
                names.TRAINER_GROUP,
                self.consumer,
                tpb.Trajectory,
                count=needed - len(out),
                block_ms=1000,
            )
            for _, entry_id, traj in batch:
                if isinstance(traj, streams.InvalidEntry):
                    self._count_drop("invalid_entry")
                    log.warning("invalid trajectory acked", entry=entry_id, reason=traj.reason)
                    await self.r.xack(stream, names.TRAINER_GROUP, entry_id)
                    continue
                if traj.trajectory_id in self._seen:
                    self.status.duplicates += 1
                    await self.r.xack(stream, names.TRAINER_GROUP, entry_id)
                    continue
                self._seen.add(traj.trajectory_id)
                self.status.trajectories_consumed += 1
                out.append((entry_id, traj))
        return out

    def _filter(self, trajs: list[tpb.Trajectory], version: int) -> list[tpb.Trajectory]:
        kept = []
        for t in trajs:
            reason = drop_reason(t, version, self.max_staleness)
            if reason is None:
                kept.append(t)
                continue
            self._count_drop(reason)
        return kept

    def _count_drop(self, reason: str) -> None:
        self._dropped[reason] += 1
        metrics.DROPPED.labels(SERVICE, "trajectory", reason).inc()
        self.status.dropped = dict(self._dropped)

    async def _final_counts(self) -> None:
        state = await self.r.hgetall(names.run_state(self.config.run_id))
        self.status.trajectories_produced = int(state.get(b"trajectories_produced", 0))
        stream = names.trajectories_stream(self.config.run_id)
        try:
            pending = await self.r.xpending(stream, names.TRAINER_GROUP)
            self.status.pending_after_run = int(pending["pending"])
        except Exception:  # the stream never existed (the run failed early)
            self.status.pending_after_run = None
