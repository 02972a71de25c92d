"""The trainer's Tinker-style training API (`/v1/training/sessions`): requests and answers.

A Datum is one sequence: `model_input` tokens and per-position `target_tokens`, `weights`
(loss mask), `advantages` and sampling `logprobs`, the loss inputs Tinker names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from treadle_common import names
from treadle_common.config.recipe import LossName, OffPolicyName

MAX_DATA = 4096
"""Sequences in one `forward_backward`."""
MAX_SEQUENCE = 131_072
"""Tokens in one sequence."""
_FINITE = ConfigDict(allow_inf_nan=False)  # a NaN from a client would poison the weights


class LossParams(BaseModel):
    """Hyper-parameters shared by the losses (recipe `trainer.*` or a training-API request)."""

    model_config = _FINITE

    clip_low: float = Field(0.2, ge=0, description="PPO/CISPO lower clip: ratio >= 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="Upper clip (clip-higher when > clip_low)")
    is_cap: float = Field(
        2.0,
        gt=0,
        description="Cap of the truncated behaviour IS weight (decoupled_ppo, off_policy tis and "
        "seq_mis); the bounds [1/is_cap, is_cap] of off_policy mis and seq_mis",
    )
    off_policy: OffPolicyName = Field(
        "none",
        description="Off-policy correction of the loss against the data's logprobs: none, tis, "
        "mis, seq_mis or auto (see the recipe's trainer.off_policy)",
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the frozen reference")
    temperature: float = Field(
        1.0,
        gt=0,
        description="Sampling temperature of the behaviour logprobs: the trainer's logits are "
        "divided by it, so the policy it trains (and its ratios to the behaviour policy) is the "
        "one rollout sampled from",
    )


class AdamParams(BaseModel):
    """`optim_step`'s body: AdamW's settings for this step."""

    model_config = _FINITE

    learning_rate: float = Field(1e-4, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0, description="Clip the global grad norm to this")


class CreateSession(BaseModel):
    model_path: str = Field(description="HF model directory to train")
    model_name: str = Field(
        "tiny",
        pattern=names.NAME_PATTERN,
        max_length=names.NAME_MAX,
        description="Weight-store model name for save_weights",
    )
    seed: int = 0
    kl_reference: bool = Field(False, description="Keep a frozen reference for kl_coef > 0")


class SessionCreated(BaseModel):
    session_id: str
    vocab_size: int


class DatumIn(BaseModel):
    model_config = _FINITE
    model_input: list[int] = Field(min_length=1, max_length=MAX_SEQUENCE)
    target_tokens: list[int]
    weights: list[float] | None = None
    advantages: list[float] | None = None
    logprobs: list[float] | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> DatumIn:
        n = len(self.model_input)
        for name in ("target_tokens", "weights", "advantages", "logprobs"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries, model_input has {n}")
        return self


class ForwardBackward(BaseModel):
    loss_fn: LossName = "cross_entropy"
    loss_params: LossParams = Field(default_factory=LossParams)
    aggregation: Literal["token", "sequence", "group", "sum"] = "sum"
    micro_batch_tokens: int = Field(8192, ge=1, le=MAX_SEQUENCE)
    data: list[DatumIn] = Field(min_length=1, max_length=MAX_DATA)


class ForwardBackwardResult(BaseModel):
    """The aggregated loss and per-token statistics (the ones the loss computes)."""

    loss: float
    num_tokens: float
    entropy: float | None = None
    kl: float | None = None
    clip_fraction: float | None = None
    ratio: float | None = None
    behaviour_weight: float | None = None
    log_ratio_mean: float | None = Field(
        None,
        description="Train-inference drift, when the data carried behaviour logprobs: the mean "
        "of d = log p_trainer - log p_behaviour over the loss tokens (a run's step reports "
        "the same figures, see StepRecord)",
    )
    log_ratio_abs_mean: float | None = None
    log_ratio_p99: float | None = None
    log_ratio_max: float | None = None
    behaviour_kl: float | None = None
    ratio_histogram: list[int] | None = None
    off_policy: str | None = Field(
        None, description="The off-policy correction applied (auto: the one it chose)"
    )
    off_policy_cap: float | None = Field(None, description="Its cap or bound (0 for none)")
    off_policy_masked: float | None = Field(
        None, description="Fraction of the loss tokens its weights zeroed"
    )
    off_policy_ess: float | None = Field(
        None, description="Effective sample size of its weights, as a fraction of the tokens"
    )


class OptimStepResult(BaseModel):
    grad_norm: float
    step: int = Field(description="Optimizer steps this session has taken")


class SavedWeights(BaseModel):
    version: int = Field(description="The weight-store version (rollout swaps to it)")
    bytes_sent: int


class SaveState(BaseModel):
    name: str | None = Field(
        None,
        pattern=names.NAME_PATTERN,
        max_length=names.NAME_MAX,
        description="The state's name in the session's directory (names.NAME_PATTERN)",
    )


class SavedState(BaseModel):
    path: str
    step: int


class LoadState(BaseModel):
    path: str


class LoadedState(BaseModel):
    step: int
