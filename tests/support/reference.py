"""Reference computations the engine tests compare against."""

from __future__ import annotations

import torch


@torch.no_grad()
def teacher_forced_logprobs(
    model, prompt: list[int], generated: list[int], temperature: float = 1.0
) -> list[float]:
    """Logprobs of `generated` after `prompt` from one plain forward pass (no cache, no pad)."""
    ids = torch.tensor([prompt + generated])
    logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(generated)]
