"""One step of a run, end to end: its batch (`step.py`), a turn on the trainer's torch lanes
(`scheduling.FairTurns`, shared with the process's other runs), training, the weights to the
background publisher (a sync run waits for them), the ledger entry and the step's record.

    groups --> build_batch --> drops counted --> [turn] train_batch --> snapshot -->
    publisher (sync: committed) --> ledger entry --> StepRecord (status, usage, metrics)
    --> the step in the run's schedule (`schedule.py`, what `treadle replay` re-runs)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from treadle_common.api.runs import RunStatus
from treadle_common.config.recipe import RunConfig
from treadle_common.fleet import scheduling
from treadle_common.proto.treadle.v1 import schedule_pb2
from treadle_common.runtime.progress import Stage
from treadle_trainer.backends import AdamParams, TorchBackend, on_torch_thread
from treadle_trainer.batches import Datum, Group
from treadle_trainer.losses import LossParams
from treadle_trainer.profiling import profiled
from treadle_trainer.publisher import Snapshot
from treadle_trainer.run.ledger import Drops, Ledger, LedgerEntry
from treadle_trainer.run.publishing import RunVersions
from treadle_trainer.run.step import Batch, build_batch, observe, step_record, trace_step
from treadle_trainer.schedule import recorded_groups, weights_digest, write_step
from treadle_trainer.train import train_batch


@dataclass
class StepTiming:
    step: int
    version: int
    """The version the step's batch is judged against (its staleness)."""
    started: float
    """perf_counter when the step began waiting for its batch."""
    wait_s: float


def step_params(config: RunConfig) -> tuple[LossParams, AdamParams]:
    """The loss's and the optimizer's parameters of a run's steps (a replay's too)."""
    t = config.trainer
    loss = LossParams(
        clip_low=t.clip_low,
        clip_high=t.clip_high,
        is_cap=t.is_cap,
        off_policy=t.off_policy,
        kl_coef=t.kl_coef,
        temperature=config.rollout.sampling.temperature or 1.0,  # 0 = greedy: plain logits
    )
    return loss, AdamParams(learning_rate=t.lr, max_grad_norm=t.max_grad_norm)


class RunStepper:
    def __init__(
        self,
        config: RunConfig,
        status: RunStatus,
        parts: tuple[RunVersions, Ledger, Drops],
        turns: scheduling.FairTurns,
        stage: Stage,
    ):
        self.config, self.status = config, status
        self.versions, self.ledger, self.drops = parts
        self.turns = turns
        """The trainer process's torch lanes, shared with its other runs' steps."""
        self.claim = scheduling.Claim(
            config.run_id, config.scheduling.weight, config.scheduling.priority
        )
        self.stage = stage
        self.run_dir = config.output_dir / config.run_id
        self.loss_params, self.adam = step_params(config)

    @property
    def max_staleness(self) -> int:
        t = self.config.trainer
        # sync: a batch is generated with the last published version, up to K - 1 steps old
        return t.publish_every - 1 if self.config.mode == "sync" else t.max_staleness

    async def step(
        self,
        backend: TorchBackend,
        groups: list[Group],
        at: StepTiming,
        v0: int,
        feed_next: Callable[[], Awaitable[int]] | None = None,
    ) -> int:
        """Train step `at.step` on `groups` and publish its weights (version `v0` + step);
        `feed_next` feeds the next step's tasks meanwhile (before training with
        `trainer.feed_ahead`, else after). The version published."""
        step, version = at.step, at.version
        batch = build_batch(groups, version, self.max_staleness, self.config.trainer)
        for reason in batch.dropped.values():
            self.drops.count(reason)
        feeding: asyncio.Future[int] | None = None
        if feed_next is not None and self.config.trainer.feed_ahead:
            feeding = asyncio.ensure_future(feed_next())
        try:
            if backend.device == "cpu":
                # a publish still in flight (async) finishes first: on the CPU it takes the
                # cores and the GIL from training, which then ran 75 % slower on the 2-core dev
                # VM (`treadle bench step`); on a GPU they overlap
                await self.versions.publisher.flush()
            async with self.turns.turn(self.claim):  # runs share the torch lanes fairly
                train_start = time.perf_counter()
                with self.stage.track():
                    stats, rng = await on_torch_thread(self._train, backend, batch.data)
                train_s = time.perf_counter() - train_start
            publish_start = time.perf_counter()
            if feed_next is not None and feeding is None:
                feeding = asyncio.ensure_future(feed_next())
            version = v0 + step
            if self.versions.publishes(step):
                state = await on_torch_thread(backend.snapshot_cpu)
                # a sync run's next batch is generated with these weights: it waits for them
                await self.versions.submit(
                    Snapshot(step, version, state), wait=self.config.mode == "sync"
                )
            publish_s = time.perf_counter() - publish_start
        finally:
            if feeding is not None:
                await feeding
        self._account(batch, at, version, stats, (train_start, train_s, publish_s))
        await self._record(backend, batch, at, stats, rng)
        return version

    async def _record(
        self, backend: TorchBackend, batch: Batch, at: StepTiming, stats: dict, rng: bytes
    ) -> None:
        """The step in the run's schedule (`schedule.py`), with the weights' digest at
        checkpoints and at the last step."""
        t = self.config.trainer
        digest = ""
        if at.step % t.checkpoint_every == 0 or at.step == t.num_steps:
            digest = await on_torch_thread(lambda: weights_digest(backend.state_dict_cpu()))
        record = schedule_pb2.ScheduleStep(
            step=at.step,
            version=at.version,
            max_staleness=self.max_staleness,
            groups=recorded_groups(batch.groups),
            torch_rng_state=rng,
            stats={k: float(v) for k, v in stats.items() if isinstance(v, (int, float))},
            weights_sha256=digest,
            trained=batch.trained,
        )
        await asyncio.to_thread(write_step, self.run_dir, record)

    def _account(
        self,
        batch: Batch,
        at: StepTiming,
        version: int,
        stats: dict[str, float],
        times: tuple[float, float, float],
    ) -> None:
        """A trained step in the ledger, the run's status and usage, its trace and metrics;
        `times`: when training started, its seconds, the publish's seconds."""
        step = at.step
        train_start, train_s, publish_s = times
        self.status.trajectories_trained += len(batch.trained)
        self.ledger.add(
            LedgerEntry(step, "step", version, batch.entries, batch.trained, batch.dropped)
        )
        duration = time.perf_counter() - at.started
        trace_step(batch, step, version, train_start, duration - (train_start - at.started))
        timings = {
            "wait_for_batch_s": at.wait_s,
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

    def _train(self, backend: TorchBackend, data: list[Datum]) -> tuple[dict[str, float], bytes]:
        """What training returned, and the torch RNG state it started from (recorded)."""
        t = self.config.trainer
        step = self.status.step + 1
        rng = torch.get_rng_state().numpy().tobytes()
        if step not in t.profile_steps:
            return train_batch(backend, data, t, self.loss_params, self.adam, step), rng
        with profiled(self.run_dir / "profile", step, backend.device):
            return train_batch(backend, data, t, self.loss_params, self.adam, step), rng
