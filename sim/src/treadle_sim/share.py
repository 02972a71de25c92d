"""`treadle sim share`: many runs on one fleet of rollout replicas, each replica's task slots
given out by rollout's own scheduling (`treadle_rollout.public.FairShare`, the task worker's:
strict priority, then the policy's pick; under `fair` a weighted fair share of slot-seconds,
each task charged its run's estimate at dispatch and settled at its end), in SimPy's time.

    run's task stream --read, one ready task per run and replica (as the worker reads)-->
    a replica's ready tasks --a free slot: FairShare.contenders, .pick, .charge-->
    the task holds the slot for its seconds (a group's episodes: env, tools, decode) --> settle

A run is backlogged (its stream never empties), finite (`tasks`), or sync (`tasks_per_step`
tasks, then `train_s` of training with nothing in its stream, again). It joins at `start_s`.
Task seconds are lognormal (median `task_s`, `task_sigma`), drawn per run and task index from
the seed, so both policies play the same tasks. A task counts as fed when a replica reads it
(its `created_at`, which orders a replica's ready tasks: a feeder that keeps each stream just
ahead of the replicas).

Reported per policy: each run's tasks (a sync run's steps, and the mean seconds from a step's
feed to its last task's end), slot-seconds and share of the busy slot-seconds; its
share within its priority level against its weight's share of that level (`entitled`: the
level's runs' weights, all of them having had work throughout) and the ratio; Jain's index of
those ratios over the level's runs; and the fleet's slot utilisation. Only the slot-seconds
inside the horizon count.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simpy
import yaml
from pydantic import Field, model_validator

from treadle_common import names
from treadle_common.fleet import scheduling
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_rollout.public import FairShare
from treadle_sim.scenario import Strict

WAIT_S = 0.05
"""How long a replica whose ready tasks are all held back by a higher priority waits before
it looks again (the task worker's sleep in that case)."""


class RunLoad(Strict):
    name: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0, description="The recipe's scheduling.weight")
    priority: int = Field(0, description="The recipe's scheduling.priority")
    tenant: str = "default"
    task_s: float = Field(gt=0, description="Median seconds a task (a group) holds its slot")
    task_sigma: float = Field(0.0, ge=0, description="Lognormal sigma of those seconds")
    start_s: float = Field(0.0, ge=0, description="When the run starts feeding tasks")
    tasks: int | None = Field(None, ge=1, description="Tasks in all (none: always more)")
    tasks_per_step: int | None = Field(
        None, ge=1, description="Sync: tasks fed per step, then train_s with none"
    )
    train_s: float = Field(0.0, ge=0, description="Sync: a step's training seconds")


class SharedFleet(Strict):
    name: str
    source: str = Field("", description="What the scenario stands for, in words")
    replicas: int = Field(ge=1, description="Rollout replicas")
    gpus_per_replica: int = Field(1, ge=1)
    slots: int = Field(8, ge=1, description="Tasks in flight per replica (max_concurrent_tasks)")
    horizon_s: float = Field(gt=0, description="Simulated seconds")
    runs: list[RunLoad] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct(self) -> SharedFleet:
        if len({r.name for r in self.runs}) != len(self.runs):
            raise ValueError("run names must be distinct")
        return self


def load(path: Path) -> SharedFleet:
    return SharedFleet.model_validate(yaml.safe_load(path.read_text()))


@dataclass
class RunState:
    spec: RunLoad
    unread: float  # tasks in its stream no replica has read (inf: backlogged)
    issued: int = 0
    done: int = 0
    slot_s: float = 0.0
    step_left: int = 0  # sync: this step's tasks not yet finished
    step_s: list[float] = field(default_factory=list)  # sync: each step's seconds, fed to played
    step_played: simpy.Event | None = None  # sync: succeeds when this step's last task ends


class Shared:
    def __init__(self, fleet: SharedFleet, policy: str, seed: int = 0):
        self.fleet, self.seed = fleet, seed
        self.env = simpy.Environment()
        self.shares = [
            FairShare(scheduling.make(policy), None, clock=lambda: self.env.now)
            for _ in range(fleet.replicas)
        ]
        self.free = [fleet.slots] * fleet.replicas
        self.wake = [self.env.event() for _ in range(fleet.replicas)]
        self.runs = {names.tasks_stream(r.name): RunState(r, 0.0) for r in fleet.runs}
        for stream, run in self.runs.items():
            for share in self.shares:
                share.claims[stream] = scheduling.Claim(
                    run.spec.name, run.spec.weight, run.spec.priority, run.spec.tenant
                )
            self.env.process(self._feed(run))
        for i in range(fleet.replicas):
            self.env.process(self._replica(i))

    def _feed(self, run: RunState) -> Generator[simpy.Event, Any, None]:
        """The run's trainer feeding its stream: all at once, or a step's worth at a time."""
        spec = run.spec
        yield self.env.timeout(spec.start_s)
        if spec.tasks_per_step is None:
            run.unread = float(spec.tasks) if spec.tasks else math.inf
            self._wake_all()
            return
        while spec.tasks is None or run.issued < spec.tasks:
            left = math.inf if spec.tasks is None else spec.tasks - run.issued
            run.unread = run.step_left = int(min(spec.tasks_per_step, left))
            fed, run.step_played = self.env.now, self.env.event()
            self._wake_all()
            yield run.step_played
            run.step_s.append(self.env.now - fed)
            yield self.env.timeout(spec.train_s)

    def _wake_all(self) -> None:
        for i, event in enumerate(self.wake):
            if not event.triggered:
                event.succeed()
            self.wake[i] = self.env.event()

    def _read(self, i: int) -> None:
        """One ready task per stream that has none on this replica (the worker's read)."""
        share = self.shares[i]
        for stream, run in self.runs.items():
            if run.unread > 0 and not share.ready.get(stream):
                run.unread -= 1
                task = task_pb2.Task(
                    task_id=f"{run.spec.name}/{run.issued}", created_at=self.env.now
                )
                run.issued += 1
                share.ready.setdefault(stream, []).append((task.task_id, task, self.env.now))

    def _replica(self, i: int) -> Generator[simpy.Event, Any, None]:
        share, active = self.shares[i], set(self.runs)
        while True:
            self._read(i)
            held_back = False
            while self.free[i]:
                _, eligible = share.contenders(active)
                if not eligible:
                    held_back = any(share.ready.values())
                    break
                stream = share.pick(eligible)
                task_id = share.ready[stream].pop(0)[0]
                settle = share.charge(share.claims[stream])
                self.free[i] -= 1
                self.env.process(self._play(i, self.runs[stream], task_id, settle))
                self._read(i)
            waits = [self.wake[i]] + ([self.env.timeout(WAIT_S)] if held_back else [])
            yield self.env.any_of(waits)

    def _play(
        self, i: int, run: RunState, task_id: str, settle: Callable[[], None]
    ) -> Generator[simpy.Event, Any, None]:
        spec = run.spec
        draw = random.Random(f"{self.seed}:{task_id}")
        seconds = spec.task_s * math.exp(spec.task_sigma * draw.gauss(0.0, 1.0))
        run.slot_s += max(0.0, min(seconds, self.fleet.horizon_s - self.env.now))
        yield self.env.timeout(seconds)
        settle()
        run.done += 1
        if run.step_left:
            run.step_left -= 1
            if not run.step_left and run.step_played is not None:
                run.step_played.succeed()
        self.free[i] += 1
        event = self.wake[i]
        if not event.triggered:
            event.succeed()
        self.wake[i] = self.env.event()

    def run(self) -> dict[str, Any]:
        self.env.run(until=self.fleet.horizon_s)
        return report(self.fleet, [r for r in self.runs.values()])


def report(fleet: SharedFleet, runs: list[RunState]) -> dict[str, Any]:
    busy = sum(r.slot_s for r in runs) or 1.0
    capacity = fleet.replicas * fleet.slots * fleet.horizon_s
    out: dict[str, Any] = {"utilisation": round(busy / capacity, 4), "runs": {}, "jain": {}}
    for level in sorted({r.spec.priority for r in runs}, reverse=True):
        peers = [r for r in runs if r.spec.priority == level]
        level_s = sum(r.slot_s for r in peers) or 1.0
        weights = sum(r.spec.weight for r in peers)
        ratios = []
        for r in peers:
            level_share, entitled = r.slot_s / level_s, r.spec.weight / weights
            ratios.append(level_share / entitled)
            out["runs"][r.spec.name] = {
                "priority": level,
                "weight": r.spec.weight,
                "tasks": r.done,
                "slot_s": round(r.slot_s, 1),
                "share": round(r.slot_s / busy, 4),
                "level_share": round(level_share, 4),
                "entitled": round(entitled, 4),
                "ratio": round(ratios[-1], 3),
            }
            if r.step_s:  # a sync run: how long its steps' tasks took to play
                out["runs"][r.spec.name] |= {
                    "steps": len(r.step_s),
                    "play_s_mean": round(sum(r.step_s) / len(r.step_s), 1),
                }
        jain = sum(ratios) ** 2 / (len(ratios) * sum(x * x for x in ratios))
        out["jain"][str(level)] = round(jain, 4)
    return out


def compare(fleet: SharedFleet, policies: list[str], seed: int = 0) -> dict[str, Any]:
    """Each policy on the same scenario and seed."""
    return {
        "scenario": fleet.name,
        "gpus": fleet.replicas * fleet.gpus_per_replica,
        "replicas": fleet.replicas,
        "slots": fleet.replicas * fleet.slots,
        "horizon_s": fleet.horizon_s,
        "seed": seed,
        "policies": {p: Shared(fleet, p, seed).run() for p in policies},
    }
