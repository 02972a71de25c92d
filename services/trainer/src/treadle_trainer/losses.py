"""Policy losses selected by name, an optional KL penalty and the loss aggregation.

Every loss maps per-token tensors of shape [B, T] (B sequences, T target tokens) to a per-token
loss; `total_loss` weights it by the loss mask and a per-sequence coefficient computed over the
*whole* batch (`aggregation_coefs`), so micro-batches and ranks only have to sum.

Notation: logp = log pi_theta(token) (with grad); mu = behaviour logprob recorded by rollout;
prox = logprob under the trainer's weights before this update (no grad); A = advantage;
r = exp(logp - mu) unless stated otherwise; clip(r) = clamp(r, 1 - clip_low, 1 + clip_high).

    cross_entropy        -logp                                          (SFT)
    policy_gradient      -A logp                                        (REINFORCE)
    importance_sampling  -r A                                           (Tinker)
    ppo                  -min(r A, clip(r) A); clip_high > clip_low = clip-higher (DAPO)
    cispo                -sg(clip(r)) A logp                            (MiniMax-M1)
    decoupled_ppo        -min(is_cap, prox/mu) min(r' A, clip(r') A), r' = exp(logp - prox)
                         (AReaL; the capped weight is the truncated IS correction)

KL to a frozen reference uses the k3 estimator exp(ref - logp) - (ref - logp) - 1.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from treadle_common.api.training import LossParams  # the API's shape, re-exported here


@dataclass
class TokenInputs:
    logprobs: torch.Tensor
    advantages: torch.Tensor
    behaviour_logprobs: torch.Tensor
    proximal_logprobs: torch.Tensor | None = None


Stats = dict[str, torch.Tensor]
"""Per-token statistics ([B, T]) that the caller averages over the loss mask."""
LossFn = Callable[[TokenInputs, LossParams], tuple[torch.Tensor, Stats]]


def cross_entropy(x: TokenInputs, p: LossParams) -> tuple[torch.Tensor, Stats]:
    return -x.logprobs, {}


def policy_gradient(x: TokenInputs, p: LossParams) -> tuple[torch.Tensor, Stats]:
    return -x.advantages * x.logprobs, {}


def importance_sampling(x: TokenInputs, p: LossParams) -> tuple[torch.Tensor, Stats]:
    ratio = torch.exp(x.logprobs - x.behaviour_logprobs)
    return -ratio * x.advantages, {"ratio": ratio.detach()}


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, p: LossParams
) -> tuple[torch.Tensor, Stats]:
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - p.clip_low, 1 + p.clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    return -surrogate, {
        "ratio": ratio.detach(),
        "clip_fraction": (clipped < unclipped).float().detach(),
    }


def ppo(x: TokenInputs, p: LossParams) -> tuple[torch.Tensor, Stats]:
    return _clipped_surrogate(torch.exp(x.logprobs - x.behaviour_logprobs), x.advantages, p)


def cispo(x: TokenInputs, p: LossParams) -> tuple[torch.Tensor, Stats]:
    ratio = torch.exp(x.logprobs - x.behaviour_logprobs).detach()
    weight = torch.clamp(ratio, 1 - p.clip_low, 1 + p.clip_high)
    return -weight * x.advantages * x.logprobs, {
        "ratio": ratio,
        "clip_fraction": (weight != ratio).float(),
    }


def decoupled_ppo(x: TokenInputs, p: LossParams) -> tuple[torch.Tensor, Stats]:
    if x.proximal_logprobs is None:
        raise ValueError("decoupled_ppo needs proximal logprobs")
    prox = x.proximal_logprobs.detach()
    behaviour_weight = torch.exp(prox - x.behaviour_logprobs).clamp(max=p.is_cap)
    per_token, stats = _clipped_surrogate(torch.exp(x.logprobs - prox), x.advantages, p)
    stats["behaviour_weight"] = behaviour_weight
    return behaviour_weight * per_token, stats


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "policy_gradient": policy_gradient,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "decoupled_ppo": decoupled_ppo,
}
NEEDS_PROXIMAL = {"decoupled_ppo"}
AGGREGATIONS = ("token", "sequence", "group", "sum")


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): unbiased, non-negative, low variance."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def aggregation_coefs(
    token_counts: Sequence[float], groups: Sequence[str], mode: str
) -> list[float]:
    """Per-sequence coefficient c_i so that the batch loss is sum_i c_i sum_t mask_it loss_it.

    token: mean over every loss token of the batch; sequence: mean over sequences of each
    sequence's token mean; group: mean over groups of each group's token mean; sum: plain sum.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(AGGREGATIONS)}")
    n = len(token_counts)
    if mode == "sum":
        return [1.0] * n
    if mode == "token":
        total = sum(token_counts)
        return [1.0 / total if total else 0.0] * n
    if mode == "sequence":
        live = sum(1 for c in token_counts if c)
        return [1.0 / (c * live) if c else 0.0 for c in token_counts]
    group_tokens: dict[str, float] = defaultdict(float)
    for c, g in zip(token_counts, groups, strict=True):
        group_tokens[g] += c
    live_groups = sum(1 for t in group_tokens.values() if t)
    return [1.0 / (group_tokens[g] * live_groups) if group_tokens[g] else 0.0 for g in groups]


def total_loss(
    name: str,
    params: LossParams,
    inputs: TokenInputs,
    mask_B_T: torch.Tensor,
    coef_B: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    correction_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """The aggregated scalar loss of one micro-batch, and its per-token statistics.
    `correction_B_T`: an off-policy correction's per-token weight (`off_policy.py`), applied
    to the policy loss (not the KL penalty)."""
    per_token, stats = LOSSES[name](inputs, params)
    if correction_B_T is not None:
        per_token = per_token * correction_B_T
    if params.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        kl = k3_kl(inputs.logprobs, ref_logprobs)
        per_token = per_token + params.kl_coef * kl
        stats["kl"] = kl.detach()
    return (per_token * mask_B_T * coef_B[:, None]).sum(), stats
