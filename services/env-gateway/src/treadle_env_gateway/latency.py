"""Latency injection: slow, heavy-tailed tools on one machine, for agentic benchmarks.

Session option `latency`:
    {"fixed_ms": 50}                                       every step waits 50 ms
    {"distribution": "lognormal", "median_ms": 200, "sigma": 1.0}   heavy-tailed waits
Delays are drawn from a generator seeded by the task and the session seed, so runs are
reproducible.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from treadle_env_gateway.envs.base import EnvError, option

MAX_DELAY_MS = 60_000.0
"""The longest one injected delay may be."""


class Latency:
    def __init__(self, spec: dict[str, Any], seed: int | str):
        self.rng = random.Random(seed)
        self.fixed_ms = option(spec, "fixed_ms", 0.0, 0.0, MAX_DELAY_MS)
        self.distribution = spec.get("distribution")
        if self.distribution not in (None, "lognormal"):
            raise EnvError(
                f"latency distribution {self.distribution!r} is not one of ['lognormal']"
            )
        self.median_ms = option(spec, "median_ms", 0.0, 0.0, MAX_DELAY_MS)
        self.sigma = option(spec, "sigma", 1.0, 0.0, 4.0)
        self.max_ms = option(spec, "max_ms", MAX_DELAY_MS, 0.0, MAX_DELAY_MS)

    def sample_ms(self) -> float:
        delay = self.fixed_ms
        if self.distribution == "lognormal" and self.median_ms > 0:
            delay += self.rng.lognormvariate(math.log(self.median_ms), self.sigma)
        return min(delay, self.max_ms)

    async def wait(self) -> float:
        delay = self.sample_ms()
        if delay > 0:
            await asyncio.sleep(delay / 1000)
        return delay


def latency_from(options: dict[str, Any], seed: int | str) -> Latency | None:
    spec = options.get("latency")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise EnvError("option 'latency' must be an object, e.g. {\"fixed_ms\": 50}")
    return Latency(spec, seed)
