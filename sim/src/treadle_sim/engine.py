"""One simulated run of a scenario, in SimPy's simulated time.

    feeder --> tasks --> replica slots --[admission, Treadle's Lua]--> a group's episodes:
        prefill, then per turn: decode on the replica (continuous batching), the env's step
        (env-gateway's latency model) --> reward (a pool of scorers) --> trajectories
    --> group assembly (the trainer's GroupBuffer) --> the step's batch (build_batch: the
        staleness bound) --> train (FLOPs / achieved FLOP/s) --> publish --> fetch (the
        fan-out strategy) --> replicas swap in the new version

A replica decodes its running sequences together: a decode step of n sequences takes
decode_step_s + (n - 1) * decode_step_s_per_seq and gives each one token; at most max_batch
run, the rest wait. Between its events the simulator advances every running sequence at
once (no event per token), so a run of thousands of GPUs simulates in seconds. Prefill delays
its episode by prompt_tokens / prefill_tokens_per_s (it does not slow the decode steps).

`sync` is Treadle's sync mode: max_staleness 0, the next step's tasks fed once a step has
trained, and replicas start them only once they hold that step's weights (the admission bound
at staleness 0 says exactly that). `async` feeds ahead up to max_staleness steps, and
admission holds a replica back only when what it would generate could not be trained.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import simpy

from treadle_common.config.recipe import TrainerConfig
from treadle_env_gateway.public import Latency
from treadle_sim import control, fleet
from treadle_sim.host import Cpu
from treadle_sim.scenario import Infra, Scenario
from treadle_sim.transfer import fetch_seconds

Mode = Literal["sync", "async"]
CONTEXT_STEPS = 256
"""Decode steps between looks at the running contexts' size (their KV reads grow)."""


@dataclass
class Seq:
    remaining: float
    context: float
    """Tokens its decode step attends to: the episode's so far."""
    done: simpy.Event


class Replica:
    """A rollout replica: its running sequences, the version it holds, its busy time."""

    def __init__(self, env: simpy.Environment, scenario: Scenario, cpu: Cpu):
        self.env, self.spec, self.cpu = env, scenario.rollout, cpu
        self.running: list[Seq] = []
        self.waiting: list[Seq] = []
        self.version = 0
        self.busy_s = 0.0
        self.swapped = env.event()
        """Succeeds when the replica next swaps in a version (and is then replaced)."""
        self._wake = env.event()
        env.process(self._decode())

    def generate(self, tokens: float, context: float = 0.0) -> simpy.Event:
        seq = Seq(max(tokens, 1.0), context, self.env.event())
        self.waiting.append(seq)
        if not self._wake.triggered:
            self._wake.succeed()
        return seq.done

    def swap(self, version: int) -> Any:
        """Swap in `version` (a pause, decode included), then wake who waits for it."""
        if self.spec.swap_s:
            start = self.env.now
            yield self.env.timeout(self.spec.swap_s)
            self.busy_s += self.env.now - start
        self.version = max(self.version, version)
        swapped, self.swapped = self.swapped, self.env.event()
        swapped.succeed(self.version)

    def _decode(self) -> Any:
        while True:
            room = self.spec.max_batch - len(self.running)
            self.running += self.waiting[:room]
            self.waiting = self.waiting[room:]
            self.cpu.set_busy(self, self.spec.threads, bool(self.running))
            if not self.running:
                self._wake = self.env.event()
                yield self._wake
                continue
            n, spec = len(self.running), self.spec
            per_token = spec.decode_step_s + (n - 1) * spec.decode_step_s_per_seq
            if spec.decode_s_per_context_token:  # contexts grow: look again every 256 steps
                context = sum(s.context for s in self.running)
                per_token += context * spec.decode_s_per_context_token
            per_token /= self.cpu.speed(spec.threads)  # other work on the same cores (a host)
            steps = min(s.remaining for s in self.running)
            if spec.decode_s_per_context_token:
                steps = min(steps, CONTEXT_STEPS)
            horizon = steps * per_token
            self._wake = self.env.event()
            start = self.env.now
            yield self.env.timeout(horizon) | self._wake | self.cpu.changed
            elapsed = self.env.now - start
            self.busy_s += elapsed
            progressed = elapsed / per_token
            still = []
            for seq in self.running:
                seq.remaining -= progressed
                seq.context += progressed
                if seq.remaining <= 1e-6:
                    seq.done.succeed()
                else:
                    still.append(seq)
            self.running = still


@dataclass
class Outcome:
    mode: Mode
    wall_s: float
    steps: int
    train_s: float = 0.0
    weight_sync_s: list[float] = field(default_factory=list)
    staleness: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    admission_refused: int = 0
    rollout_busy: float = 0.0
    reward_busy: float = 0.0
    store_busy: float = 0.0
    trained_tokens: float = 0.0
    groups: int = 0
    """Groups played (the control plane's traffic: `control.py`)."""
    trajectories: int = 0
    prompt_tokens: float = 0.0
    generated_tokens: float = 0.0
    infra: Infra = field(default_factory=Infra)

    def summary(self) -> dict[str, Any]:
        wall, syncs = self.wall_s or 1.0, self.weight_sync_s
        return {
            "wall_s": round(self.wall_s, 3),
            "step_s_mean": round(self.wall_s / self.steps, 4),
            "trainer_bubble": round(1 - self.train_s / wall, 4),
            "rollout_utilisation": round(self.rollout_busy, 4),
            "reward_utilisation": round(self.reward_busy, 4),
            "store_egress_utilisation": round(self.store_busy, 4),
            "weight_sync_s_mean": round(sum(syncs) / max(len(syncs), 1), 4),
            "weight_sync_share": round(sum(syncs) / wall, 4),
            "staleness_histogram": [self.staleness[i] for i in range(max(self.staleness) + 1)]
            if self.staleness
            else [],
            "dropped": dict(self.dropped),
            "admission_refused": self.admission_refused,
            "trained_tokens_per_s": round(self.trained_tokens / wall, 1),
            **control.utilisation(self),
        }


class Simulation:
    def __init__(self, scenario: Scenario, mode: Mode, seed: int = 0):
        if mode == "sync" and scenario.run.publish_every > 1:
            raise ValueError("sync mode publishes every step (publish_every 1)")
        self.sc, self.mode, self.seed = scenario, mode, seed
        self.env = simpy.Environment()
        self.cpu = Cpu(self.env, scenario.host.cores if scenario.host else None)
        self.rng = random.Random(f"{seed}-lengths")
        run = scenario.run
        self.staleness = run.max_staleness if mode == "async" else 0
        self.admission = fleet.Admission(run.tasks_per_step, self.staleness)
        self.groups = fleet.Groups(run.group_size)
        self.replicas = [
            Replica(self.env, scenario, self.cpu) for _ in range(scenario.rollout.replicas)
        ]
        self.reward = simpy.Resource(self.env, scenario.reward.replicas)
        self.tasks: simpy.Store = simpy.Store(self.env)
        self.group_ready = self.env.event()
        self.fed = 0
        self.version = 0
        self.trainer_config = TrainerConfig(
            num_steps=run.steps,
            tasks_per_step=run.tasks_per_step,
            max_staleness=self.staleness,
            stale_trajectories=run.stale_trajectories,
        )
        self.out = Outcome(mode, 0.0, run.steps, infra=scenario.infra)
        self.tokens: dict[str, float] = {}
        """Each trajectory's length (its message carries placeholder tokens)."""
        self._reward_s = 0.0
        self._store_s = 0.0

    # --- rollout --------------------------------------------------------------------------
    def feed(self, upto: int) -> None:
        while self.fed < upto:
            self.tasks.put(f"task-{self.fed:08d}")
            self.fed += 1

    def _slot(self, replica: Replica) -> Any:
        """One of a replica's task slots: take a task, be admitted, play its group."""
        while True:
            task_id = yield self.tasks.get()
            while True:
                decision = self.admission.admit(task_id, replica.version)
                if decision.closed:
                    break
                if decision.admitted:
                    yield from self._play(replica, task_id)
                    break
                yield replica.swapped  # refused: wait for the next version

    def _play(self, replica: Replica, task_id: str) -> Any:
        episodes = [
            self.env.process(self._episode(replica, task_id, i))
            for i in range(self.sc.run.group_size)
        ]
        done = yield self.env.all_of(episodes)
        self.out.groups += 1
        self.out.trajectories += len(episodes)
        for traj in done.values():
            self.groups.add(traj)
        if self.groups.ready and not self.group_ready.triggered:
            self.group_ready.succeed()

    def _episode(self, replica: Replica, task_id: str, index: int) -> Any:
        sc = self.sc
        first = replica.version
        latency = self._latency(task_id, index)
        yield self.env.timeout(sc.lengths.prompt_tokens / sc.rollout.prefill_tokens_per_s)
        tokens = float(sc.lengths.prompt_tokens)
        for _ in range(sc.env.turns):
            n = self._turn_length(task_id)
            tokens += n
            yield replica.generate(n, tokens - n)
            wait_s = latency()
            if wait_s:
                yield self.env.timeout(wait_s)
        if sc.reward.call_s:
            with self.reward.request() as slot:
                yield slot
                yield from self._busy(slot, sc.reward.call_s, sc.reward.on_host)
                self._reward_s += sc.reward.call_s
        traj = fleet.trajectory(task_id, index, first, replica.version, self.rng.random())
        self.tokens[traj.trajectory_id] = tokens
        self.out.prompt_tokens += sc.lengths.prompt_tokens
        self.out.generated_tokens += tokens - sc.lengths.prompt_tokens
        return traj

    def _latency(self, task_id: str, index: int) -> Callable[[], float]:
        """Each env step's seconds in this episode: the run's own, spread over its turns
        (`EnvSpec.recorded_s`), else drawn by env-gateway's latency model."""
        env, fed = self.sc.env, int(task_id.rsplit("-", 1)[1])
        if fed < len(env.recorded_s) and index < len(env.recorded_s[fed]):
            per_turn = env.recorded_s[fed][index] / env.turns
            return lambda: per_turn
        drawn = Latency(env.latency, f"{self.seed}-{task_id}-{index}")
        return lambda: drawn.sample_ms() / 1000

    def _turn_length(self, task_id: str) -> float:
        lengths = self.sc.lengths
        n = lengths.response_median
        if lengths.response_sigma:
            rng = self.rng
            if lengths.per == "task":  # as the feeder draws a task's max_new_tokens
                rng = random.Random(f"{self.seed}-{int(task_id.rsplit('-', 1)[1])}")
            n = rng.lognormvariate(math.log(n), lengths.response_sigma)
        return float(min(max(1, round(n)), lengths.response_max))

    # --- trainer ----------------------------------------------------------------------------
    def _train_s(self, tokens: float) -> float:
        t = self.sc.trainer
        if t.step_s is not None:
            return t.step_s
        flops = 6 * self.sc.model.params_b * 1e9 * tokens
        return flops / (t.gpus * t.peak_tflops * 1e12 * t.mfu) + t.step_overhead_s

    def _fetch_s(self) -> list[float]:
        """Seconds from a version's commit until each replica holds it."""
        w, n = self.sc.weights, len(self.replicas)
        seconds, store_s = fetch_seconds(w, self.sc.model.weight_bytes, n)
        self._store_s += store_s
        return seconds

    def _busy(self, who: object, seconds: float, on_host: bool) -> Any:
        """`seconds` of one thread's work: on the host's cores (slowed by what else runs
        there) where `on_host` and the scenario has a host, else a wait."""
        if on_host and self.sc.host:
            yield from self.cpu.work(who, 1, seconds)
        else:
            yield self.env.timeout(seconds)

    def _publish(self, version: int) -> Any:
        start = self.env.now
        seconds = self.sc.model.weight_bytes * 8 / (self.sc.weights.publish_gbps * 1e9)
        yield from self._busy("publish", seconds, on_host=True)  # the trainer's own cores
        fetches = self._fetch_s()
        for replica, seconds in zip(self.replicas, fetches, strict=True):
            self.env.process(self._deliver(replica, version, seconds))
        self.out.weight_sync_s.append(self.env.now - start + max(fetches))

    def _deliver(self, replica: Replica, version: int, seconds: float) -> Any:
        yield self.env.timeout(seconds)
        yield from replica.swap(version)

    def _trainer(self) -> Any:
        run = self.sc.run
        self.feed(run.tasks_per_step * (1 + self.staleness))
        publish: simpy.Process | None = None
        for step in range(1, run.steps + 1):
            while len(self.groups.ready) < run.tasks_per_step:
                self.group_ready = self.env.event()
                yield self.group_ready
            taken = self.groups.buffer.take(run.tasks_per_step)
            batch = fleet.step_batch(taken, self.version, self.staleness, self.trainer_config)
            self.out.dropped.update(batch.dropped.values())
            unusable = sum(
                1 for g in taken if all(e.traj.trajectory_id in batch.dropped for e in g.entries)
            )
            if unusable:  # their places free, and the feeder replaces them
                self.admission.unusable(unusable)
                self.feed(self.fed + unusable)
            self.out.staleness.update(batch.stale)
            tokens = sum(self.tokens.pop(tid) for tid in batch.trained)
            for tid in batch.dropped:
                self.tokens.pop(tid, None)
            if self.sc.host and publish is not None:  # a CPU trainer lets its publish finish
                yield publish
            threads = self.sc.trainer.threads
            seconds = yield from self.cpu.work("trainer", threads, self._train_s(tokens))
            self.out.train_s += seconds
            self.out.trained_tokens += tokens
            self.version += 1
            if step % run.publish_every == 0:
                publish = self.env.process(self._publish(self.version))
            if step == run.steps:
                self.admission.close()
            elif self.mode == "sync":
                yield publish  # the next batch is generated with these weights
                self.feed(run.tasks_per_step * (step + 1))
            else:
                self.feed(run.tasks_per_step * (step + 1 + self.staleness))
        self.out.wall_s = self.env.now

    def run(self) -> Outcome:
        rollout = self.sc.rollout
        slots = rollout.max_tasks or max(1, rollout.max_batch // self.sc.run.group_size)
        for _ in range(slots):  # slot by slot across the replicas: fed tasks spread evenly
            for replica in self.replicas:
                self.env.process(self._slot(replica))
        trainer = self.env.process(self._trainer())
        self.env.run(until=trainer)
        wall = self.out.wall_s or 1.0
        self.out.rollout_busy = sum(r.busy_s for r in self.replicas) / (len(self.replicas) * wall)
        self.out.reward_busy = self._reward_s / (self.sc.reward.replicas * wall)
        self.out.store_busy = self._store_s / wall
        self.out.admission_refused = self.admission.refused()
        self.admission.shutdown()
        return self.out


def compare(scenario: Scenario, seed: int = 0) -> dict[str, Any]:
    """Both modes of one scenario: each one's figures and the async-over-sync speedup (sync
    on the scenario's `baseline`: its own pools, or every GPU colocated)."""
    colocated = scenario.baseline == "colocated"
    every_step = scenario.model_copy(
        update={"run": scenario.run.model_copy(update={"publish_every": 1})}
    )
    sync = Simulation(scenario.colocated() if colocated else every_step, "sync", seed).run()
    async_ = Simulation(scenario, "async", seed).run()
    result: dict[str, Any] = {
        "scenario": scenario.name,
        "gpus": scenario.gpus,
        "seed": seed,
        "sync": sync.summary(),
        "async": async_.summary(),
        "baseline": scenario.baseline,
        "speedup": round(sync.wall_s / async_.wall_s, 3),
        "fanout": scenario.weights.fanout,
    }
    if scenario.published_speedup is not None:
        result["published_speedup"] = scenario.published_speedup
        result["vs_published"] = round(result["speedup"] / scenario.published_speedup, 3)
    return result
