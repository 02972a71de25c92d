"""Recipe models: what a run trains, validated before anything starts.

Recipes are YAML files validated by `RunConfig` (unknown fields and wrong types are errors
that name the field). `--set a.b=c` overrides are applied before validation; values are
parsed as YAML scalars, so `--set trainer.lr=1e-4` is a float.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from treadle_common import names


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Strict):
    path: Path = Field(description="HF model directory (config, tokenizer, weights)")
    name: str = Field(
        "tiny",
        pattern=names.NAME_PATTERN,
        max_length=names.NAME_MAX,
        description="Weight-store model name; rollout listens on it (names.NAME_PATTERN)",
    )
    init_tiny: bool = Field(
        False, description="Build a tiny random model at `path` if it does not exist"
    )
    tiny_hidden_size: int = Field(
        128, ge=64, multiple_of=64, description="init_tiny: hidden size (heads of 64)"
    )
    tiny_layers: int = Field(2, ge=1, description="init_tiny: decoder layers")
    init_version: int | None = Field(
        None,
        ge=0,
        description="Start from this weight-store version of `name` instead of `path`'s weights "
        "(`treadle run` sets it to the SFT warm-up's version)",
    )


class LengthTail(Strict):
    """Long-tail response lengths for benchmarks, on models that rarely stop by themselves."""

    median: int = Field(ge=1, description="Median per-task max_new_tokens")
    sigma: float = Field(1.0, gt=0, description="Lognormal sigma (1.0: p99 is ~10x the median)")


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass")
    max_new_tokens: int = Field(16, ge=1, description="Tokens generated per turn at most")
    length_tail: LengthTail | None = Field(
        None,
        description="Draw each task's max_new_tokens from a lognormal (capped at "
        "max_new_tokens), seeded by the task's position in the run",
    )


class EnvConfig(Strict):
    name: str = Field("arith", description="Environment registered in the env-gateway")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Env options: the task generator's and each session's (e.g. `latency`)",
    )


class FailureConfig(Strict):
    """What rollout does with an episode that fails (an env, sandbox, engine or reward
    error; a wrong answer is a reward, not a failure): its group waits while it is played
    again; a group with an episode that still fails is quarantined whole (never trained on
    its survivors); an env that keeps failing is circuit-broken for the run, which fails."""

    episode_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Times a failed episode is played again before its group is quarantined",
    )
    breaker_window: int = Field(
        20,
        ge=0,
        le=10_000,
        description="The env's circuit breaker looks at the run's last N "
        "episodes (after their retries); 0: no breaker",
    )
    breaker_failure_rate: float = Field(
        0.5, gt=0, le=1, description="The breaker opens once at least this fraction of those "
        "episodes failed by the env's own fault (it raised, its sandbox failed; not a gateway "
        "that did not answer, the engine or the scorer)",
    )  # fmt: skip


class RolloutConfig(Strict):
    group_size: int = Field(4, ge=1, description="Episodes per task (one GRPO group)")
    max_turns: int = Field(1, ge=1, description="Turns per episode at most")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    failures: FailureConfig = Field(default_factory=FailureConfig)


LossName = Literal[
    "cross_entropy", "policy_gradient", "importance_sampling", "ppo", "cispo", "decoupled_ppo"
]
AdvantageName = Literal["grpo", "dr_grpo", "rloo"]
OffPolicyName = Literal["none", "tis", "mis", "seq_mis", "auto"]
StaleTrajectories = Literal["drop", "keep"]
"""What the trainer does with a trajectory lagging past max_staleness (`build_batch`)."""
"""Off-policy corrections (the trainer's `off_policy.py`)."""
TrainerBackend = Literal["auto", "single", "fsdp", "megatron"]
"""auto: FSDP2 when the trainer runs as several `torchrun` ranks, else single (one process)."""


class LoraSettings(Strict):
    """Train a LoRA adapter instead of the full weights: the base model stays frozen, the
    weight-store moves the adapter's tensors only, and rollout serves it on its base model."""

    rank: int = Field(ge=1, le=256, description="Rank of the low-rank update B A")
    alpha: float = Field(32.0, gt=0, description="Scale alpha / rank of the update")
    targets: list[str] = Field(
        default_factory=lambda: [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
        ],
        min_length=1,
        description="Linear layers (by name) that get the adapter; `lm_head` only on a "
        "model whose head is not tied to its embedding",
    )  # fmt: skip


class TrainerConfig(Strict):
    num_steps: int = Field(3, ge=1, description="Optimizer steps in the run")
    tasks_per_step: int = Field(4, ge=1, description="Groups (tasks) per training batch")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    lr_warmup_steps: int = Field(
        0,
        ge=0,
        description="Ramp the learning rate linearly from lr/N to lr over the first N steps "
        "(a fresh Adam's first updates are sign-like: a full-size first step can undo a warm-up)",
    )
    loss: LossName = Field("policy_gradient", description="Policy loss (see losses.py)")
    advantage: AdvantageName = Field("grpo", description="Group advantage estimator")
    loss_aggregation: Literal["token", "sequence", "group", "sum"] = Field(
        "token", description="Mean over tokens, over sequences, over groups, or a plain sum"
    )
    clip_low: float = Field(0.2, ge=0, description="PPO/CISPO: ratio >= 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="PPO/CISPO: ratio <= 1 + clip_high")
    is_cap: float = Field(
        2.0,
        gt=0,
        description="decoupled_ppo and off_policy tis/seq_mis: the cap of the truncated "
        "behaviour IS weight; off_policy mis/seq_mis: the bounds [1/is_cap, is_cap] it masks "
        "outside",
    )
    off_policy: OffPolicyName = Field(
        "none",
        description="Correction for the drift between rollout's policy and the trainer's: none "
        "(the loss's ratio against the behaviour logprobs), tis (truncated IS, ratio centred "
        "on the trainer's policy at the batch's start), mis (masked IS, as IcePop), seq_mis "
        "(sequence-level masking), auto (none or tis and its cap, chosen per minibatch from "
        "the measured drift and recorded in the step)",
    )
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the frozen initial policy")
    max_grad_norm: float = Field(1.0, gt=0, description="Global gradient-norm clip")
    drop_constant_reward_groups: bool = Field(
        False, description="Drop groups whose rewards are all equal (no learning signal)"
    )
    minibatches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per batch: its groups split into this many minibatches "
        "(decoupled_ppo's proximal policy is the batch's starting weights)",
    )
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Padded tokens per micro-batch (gradient accumulation)"
    )
    checkpoint_every: int = Field(
        1, ge=1, description="Checkpoint every K steps; trajectories are acked only then"
    )
    bf16: bool = Field(True, description="bf16 compute on GPU (ignored on CPU)")
    backend: TrainerBackend = Field(
        "auto",
        description="single (one process), fsdp (FSDP2 over the trainer's torchrun ranks), "
        "megatron (megatron-core: tensor x data parallel over them); auto: fsdp under "
        "torchrun, else single",
    )
    tensor_parallel: int = Field(
        1, ge=1, description="megatron: ranks that split every layer (the rest: data parallel)"
    )
    pipeline_parallel: int = Field(
        1,
        ge=1,
        le=1,
        description="megatron: pipeline stages. Only 1: megatron-core 0.19's pipeline "
        "schedules allocate on CUDA directly, so they do not run on CPU, and the GPU path is "
        "not built yet",
    )
    lora: LoraSettings | None = Field(
        None, description="Train a LoRA adapter (backend single); None: the full weights"
    )
    external_groups: bool = Field(
        False, description="Also train on groups the trainer did not feed (recorded sessions)"
    )
    max_staleness: int = Field(1, ge=0, description="Max policy versions a trajectory may lag")
    stale_trajectories: StaleTrajectories = Field(
        "drop",
        description="async: `drop` trains a trajectory only while its oldest token lags at "
        "most max_staleness versions; `keep` lets max_staleness bound only when a group may "
        "start (rollout's admission, AReaL's max_head_offpolicyness) and trains what was "
        "admitted however long it ran (a long response is not generated in vain; its lag "
        "shows in the staleness histogram: pair it with off_policy tis or auto)",
    )
    publish_every: int = Field(
        1,
        ge=1,
        description="Publish the weights every K steps (and after the last): for when a "
        "version per step is more than rollout can use. Versions stay numbered by step, so "
        "a trajectory lags up to K - 1 versions even in sync mode (async needs "
        "max_staleness >= K - 1)",
    )
    feed_ahead: bool = Field(
        False,
        description="Sync mode: feed step s + 1's tasks before training step s (by default "
        "they are fed after it, while its weights are published); rollout opens their "
        "sessions and renders their prompts meanwhile, and generates once step s's weights "
        "arrive. Pays off when rollout and trainer have their own machines; on the 2-core "
        "dev VM that preparation slowed training about as much as it saved waiting "
        "(`treadle bench step`)",
    )
    batch_timeout_s: float = Field(300.0, gt=0, description="Give up waiting for a batch after")
    profile_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list,
        description="Steps trained under torch.profiler (CPU, and CUDA where the trainer "
        "trains on it): each writes `profile/step-N.json.gz` (a trace for Perfetto or "
        "chrome://tracing) and `profile/step-N.txt` (Treadle's phases, then the top operators "
        "by self time) into the run's directory. The trainer process's part only (rank 0 of a "
        "multi-rank backend); a profiled step runs slower",
    )
    seed: int = Field(
        0,
        description="Seed for data order, torch and sampling (each task's episodes sample "
        "with seeds derived from it and the task's place in the run)",
    )

    @model_validator(mode="after")
    def _lora_backend(self) -> TrainerConfig:
        if self.lora is not None and self.backend in ("fsdp", "megatron"):
            raise ValueError(f"trainer.lora trains on backend single, not {self.backend}")
        return self


class DataConfig(Strict):
    path: Path | None = Field(
        None, description="JSONL or Parquet file of task payloads; none = the env's generator"
    )
    shuffle: bool = Field(True, description="Shuffle each epoch (seeded by trainer.seed)")


class SFTConfig(Strict):
    """A supervised warm-up through the trainer's training API before the RL run."""

    steps: int = Field(0, ge=0, description="Optimizer steps (0 = no warm-up)")
    batch_size: int = Field(32, ge=1, description="Demonstrations per step")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate")
    num_examples: int = Field(
        256, ge=1, description="Env tasks sampled (split `sft`) as demonstrations"
    )
    answer_field: str = Field(
        "answer", description="Task field whose value is the demonstrated reply"
    )
    target_reward: float | None = Field(
        None,
        ge=0,
        description="Stop the warm-up early once greedy reward on a validation split (split "
        "`sft_val`, never the held-out set) reaches this: a partial warm-up that leaves RL room "
        "to learn, at the same starting point whatever the seed",
    )
    check_every: int = Field(25, ge=1, description="target_reward: validate after every N steps")
    check_tasks: int = Field(
        100, ge=1, description="target_reward: validation tasks (scored with the eval scorer)"
    )


class EvalConfig(Strict):
    """Greedy evaluation on held-out env tasks (split `eval`), run by the rollout service."""

    num_tasks: int = Field(0, ge=0, description="Held-out tasks (0 = no evaluation)")
    max_new_tokens: int | None = Field(
        None, ge=1, description="Defaults to rollout.sampling.max_new_tokens"
    )
    every: int = Field(
        0, ge=0, description="Also evaluate after every N trainer steps (0 = start/end only)"
    )
    hold_s: float = Field(
        600.0,
        ge=0,
        description="sync mode with `every`: after each step to evaluate, the trainer waits (at "
        "most this long) until the client reports the evaluation done, so it scores exactly that "
        "step's weights and nothing trains beside it (0 = never wait)",
    )
    min_improvement: float | None = Field(
        None, description="Fail the run unless the final eval reward beats the first by this"
    )
    min_rl_improvement: float | None = Field(
        None,
        description="Fail the run unless the final eval reward beats the one after the SFT "
        "warm-up by this: what the RL phase alone gained",
    )
    scorer: str | None = Field(
        None, description="Scorer of the evaluations (default: the run's `scorer`)"
    )
    scorer_options: dict[str, Any] | None = Field(
        None, description="Its options (default: the run's `scorer_options`)"
    )


class SchedulingConfig(Strict):
    """How this run shares a fleet with other runs (`treadle_common.fleet.scheduling`)."""

    weight: float = Field(
        1.0, gt=0, le=1000, description="Share of contended capacity relative to other runs"
    )
    priority: int = Field(
        0,
        ge=-100,
        le=100,
        description="Higher-priority runs' tasks are admitted first; equal priorities share "
        "by weight",
    )


class WandbTracker(Strict):
    """Weights & Biases (`wandb`). Its API key and server come from the trainer's environment
    (`WANDB_API_KEY`, `WANDB_BASE_URL`), never from a recipe."""

    type: Literal["wandb"] = "wandb"
    project: str = Field("treadle", min_length=1, max_length=128, description="W&B project")
    entity: str | None = Field(
        None, max_length=128, description="W&B team or user (default: the key's)"
    )
    mode: Literal["online", "offline"] = Field(
        "online",
        description="offline: the run is written under `{output_dir}/{run_id}/wandb/` for "
        "`wandb sync` later (no network, no key)",
    )


class MlflowTracker(Strict):
    """MLflow. The tracking server is the trainer's `MLFLOW_TRACKING_URI` when set; otherwise a
    file store under `{output_dir}/{run_id}/mlruns/`."""

    type: Literal["mlflow"] = "mlflow"
    experiment: str = Field(
        "treadle", min_length=1, max_length=256, description="MLflow experiment name"
    )


class TensorboardTracker(Strict):
    """TensorBoard event files under `{output_dir}/{run_id}/tensorboard/`."""

    type: Literal["tensorboard"] = "tensorboard"


Tracker = Annotated[WandbTracker | MlflowTracker | TensorboardTracker, Field(discriminator="type")]


class LoggingConfig(Strict):
    """Where the trainer reports the run besides `metrics.jsonl`: experiment trackers, through
    their own client libraries. Each gets the resolved config, every step's record (consistency
    metrics included), the evaluations the client reports and the final summary, under the run
    id as the tracker's run name; a resumed run continues the same tracker run."""

    trackers: list[Tracker] = Field(
        default_factory=list,
        max_length=3,
        description="e.g. `[{type: wandb, mode: offline}, {type: mlflow}, {type: tensorboard}]`",
    )

    @model_validator(mode="after")
    def _one_of_each(self) -> LoggingConfig:
        kinds = [t.type for t in self.trackers]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"logging.trackers names a tracker twice: {kinds}")
        return self


class RunConfig(Strict):
    """A run: model, environment, scorer, rollout and trainer settings."""

    run_id: str = Field(
        default_factory=lambda: f"run-{uuid.uuid4().hex[:8]}",
        pattern=names.ID_PATTERN,
        description="The run's id: lowercase letters, digits and inner dashes, at most 63 "
        "(part of Redis keys, subjects and paths)",
    )
    mode: Literal["sync", "async"] = Field("sync", description="sync = max_staleness 0 + barrier")
    model: ModelConfig
    env: EnvConfig = Field(default_factory=EnvConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    scorer: str = Field("exact_match", description="Reward-service scorer name")
    scorer_options: dict[str, Any] = Field(
        default_factory=dict,
        description="The scorer's options (e.g. `composite`'s `scorers` list)",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    output_dir: Path = Field(Path(".treadle/runs"), description="Where run outputs are written")

    @property
    def policy_model(self) -> str:
        """The weight-store model this run's versions go to (and its tasks name): the model
        itself for a full-weight run, its own adapter model for a LoRA run."""
        if self.trainer.lora is not None:
            return names.adapter_policy(self.model.name, self.run_id)
        return self.model.name

    @model_validator(mode="after")
    def _policy_name_fits(self) -> RunConfig:
        if not names.valid_name(self.policy_model):
            raise ValueError(
                f"the LoRA run's model {self.policy_model!r} (model.name.run_id) is longer "
                f"than {names.NAME_MAX} characters"
            )
        return self

    @model_validator(mode="after")
    def _staleness_covers_publishing(self) -> RunConfig:
        t = self.trainer
        if self.mode == "async" and t.max_staleness < t.publish_every - 1:
            raise ValueError(
                f"trainer.max_staleness {t.max_staleness} < trainer.publish_every - 1 "
                f"({t.publish_every - 1}): every trajectory would be too stale to train on"
            )
        return self


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the offending field."""


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply `a.b.c=value` to nested dict `data` (value parsed as YAML)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise RecipeError(f"override {assignment!r} is not of the form a.b=c")
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"override {assignment!r}: {part!r} is not a section")
    node[leaf] = yaml.safe_load(raw)


def load_recipe(path: Path | str, overrides: list[str] | None = None) -> RunConfig:
    """Load and validate a recipe; raise `RecipeError` naming each bad field."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path} must be a mapping at top level")
    for assignment in overrides or []:
        apply_override(data, assignment)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_validation_error(path, exc)) from exc


def format_validation_error(path: Path, exc: ValidationError) -> str:
    lines = [f"invalid recipe {path}:"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"  {field}: {err['msg']}")
    return "\n".join(lines)


def dump_resolved(config: RunConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def task_key(task: dict[str, Any]) -> str:
    """A task's identity for held-out filtering: its payload as canonical JSON."""
    return json.dumps(task, sort_keys=True, separators=(",", ":"))
