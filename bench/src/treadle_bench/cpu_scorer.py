"""A CPU-bound scorer for `treadle bench reward` (loaded with TREADLE_SCORER_MODULES)."""

from __future__ import annotations

import hashlib

from treadle_reward.public import Score, ScoreInput, Scorer, register


@register("bench_cpu")
class BenchCpu(Scorer):
    """Burns CPU like a heavy verifier: `rounds` chained sha256 over the answer."""

    async def score(self, request: ScoreInput) -> Score:
        digest = request.answer.encode()
        for _ in range(int(request.options.get("rounds", 20_000))):
            digest = hashlib.sha256(digest).digest()
        return Score(reward=digest[0] / 255)
