"""A scenario: the fleet, the model, the workload and the run, as a YAML file
(`sim/scenarios/`). Every cost is an input written down, never fitted inside the simulator."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from treadle_common.config.recipe import StaleTrajectories


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(Strict):
    params_b: float = Field(gt=0, description="Parameters, in billions")
    bytes_per_param: float = Field(2.0, gt=0, description="Published weights' bytes per parameter")
    trainable_fraction: float = Field(
        1.0, gt=0, le=1, description="Share of the weights a step publishes (LoRA: the adapter)"
    )

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param * self.trainable_fraction


class Lengths(Strict):
    prompt_tokens: int = Field(ge=1, description="Tokens of a task's prompt")
    response_median: float = Field(gt=0, description="Median generated tokens of a turn")
    response_sigma: float = Field(
        0.0, ge=0, description="Lognormal sigma of a turn's length (0: every turn the median)"
    )
    response_max: int = Field(ge=1, description="A turn's length at most (max_new_tokens)")
    per: Literal["turn", "task"] = Field(
        "turn",
        description="Draw a length per turn, or once per task for all its turns and episodes "
        "(a recipe's `sampling.length_tail`: each task's max_new_tokens)",
    )


class RolloutPool(Strict):
    replicas: int = Field(ge=1)
    gpus_per_replica: int = Field(1, ge=1)
    decode_step_s: float = Field(gt=0, description="Seconds of one decode step of a lone sequence")
    decode_step_s_per_seq: float = Field(
        0.0, ge=0, description="Seconds each further sequence in the batch adds to a decode step"
    )
    decode_s_per_context_token: float = Field(
        0.0,
        ge=0,
        description="Seconds each token of the running sequences' contexts adds to a decode "
        "step (reading its KV)",
    )
    prefill_tokens_per_s: float = Field(gt=0, description="A replica's prefill rate")
    max_batch: int = Field(ge=1, description="Sequences a replica decodes at once (KV capacity)")
    max_tasks: int | None = Field(
        None,
        ge=1,
        description="Groups a replica plays at once (`TREADLE_ROLLOUT_MAX_CONCURRENT_TASKS`); "
        "their sequences beyond max_batch wait in the engine. Default: max_batch / group size",
    )
    swap_s: float = Field(0.0, ge=0, description="A replica's pause to swap in fetched weights")
    threads: int = Field(1, ge=1, description="host: the cores a replica's decode keeps busy")


class TrainerPool(Strict):
    gpus: int = Field(ge=1)
    peak_tflops: float = Field(gt=0, description="Peak dense TFLOP/s of one GPU")
    mfu: float = Field(gt=0, le=1, description="Achieved fraction of the peak")
    step_overhead_s: float = Field(0.0, ge=0, description="Fixed seconds a step adds")
    step_s: float | None = Field(
        None, gt=0, description="A step's seconds as measured (instead of the FLOPs model)"
    )
    threads: int = Field(1, ge=1, description="host: the cores a training step keeps busy")


class Host(Strict):
    cores: float = Field(gt=0, description="Cores every replica and the trainer share")


class Weights(Strict):
    publish_gbps: float = Field(gt=0, description="Trainer -> store, Gbit/s")
    link_gbps: float = Field(gt=0, description="One replica's download link, Gbit/s")
    store_egress_gbps: float = Field(gt=0, description="The store's total egress, Gbit/s")
    fanout: Literal["store", "relay", "broadcast"] = Field(
        "store",
        description="store: every replica fetches from the store; relay: chunks hop replica to "
        "replica (a pipelined chain); broadcast: one collective over the rollout pool",
    )
    chunk_mb: float = Field(4.0, gt=0, description="relay: the unit a hop forwards")


class EnvSpec(Strict):
    turns: int = Field(1, ge=1, description="Turns of an episode")
    latency: dict = Field(
        default_factory=dict,
        description="Each env step's latency, as env-gateway's `latency` session option",
    )
    recorded_s: list[list[float]] = Field(
        default_factory=list,
        description="A run's own env seconds per episode, per task fed (in feed order) and "
        "sample (`bench e2e`'s `episode_env_s`): played instead of drawing from `latency`, "
        "spread evenly over the episode's turns; tasks past the list draw as usual",
    )


class RewardSpec(Strict):
    replicas: int = Field(1, ge=1)
    call_s: float = Field(0.0, ge=0, description="Seconds one scoring call takes")
    on_host: bool = Field(
        False, description="host: a call is work on the host's cores (one thread), not a wait"
    )


class Costs(Strict):
    """One core's CPU seconds per unit of a run's traffic (`treadle bench capacity`)."""

    s_per_task: float = Field(ge=0, description="Per group (task) played")
    s_per_trajectory: float = Field(ge=0, description="Per trajectory")
    s_per_kib: float = Field(ge=0, description="Per KiB of the messages it carries")


class Infra(Strict):
    """The control plane every run's traffic crosses, as `treadle bench capacity` measured
    it (defaults: the means of three runs on a 2-core x86_64 dev VM, 2026-12-02). Its load
    is reported, not simulated: it does not slow the simulated run, so a utilisation past 1
    says the real one would queue there."""

    redis: Costs = Field(
        default_factory=lambda: Costs(s_per_task=3.1e-4, s_per_trajectory=1.8e-6, s_per_kib=6.2e-6),
        description="redis-server: a group's task and trajectories through the streams",
    )
    redis_shards: int = Field(1, ge=1, description="Redis instances the runs' streams spread over")
    nats: Costs = Field(
        default_factory=lambda: Costs(s_per_task=1.2e-4, s_per_trajectory=3.4e-6, s_per_kib=1.7e-6),
        description="nats-server: a group's reward request and reply",
    )
    nats_cores: int = Field(1, ge=1, description="Cores of the NATS servers")
    ingest: Costs = Field(
        # 2026-12-05, the per-token checks read as arrays (65 µs a KiB before)
        default_factory=lambda: Costs(s_per_task=3.7e-5, s_per_trajectory=5.7e-5, s_per_kib=2.2e-5),
        description="The trainer's reading of trajectories: decode, group assembly, batch",
    )
    ingest_processes: int = Field(
        1, ge=1, description="Processes that ingest the trajectories (today: the trainer's one)"
    )
    trajectory_bytes_per_prompt_token: float = Field(18.0, gt=0)
    trajectory_bytes_per_generated_token: float = Field(8.7, gt=0)
    answer_bytes_per_token: float = Field(
        4.0, gt=0, description="A scored answer's text per generated token"
    )


class RunSpec(Strict):
    steps: int = Field(ge=1)
    tasks_per_step: int = Field(ge=1)
    group_size: int = Field(ge=1)
    max_staleness: int = Field(1, ge=0, description="async: versions a trajectory may lag")
    stale_trajectories: StaleTrajectories = Field(
        "drop",
        description="async: the trainer's `stale_trajectories`: drop what lags more than "
        "max_staleness when it arrives, or keep it (max_staleness then bounds admission only)",
    )
    publish_every: int = Field(
        1,
        ge=1,
        description="async: publish every K steps (`trainer.publish_every`; versions stay "
        "numbered by step). A colocated baseline trains K steps' tasks as one step",
    )

    @model_validator(mode="after")
    def _covers_publishing(self) -> RunSpec:
        if self.max_staleness < self.publish_every - 1:
            raise ValueError("max_staleness must be at least publish_every - 1")
        if self.steps % self.publish_every:
            raise ValueError("steps must be a multiple of publish_every")
        return self


class Scenario(Strict):
    name: str
    baseline: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="What the sync run is: Treadle's sync (the same two pools, a barrier between "
        "generating and training) or a colocated one (every GPU generates, then every GPU "
        "trains: verl's and most peers' sync baseline)",
    )
    colocated_resync_s: float = Field(
        0.0, ge=0, description="colocated: seconds to switch the GPUs between engine and trainer"
    )
    colocated_step_s: float | None = Field(
        None,
        gt=0,
        description="colocated: a training step's seconds on every GPU as measured (instead of "
        "the FLOPs model)",
    )
    source: str = Field("", description="Where the inputs and the published figure come from")
    published_speedup: float | None = Field(
        None, gt=0, description="The async-over-sync speedup the source reports"
    )
    model: ModelSpec
    lengths: Lengths
    rollout: RolloutPool
    trainer: TrainerPool
    weights: Weights
    env: EnvSpec = Field(default_factory=EnvSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    run: RunSpec
    infra: Infra = Field(default_factory=Infra)
    host: Host | None = Field(
        None,
        description="One machine for the whole fleet: replicas and trainer share its cores "
        "(`treadle_sim.host`); without it each has hardware of its own",
    )

    @property
    def gpus(self) -> int:
        return self.rollout.replicas * self.rollout.gpus_per_replica + self.trainer.gpus

    def colocated(self) -> Scenario:
        """The same fleet with every GPU in both roles: as many replicas as the GPUs make,
        a trainer over all of them, and weights that move in place (`colocated_resync_s`)."""
        replicas = self.gpus // self.rollout.gpus_per_replica
        resync = max(self.colocated_resync_s, 1e-9)
        bits = self.model.weight_bytes * 8
        local = bits / resync / 1e9  # Gbit/s that moves the weights in colocated_resync_s
        k, run = self.run.publish_every, self.run
        trainer = {"gpus": self.gpus, "step_s": self.colocated_step_s or self.trainer.step_s}
        return self.model_copy(
            update={
                "rollout": self.rollout.model_copy(update={"replicas": replicas}),
                "trainer": self.trainer.model_copy(update=trainer),
                "run": run.model_copy(
                    update={
                        "steps": run.steps // k,
                        "tasks_per_step": run.tasks_per_step * k,
                        "publish_every": 1,
                    }
                ),
                "weights": Weights(
                    publish_gbps=local * 2,
                    link_gbps=local * 2,
                    store_egress_gbps=local * 2 * replicas,
                ),
            }
        )


def load(path: Path) -> Scenario:
    return Scenario.model_validate(yaml.safe_load(path.read_text()))
