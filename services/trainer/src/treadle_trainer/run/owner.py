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
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.api.runs import FINAL_STATES, RunState, RunStatus
from treadle_common.clients import streams
from treadle_common.clients.env import EnvClient
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config.recipe import RunConfig
from treadle_common.fleet import admission, scheduling
from treadle_common.runtime.logs import get_logger
from treadle_common.runtime.progress import Stage
from treadle_trainer.backends import (
    BackendSpec,
    TorchBackend,
    build_backend,
    on_torch_thread,
)
from treadle_trainer.backends.lora import LoraBackend
from treadle_trainer.batches import Group
from treadle_trainer.run import claims
from treadle_trainer.run.checkpoints import RunCheckpoints
from treadle_trainer.run.collector import Collector, Stopping
from treadle_trainer.run.feeder import Feeder, task_source
from treadle_trainer.run.lease import Lease
from treadle_trainer.run.ledger import Drops, Ledger
from treadle_trainer.run.publishing import RunVersions, initial_model_dir
from treadle_trainer.run.status_store import StatusStore, verdict
from treadle_trainer.run.step import EvaluationHold
from treadle_trainer.run.stepping import RunStepper, StepTiming
from treadle_trainer.schedule import header_for, write_header
from treadle_trainer.tracking import RunTracking

log = get_logger(__name__)


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
        publish_worker: str = "auto",
    ):
        read_stage, step_stage = stages or (
            Stage("trainer", "trajectories"),
            Stage("trainer", "step"),
        )
        self.config, self.r, self.store, self.env = config, r, store, env
        self.lease = lease
        self.lost = False  # another trainer took the run over (set by whoever renews the lease)
        self.handing_off = False
        self.status = RunStatus(run_id=config.run_id, tenant=tenant)
        self.store_status = StatusStore(r, lease, self.status, retention_s)
        self.backend: TorchBackend | None = None
        self.run_dir = config.output_dir / config.run_id
        self.ledger = Ledger(r, config.run_id, lease)
        self.drops = Drops(self.status)
        self.feeder = Feeder(config, r, self.status, lease)
        parts = (self.status, self.ledger, self.drops, self.feeder.fed)
        self.collector = Collector(config, r, consumer, *parts, read_stage, lease)
        self.versions = RunVersions(config, store, self.status)
        self.publish_worker = publish_worker  # `trainer_publish_worker`
        owned = (self.feeder, self.collector, self.ledger, self.drops, self.versions)
        self.checkpoints = RunCheckpoints(config, r, lease, self.status, owned)
        self.holds = EvaluationHold(config)
        self.tracking = RunTracking(config)  # W&B, MLflow, TensorBoard (`logging.trackers`)
        self._v0 = 0  # the version before step 1: step s publishes version V0 + s
        self.stepper = RunStepper(
            config,
            self.status,
            (self.versions, self.ledger, self.drops),
            turns or scheduling.FairTurns(scheduling.Fifo()),
            step_stage,
        )

    @property
    def max_staleness(self) -> int:
        return self.stepper.max_staleness

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
            await self.store_status.save()
            await self._execute()
            finished = self.status.step >= self.config.trainer.num_steps
            outcome = "succeeded" if finished else "handed_off"
        except (asyncio.CancelledError, Exception) as exc:
            ended = verdict(exc, self.config.run_id, self.lost, last_attempt)
            if ended is None:
                raise
            outcome, self.status.error = ended
        finally:
            await self.versions.close()
            if outcome in FINAL_STATES:
                try:
                    outcome = await self._end(outcome)
                except Exception as exc:  # Redis away at the very end: resume, then end
                    log.warning("ending the run failed", run=self.config.run_id, error=repr(exc))
                    self.status.error = self.status.error or f"ending the run failed: {exc!r}"
                    outcome = "failed" if last_attempt else "retrying"
            self.status.state = outcome
            await self.tracking.finish(self.status, outcome)
            if self.backend is not None:
                await on_torch_thread(self.backend.close)
        return self.status

    async def _end(self, outcome: RunState) -> RunState:
        """The run is over: its final counts and state, unless another trainer owns it."""
        await self._final_counts()  # before the final state: readers see complete counts
        return await self.store_status.end(outcome)

    # --- setup and restore -----------------------------------------------------------------------
    async def _execute(self) -> None:
        source, version = await self._prepare()
        version = await self._train(source, version)
        if self.handing_off and self.status.step < self.config.trainer.num_steps:
            if self.ledger.uncommitted or self.status.checkpoint_step < self.status.step:
                await self._checkpoint(version)
            await self.versions.publisher.flush()
            log.info("run handed off", run=self.config.run_id, step=self.status.step)
            return
        await admission.close(self.r, self.config.run_id)
        await self.collector.finish(self.feeder, self.status.step, version)
        if self.ledger.uncommitted or self.status.checkpoint_step < self.status.step:
            await self._checkpoint(version)
        await self.versions.publisher.flush()  # the run's last weights are in the store

    async def _prepare(self) -> tuple[Any, int]:
        """The backend (restored from the last checkpoint, if any), the task source, the first
        version published, admission configured and the run joined to the fleet: (the task
        source, the version rollout generates with)."""
        cfg, t = self.config, self.config.trainer
        model_dir = await initial_model_dir(cfg, self.store, self.run_dir)
        spec = BackendSpec.of(t, str(model_dir))
        self.backend = backend = await on_torch_thread(build_backend, spec)
        log.info("backend ready", run=cfg.run_id, **backend.layout_info())
        self.versions.choose_sender(self.publish_worker, backend.device)
        await asyncio.to_thread(write_header, self.run_dir, header_for(cfg, model_dir))
        self.collector.vocab_size = backend.vocab_size
        count = (t.num_steps + self.max_staleness) * t.tasks_per_step
        source = await task_source(cfg, self.env, count)
        await streams.ensure_group(self.r, self.collector.stream, names.TRAINER_GROUP)
        await self.r.set(names.run_config(cfg.run_id), cfg.model_dump_json())
        version = await self._first_version(backend)
        self.tracking.start(resumed=self.status.step > 0)
        self._v0 = version - self.status.step
        await claims.join(self.r, cfg, self.status.tenant, self._v0, self.max_staleness)
        await self.collector.replay_pending()
        return source, version

    async def _first_version(self, backend: TorchBackend) -> int:
        """The version the run starts from: the restored step's, published again (rollout goes
        back to it), or the base's (an adapter's: the new adapter, B = 0)."""
        restored = await self.checkpoints.restore(backend)
        if restored:
            self.store_status.steps_saved = len(self.status.steps)  # the last owner wrote these
        if isinstance(backend, LoraBackend):  # versions are adapters on a full base
            await self.versions.adapter_base(backend, self.r)
        if restored:
            return await self._publish_now(step=self.status.step)
        state = await on_torch_thread(backend.state_dict_cpu)
        if isinstance(backend, LoraBackend):  # the new adapter (B = 0: the base)
            version = await self.versions.publish_now(state, step=0)
        else:
            version = await self.versions.base_version(state)
        self.status.base_version = version
        return version

    async def _train(self, source, version: int) -> int:
        """Steps until the last, or until the run is handed off: the last version published."""
        cfg, t = self.config, self.config.trainer
        served = version  # what rollout generates the next batch with (sync: must hold)
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
            feed_next: Callable[[], Awaitable[int]] | None = None
            if step == t.num_steps:
                await admission.close(self.r, cfg.run_id)  # no later group would be trained
            elif self._feeds_next(step):
                # the next step's tasks, demanding this step's weights: rollout reads them
                # while they are published and generates as soon as the store has them
                feed_next = functools.partial(
                    self._feed, source, (step + 1) * t.tasks_per_step, self._v0 + step
                )
            version = await self._step(step, groups, version, started, wait_s, feed_next)
            self.tracking.step(self.status.steps[-1])
            if self.versions.publishes(step):
                served = version
            await self.store_status.save()
            if step % t.checkpoint_every == 0 and step < t.num_steps:
                await self._checkpoint(version)
            await self.holds.wait(step)
        return version

    async def _feed(self, source, upto: int, version: int) -> int:
        return await self.feeder.feed(source, upto, version if self.max_staleness == 0 else 0)

    def _feeds_next(self, step: int) -> bool:
        """A sync run feeds step + 1's tasks before `step`'s weights are published (they wait
        in rollout for that version): while they are published, or with `trainer.feed_ahead`
        before `step` trains. Not when an evaluation of `step`'s weights comes first: nothing
        may generate beside it."""
        return (
            self.max_staleness == 0 and self.versions.publishes(step) and not self.holds.after(step)
        )

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
        feed_next: Callable[[], Awaitable[int]] | None = None,
    ) -> int:
        assert self.backend is not None
        timing = StepTiming(step, version, started, wait_s)
        return await self.stepper.step(self.backend, groups, timing, self._v0, feed_next)

    async def _checkpoint(self, version: int) -> None:
        assert self.backend is not None
        await self.checkpoints.save(self.backend, version)

    # --- run end --------------------------------------------------------------------------------
    async def _final_counts(self) -> None:
        state = await self.r.hgetall(names.run_state(self.config.run_id))
        self.status.trajectories_produced = int(state.get(b"trajectories_produced", 0))
        await self.feeder.refresh()
        try:
            pending = await self.r.xpending(self.collector.stream, names.TRAINER_GROUP)
            self.status.pending_after_run = int(pending["pending"])
        except Exception:  # the stream never existed (the run failed early)
            self.status.pending_after_run = None
