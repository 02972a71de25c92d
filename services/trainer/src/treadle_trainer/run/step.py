"""What one training step makes of its groups, and what it reports.

    groups (feed order) --> staleness / status drops, constant-reward groups dropped
        --> advantages per group --> data (the trainer's `Datum`s)

Also the step's spans in each recorded trajectory's trace and its Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from treadle_common.api.runs import RATIO_EDGES, StepRecord
from treadle_common.config.recipe import RunConfig, TrainerConfig
from treadle_common.runtime import tracing
from treadle_common.runtime.logs import get_logger
from treadle_trainer import consistency
from treadle_trainer import metrics as tm
from treadle_trainer.batches import (
    TRAINABLE,
    Datum,
    Group,
    drop_reason,
    group_advantages,
    in_feed_order,
    is_constant,
    is_whole,
    staleness,
)

log = get_logger(__name__)


@dataclass
class Batch:
    groups: list[Group]
    """In feed order."""
    data: list[Datum] = field(default_factory=list)
    trained: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    """Trajectory id -> why it is not trained."""
    stale: list[int] = field(default_factory=list)
    """Per trained trajectory: how many versions behind `version` it was generated."""
    rewards: list[float] = field(default_factory=list)
    """Every scored trajectory's reward, trained or not."""

    @property
    def entries(self) -> list[str]:
        return [e.entry_id for g in self.groups for e in g.entries]


def build_batch(groups: list[Group], version: int, max_staleness: int, t: TrainerConfig) -> Batch:
    """The step's data. A group with a member that failed (an infrastructure status, or
    malformed) is dropped whole (`group_incomplete` for the others): trained on its
    survivors only, its advantages would favour whatever survives a failure. A trajectory
    lagging more than `max_staleness` is dropped (`stale`) unless the run keeps stale
    trajectories (`stale_trajectories: keep`: admission bounded when its group started)."""
    batch = Batch(in_feed_order(groups))
    bound = max_staleness if t.stale_trajectories == "drop" else None
    for group in batch.groups:
        kept = []
        whole = is_whole(group.entries)
        for e in group.entries:
            if e.invalid is None and e.traj.status in TRAINABLE:
                batch.rewards.append(e.traj.reward)
            reason = e.invalid or drop_reason(e.traj, version, bound)
            if reason is None and not whole:
                reason = "group_incomplete"
            if reason is None:
                kept.append(e.traj)
            else:
                batch.dropped[e.traj.trajectory_id] = reason
        if kept and t.drop_constant_reward_groups and is_constant(kept):
            batch.dropped.update({k.trajectory_id: "constant_reward" for k in kept})
            kept = []
        advantages = group_advantages(kept, t.advantage) if kept else []
        for traj, adv in zip(kept, advantages, strict=True):
            stale = staleness(traj, version)
            batch.data.append(Datum.from_trajectory(traj, adv, stale))
            batch.trained.append(traj.trajectory_id)
            batch.stale.append(stale)
    return batch


def step_record(
    step: int,
    version: int,
    batch: Batch,
    timings: dict[str, float],
    stats: dict[str, float],
) -> StepRecord:
    duration = timings["duration_s"]
    fields = set(StepRecord.model_fields)
    return StepRecord(
        step=step,
        version=version,
        num_trajectories=len(batch.trained),
        mean_reward=statistics.fmean(batch.rewards) if batch.rewards else 0.0,
        reward_std=statistics.pstdev(batch.rewards) if batch.rewards else 0.0,
        max_staleness=max(batch.stale, default=0),
        staleness_histogram=consistency.staleness_histogram(batch.stale),
        wait_for_batch_s=timings["wait_for_batch_s"],
        train_s=timings["train_s"],
        publish_s=timings["publish_s"],
        duration_s=duration,
        tokens_per_s=stats.get("num_tokens", 0.0) / duration if duration else 0.0,
        finished_at=time.time(),
        **{k: v for k, v in stats.items() if k in fields},
    )


def trace_step(batch: Batch, step: int, version: int, train_start: float, train_s: float) -> None:
    """In each trajectory's trace: its wait in the queue and the step that consumed it."""
    tracer = tracing.tracer()
    now, mono = time.time(), time.perf_counter()
    start = now - (mono - train_start)
    for group in batch.groups:
        for e in group.entries:
            if not tracing.recorded(e.traj.trace.traceparent):
                continue  # not a recorded trace: no spans to add
            parent = tracing.from_proto(e.traj.trace)
            queued_at = int(e.entry_id.split("-")[0]) / 1000  # the stream entry's XADD time
            tracer.start_span(
                "trainer.queued", context=parent, start_time=tracing.ns(queued_at)
            ).end(end_time=tracing.ns(start))
            span = tracer.start_span("trainer.step", context=parent, start_time=tracing.ns(start))
            span.set_attributes(
                {"treadle.step": step, "treadle.version": version, "treadle.entry": e.entry_id}
            )
            span.end(end_time=tracing.ns(start + train_s))


def observe(run: str, record: StepRecord, stale: list[int]) -> None:
    values = record.model_dump()
    values["reward_mean"], values["policy_version"] = record.mean_reward, record.version
    for name, gauge in tm.STEP_GAUGES.items():
        gauge.labels(run).set(values.get(name, 0.0))
    for s in stale:
        tm.STALENESS.labels(run).observe(s)
    uppers = [*map(str, RATIO_EDGES), "+Inf"]
    for upper, count in zip(uppers, record.ratio_histogram, strict=False):
        if count:
            tm.LOG_RATIO_TOKENS.labels(run, upper).inc(count)
    for behind, drift in enumerate(record.drift_by_staleness):
        tm.DRIFT_BY_STALENESS.labels(run, str(behind)).set(drift)
    tm.WAIT_FOR_BATCH.labels(run).observe(record.wait_for_batch_s)
    tm.STEP_SECONDS.labels(run).observe(record.duration_s)
    tm.TOKENS.labels(run).inc(record.num_tokens)
    log.info("step", run=run, **record.model_dump())


class EvaluationHold:
    """A sync run with `eval.every` waits after each evaluated step until the client reports
    it evaluated those weights (`POST /v1/runs/{id}/evaluations`), at most `eval.hold_s`:
    nothing trains beside the evaluation."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.evaluated_step = 0
        self._changed = asyncio.Condition()

    def after(self, step: int) -> bool:
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
        async with self._changed:
            self.evaluated_step = max(self.evaluated_step, step)
            self._changed.notify_all()

    async def wait(self, step: int) -> None:
        if not self.after(step):
            return
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.evaluated_step >= step),
                    self.config.eval.hold_s,
                )
            except TimeoutError:
                log.warning("no evaluation reported; going on", run=self.config.run_id, step=step)
