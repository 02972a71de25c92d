"""Training data whose behaviour logprobs differ from the trainer's by a known shift."""

from __future__ import annotations

import random

import torch

from treadle_trainer.backends.logprobs import token_logprobs
from treadle_trainer.batches import Datum, pack


def on_policy_data(backend, rng: random.Random, shift: float) -> list[Datum]:
    """Completions scored by the backend itself as their behaviour logprobs, minus `shift`
    (a rollout engine whose logprobs are that much lower than the trainer's)."""
    data = []
    for _ in range(4):
        prompt = [rng.randrange(5, 200) for _ in range(6)]
        completion = [rng.randrange(5, 200) for _ in range(3)]
        ids = prompt + completion
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion) + [0.0]
        data.append(Datum(ids, ids[1:] + [2], weights, [w * 0.5 for w in weights], weights))
    (mb,) = pack(data, 4096, "token", backend.pad_id)
    with torch.no_grad():
        lp, _ = token_logprobs(backend.model, mb, "cpu", entropy=False, temperature=1.0)
    for i, datum in enumerate(data):
        n = len(datum.input_ids)
        datum.logprobs = [float(lp[i, t]) - shift for t in range(n)]
    return data
