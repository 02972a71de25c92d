"""Policy losses, selected by name. Each takes per-token tensors and returns a scalar.

Shapes: B sequences, T tokens (targets, i.e. shifted by one).
"""

from __future__ import annotations

import torch


def policy_gradient(
    logprobs_B_T: torch.Tensor, advantages_B: torch.Tensor, mask_B_T: torch.Tensor
) -> torch.Tensor:
    """REINFORCE with a group baseline: -mean over generated tokens of A * log pi(token)."""
    per_token_B_T = -advantages_B[:, None] * logprobs_B_T * mask_B_T
    return per_token_B_T.sum() / mask_B_T.sum().clamp(min=1)


LOSSES = {"policy_gradient": policy_gradient}
