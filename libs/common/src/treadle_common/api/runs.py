"""The trainer's run API: `POST /v1/runs` (a `RunConfig`) -> `RunStatus`; `GET /v1/runs`,
`GET /v1/runs/{id}?steps_from=N`; `POST /v1/runs/{id}/evaluations` (`EvaluationDone`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from treadle_common.api.ops import ServiceInfo

RunState = Literal["pending", "running", "retrying", "succeeded", "failed", "handed_off", "lost"]
"""`handed_off`: this trainer stopped the run at a step boundary as it shut down (the run is
checkpointed and its lease released: another trainer resumes it); `lost`: another trainer
took the run over while this one stalled past its lease (this one's writes were refused);
`retrying`: an infrastructure error interrupted it, it resumes from its last checkpoint."""
FINAL_STATES: tuple[RunState, ...] = ("succeeded", "failed")
RATIO_EDGES = (-2.0, -1.0, -0.5, -0.2, -0.1, -0.05, -0.02, -0.01, -0.001,
               0.001, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # fmt: skip
"""Bin edges of a step's `ratio_histogram`: log importance ratios d = log p_trainer - log
p_behaviour; bin i holds RATIO_EDGES[i-1] <= d < RATIO_EDGES[i] (19 bins)."""


class StepRecord(BaseModel):
    step: int
    version: int
    mean_reward: float
    reward_std: float = 0.0
    num_trajectories: int
    num_tokens: float = 0.0
    max_staleness: int
    loss: float
    grad_norm: float
    entropy: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    log_ratio_mean: float = Field(
        0.0,
        description="Train-inference drift: the mean over the loss tokens of d = log p_trainer "
        "(under the weights the step starts from) - log p_behaviour (rollout's, when it sampled)",
    )
    log_ratio_abs_mean: float = Field(0.0, description="The mean of |d|")
    log_ratio_p99: float = Field(
        0.0, description="The 99th percentile of |d| (the upper edge of its bin, 4 a decade)"
    )
    log_ratio_max: float = Field(0.0, description="The largest |d|")
    behaviour_kl: float = Field(
        0.0,
        description="k3 estimate of KL(behaviour || trainer) from the behaviour's own samples: "
        "the mean of exp(d) - 1 - d",
    )
    ratio_histogram: list[int] = Field(
        default_factory=list,
        description="Loss tokens per bin of d, the log importance ratio (edges: RATIO_EDGES)",
    )
    staleness_histogram: list[int] = Field(
        default_factory=list,
        description="Trajectories trained per staleness (index: versions behind the trainer)",
    )
    drift_by_staleness: list[float] = Field(
        default_factory=list,
        description="Mean |d| of the loss tokens per staleness (index: versions behind; the "
        "last bucket, 7, holds 7 and more): the engine's share of the drift at 0, age's above",
    )
    off_policy: str = Field(
        "none",
        description="The off-policy correction the step applied (trainer.off_policy; auto: "
        "what it chose from the measured drift, minibatches' choices joined by ',')",
    )
    off_policy_cap: float = Field(0.0, description="Its cap or bound (0 for none)")
    off_policy_masked: float = Field(
        0.0, description="Fraction of the loss tokens the correction's weights zeroed"
    )
    off_policy_ess: float = Field(
        1.0,
        description="Effective sample size (sum w)^2 / (n sum w^2) of the correction's token "
        "weights, as a fraction of the tokens (1: uncorrected)",
    )
    wait_for_batch_s: float = 0.0
    train_s: float = 0.0
    publish_s: float = Field(
        description="Seconds the step waited for publishing (sync: until its weights were "
        "committed; async: handing them to the background publisher)"
    )
    published: bool = Field(
        False, description="The step's weights were published (not skipped or coalesced)"
    )
    publish_duration_s: float | None = Field(
        None, description="Seconds the publish of this step's weights took, once done"
    )
    publish_latency_s: float | None = Field(
        None, description="Seconds from the step's end to its weights committed, once done"
    )
    bytes_published: int = 0
    duration_s: float
    tokens_per_s: float = 0.0
    finished_at: float = Field(
        0.0, description="Unix time the step ended (sync: its weights were published)"
    )


USAGE_PREFIX = "usage:"
"""Rollout's usage counts of a run live in its state hash as `usage:<field>` (HINCRBY)."""
ROLLOUT_USAGE = ("prompt_tokens", "generated_tokens", "episodes", "reward_calls", "env_s",
                 "sandbox_runs", "weight_bytes_fetched")  # fmt: skip
"""The `Usage` fields rollout counts; the trainer counts the others."""


class Usage(BaseModel):
    """What a run used of the fleet (accounted per run; `GET /v1/usage` sums them by tenant)."""

    prompt_tokens: int = Field(0, description="Tokens of prompts and env turns rollout fed")
    generated_tokens: int = Field(0, description="Tokens the policy generated")
    episodes: int = Field(0, description="Episodes played (trajectories produced)")
    reward_calls: int = Field(0, description="Trajectories the reward service scored")
    env_s: float = Field(0.0, description="Seconds in env-gateway calls, over all episodes")
    sandbox_runs: int = Field(0, description="Programs the episodes' envs ran in the sandbox")
    trained_tokens: int = Field(0, description="Tokens the trainer's steps trained on")
    trainer_s: float = Field(0.0, description="Seconds the trainer's steps computed")
    weight_bytes_published: int = Field(0, description="Bytes this run's publishes sent")
    weight_bytes_fetched: int = Field(0, description="Bytes rollout fetched of its policy")

    def add_step(self, record: StepRecord) -> None:
        self.trained_tokens += int(record.num_tokens)
        self.trainer_s += record.train_s

    def take_rollout(self, state: dict[str, str]) -> None:
        """Rollout's counts from the run's state hash (`usage:<field>` -> value)."""
        for name in ROLLOUT_USAGE:
            raw = state.get(USAGE_PREFIX + name)
            if raw is not None:
                kind = type(getattr(self, name))
                setattr(self, name, kind(float(raw)))

    def __add__(self, other: Usage) -> Usage:
        mine, theirs = self.model_dump(), other.model_dump()
        return Usage(**{k: mine[k] + theirs[k] for k in mine})


class RunStatus(BaseModel):
    run_id: str
    tenant: str = Field("default", description="Who the run belongs to (its starter's token)")
    state: RunState = "pending"
    error: str | None = None
    owner: str | None = Field(
        None, description="The trainer instance that owns the run now (its lease's holder)"
    )
    step: int = 0
    checkpoint_step: int = 0
    resumed: int = Field(0, description="Times this run was restored from a checkpoint")
    base_version: int | None = None
    versions: list[int] = Field(default_factory=list)
    tasks_fed: int = 0
    tasks_cancelled: int = Field(
        0, description="Fed tasks no step needed once the last step had its batch (never run)"
    )
    tasks_dead: int = Field(
        0,
        description="Tasks rollout gave up on (treadle:{run}:dead): invalid, delivered more "
        "than `max_deliveries` times, a group with an episode that failed past its retries "
        "(`episodes_failed`) or an env circuit-broken for the run (`env_circuit_open`); the "
        "trainer fed others in their place",
    )
    dead_lettered: dict[str, int] = Field(
        default_factory=dict, description="Dead-lettered tasks by reason"
    )
    trajectories_quarantined: int = Field(
        0,
        description="Episodes that failed past their retries (treadle:{run}:quarantine, with "
        "their status and error); their groups were not trained",
    )
    trajectories_discarded: int = Field(
        0, description="Episodes that played, discarded with a quarantined member of their group"
    )
    broken_envs: dict[str, str] = Field(
        default_factory=dict,
        description="Envs whose circuit breaker opened for the run, with why (the run fails)",
    )
    trajectories_produced: int = 0
    trajectories_consumed: int = 0
    trajectories_trained: int = 0
    trajectories_acked: int = 0
    rejected: int = Field(0, description="Entries dropped as they were read (acked, not consumed)")
    duplicates: int = 0
    publishes_coalesced: int = Field(
        0, description="Versions never published: a newer one replaced them while waiting"
    )
    dropped: dict[str, int] = Field(default_factory=dict)
    pending_after_run: int | None = None
    usage: Usage = Field(default_factory=Usage, description="What the run used of the fleet")
    steps: list[StepRecord] = Field(
        default_factory=list, description="Step records (from `steps_from` when asked)"
    )

    @property
    def finished(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def last_version(self) -> int | None:
        """The newest version the run published (its base version before any)."""
        return self.versions[-1] if self.versions else self.base_version

    @property
    def exactly_once(self) -> bool:
        """Every produced trajectory consumed once, every read entry acked, nothing pending."""
        return (
            self.trajectories_consumed == self.trajectories_produced
            and self.duplicates == 0
            and self.pending_after_run == 0
            and self.trajectories_acked == self.trajectories_consumed + self.rejected
        )


class EvaluationDone(BaseModel):
    """`POST /v1/runs/{id}/evaluations`: the client (`treadle run`) evaluated the weights of
    `step`, so a sync run waiting there (`eval.hold_s`) goes on."""

    step: int = Field(ge=1)
    mean_reward: float | None = Field(
        None, description="What the evaluation scored (the run's trackers record it)"
    )
    num_tasks: int = Field(0, ge=0, description="Tasks it scored")


class Backlog(BaseModel):
    """`GET /v1/backlog`: work waiting in Redis for the active runs (KEDA scales on it)."""

    runs: int
    tasks_waiting: int
    trajectories_waiting: int
    tasks_by_model: dict[str, int] = Field(
        default_factory=dict,
        description="Tasks waiting, by the model a rollout replica must serve for them (a "
        "replica pool per model scales on its own; a model no replica serves waits)",
    )


class TrainerInfo(ServiceInfo):
    """The trainer's `GET /v1/info`."""

    runs: dict[str, RunState] = Field(default_factory=dict, description="Run id -> state")
