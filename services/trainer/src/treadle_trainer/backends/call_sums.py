"""The sums of one `forward_backward` call over its loss tokens: the loss, the per-token
statistics the loss computes, the drift (`consistency.Drift`) and the off-policy correction's
weights; added across ranks at the end (`result`)."""

from __future__ import annotations

from typing import Any

import torch

from treadle_trainer import off_policy
from treadle_trainer.consistency import Drift, Reduce

_KEYS = ("loss", "tokens", "entropy", "kl", "clip_fraction", "ratio", "behaviour_weight")
_CORRECTION_KEYS = ("off_policy_weight", "off_policy_weight_sq", "off_policy_masked")


class CallSums:
    """A `forward_backward` call's sums over its loss tokens (added across ranks at the end)."""

    def __init__(self) -> None:
        zero = torch.zeros((), dtype=torch.float64)
        self.values = {k: zero.clone() for k in _KEYS + _CORRECTION_KEYS}
        self.present: set[str] = set()
        self.drift = Drift()  # trainer vs behaviour logprobs (consistency.py)

    def add(
        self,
        value: torch.Tensor,
        mask: torch.Tensor,
        stats: dict[str, torch.Tensor],
        correction_B_T: torch.Tensor | None,
    ) -> None:
        weight = (mask > 0).float()
        self.values["loss"] += value.detach().double().cpu()
        self.values["tokens"] += weight.sum().double().cpu()
        if correction_B_T is not None:
            stats["off_policy_weight"] = correction_B_T
            stats["off_policy_weight_sq"] = correction_B_T * correction_B_T
            stats["off_policy_masked"] = (correction_B_T == 0).float()
        for name, per_token in stats.items():
            self.values[name] += (per_token * weight).sum().double().cpu()
            self.present.add(name)

    def result(
        self, total: Reduce, maximum: Reduce, correction: off_policy.Correction
    ) -> dict[str, Any]:
        keys = _KEYS + _CORRECTION_KEYS
        summed = total(torch.stack([self.values[k] for k in keys]))
        out = dict(zip(keys, summed.tolist(), strict=True))
        tokens = max(out["tokens"], 1.0)
        means = {k: out[k] / tokens for k in keys[2:] if k in self.present}
        w, w2 = means.pop("off_policy_weight", 1.0), means.pop("off_policy_weight_sq", 1.0)
        return {
            "loss": out["loss"],
            "num_tokens": out["tokens"],
            **means,
            **self.drift.summary(total, maximum),
            "off_policy": correction.mode,
            "off_policy_cap": correction.cap,
            "off_policy_masked": means.get("off_policy_masked", 0.0),
            "off_policy_ess": off_policy.effective_sample_size(w, w2, 1.0),
        }
