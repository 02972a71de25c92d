"""Off-policy correction: what a step does about the drift between the policy rollout sampled
from (the behaviour, mu) and the one the trainer trains, per loss token.

rho = pi_prox / mu, where pi_prox is the trainer's own policy at the weights the batch starts
from and mu the logprob rollout recorded when it sampled the token (kernels, precision and
staleness move it; `consistency.py` reports it every step). `trainer.off_policy` (recipe) or
`LossParams.off_policy` (training API):

    none     the loss as it is: its ratio r = pi_theta / mu against the behaviour logprobs
    tis      token-level truncated importance sampling (TIS): the loss's ratio is taken against
             pi_prox (so its clipping is centred on the trainer's own policy) and every token
             weighs min(rho, C), C = `is_cap`
    mis      token-level masked importance sampling (as IcePop): weight rho inside [1/C, C],
             0 outside
    seq_mis  sequence-level masking: a sequence whose geometric-mean rho (exp of its tokens'
             mean log rho) falls outside [1/C, C] weighs 0, the others' tokens min(rho, C)
    auto     measured on each minibatch before its gradient (one no-grad forward at pi_prox,
             which every correction needs anyway): `none` while the 99th percentile of
             |log rho| stays within TOLERANCE (the engine and the trainer agree well inside the
             loss's clip band, and a correction would only add variance); else `tis`, with C
             the largest of CAPS whose truncated weights keep an effective sample size
             (sum w)^2 / (n sum w^2) of at least MIN_ESS of the tokens (CAPS[0] if none does):
             as little truncation bias as the measured drift allows at bounded variance

The losses that read no behaviour logprobs (`cross_entropy`) are never corrected. The step
records what was applied (`StepRecord.off_policy`, `off_policy_cap`, `off_policy_masked`,
`off_policy_ess`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from treadle_common.api.training import LossParams
from treadle_trainer.consistency import Drift, Reduce

TOLERANCE = 0.05
"""auto: |log rho| up to this at the 99th percentile counts as agreement (ratios within ~5 %,
a quarter of PPO's default clip band)."""
CAPS = (1.5, 2.0, 3.0, 5.0, 10.0)
"""auto: the truncation caps it chooses from."""
MIN_ESS = 0.5
"""auto: the smallest effective sample size, as a fraction of the tokens, a cap may leave."""
UNCORRECTED = {"cross_entropy"}
"""Losses that read no behaviour logprobs."""


@dataclass(frozen=True)
class Correction:
    mode: str
    """none, tis, mis or seq_mis (what auto chose, when it was asked)."""
    cap: float = 0.0

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @torch.no_grad()
    def weights(
        self, proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Each token's weight ([B, T]) from its log rho = proximal - behaviour."""
        log_rho = (proximal - behaviour).float()
        rho = torch.exp(log_rho.clamp(max=30.0))
        if self.mode == "tis":
            return rho.clamp(max=self.cap)
        bound = math.log(self.cap)
        if self.mode == "mis":
            return torch.where(log_rho.abs() <= bound, rho, torch.zeros_like(rho))
        live = (mask > 0).float()
        mean_log = (log_rho * live).sum(-1) / live.sum(-1).clamp(min=1.0)
        keep_B = (mean_log.abs() <= bound).float()
        return rho.clamp(max=self.cap) * keep_B[:, None]


def corrects(mode: str, loss: str) -> bool:
    """Whether `mode` corrects `loss` at all (and so needs pi_prox and behaviour logprobs)."""
    return mode != "none" and loss not in UNCORRECTED


def fixed(mode: str, cap: float, loss: str) -> Correction | None:
    """The correction a mode names without measuring (None: auto, to be measured)."""
    if not corrects(mode, loss):
        return Correction("none")
    if mode == "auto":
        return None
    return Correction(mode, cap)


def choose(
    params: LossParams,
    loss: str,
    tokens: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    total: Reduce,
    maximum: Reduce,
) -> Correction:
    """The correction `params` name, or auto's choice from `tokens` (proximal, behaviour
    and mask of each micro-batch; measured only for auto), reduced across ranks by `total`
    and `maximum` (every rank then makes the same choice)."""
    named = fixed(params.off_policy, params.is_cap, loss)
    if named is not None:
        return named
    measure = Measure()
    for proximal, behaviour, mask in tokens:
        measure.add(proximal, behaviour, mask.to(proximal.device))
    return measure.decide(total, maximum)


class Measure:
    """auto's figures of one minibatch, as sums that add across micro-batches and ranks:
    the drift of pi_prox against the behaviour (`consistency.Drift`), and per cap of CAPS the
    sums of the truncated weights and of their squares."""

    def __init__(self) -> None:
        self.drift = Drift()
        self.caps = torch.zeros(2 * len(CAPS), dtype=torch.float64)

    @torch.no_grad()
    def add(self, proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> None:
        weight = (mask > 0).float()
        self.drift.add(proximal, behaviour, weight)
        live = weight.cpu() > 0
        rho = torch.exp((proximal - behaviour).double().cpu()[live].clamp(max=30.0))
        for i, cap in enumerate(CAPS):
            w = rho.clamp(max=cap)
            self.caps[2 * i] += w.sum()
            self.caps[2 * i + 1] += (w * w).sum()

    def decide(self, total: Reduce, maximum: Reduce) -> Correction:
        drift = self.drift.summary(total, maximum)
        if not drift or drift["log_ratio_p99"] <= TOLERANCE:
            return Correction("none")
        n = float(sum(drift["ratio_histogram"]))
        sums = total(self.caps).tolist()
        chosen = CAPS[0]
        for i, cap in enumerate(CAPS):
            if effective_sample_size(sums[2 * i], sums[2 * i + 1], n) >= MIN_ESS:
                chosen = cap
        return Correction("tis", chosen)


def effective_sample_size(weight_sum: float, weight_sq_sum: float, n: float) -> float:
    """(sum w)^2 / (n sum w^2): 1 when every weight is equal, toward 1/n when one dominates."""
    return weight_sum * weight_sum / (n * weight_sq_sum) if n and weight_sq_sum > 0 else 0.0
