"""Processor sharing on one host: components that run on the same cores slow each other.

A scenario with a `host` puts every rollout replica and the trainer on that host's cores
(a small machine such as the 2-core dev VM, where `treadle bench step` runs). Each component
states its costs as measured alone, with its own threads. While busy components ask for more
threads than the host has cores, the kernel shares the cores between the runnable threads:
- a one-thread component moves between cores and gets its fair share, cores / (threads asked);
- a component of several threads that meet at barriers (torch's OpenMP regions) goes at the
  pace of its slowest thread, the one on the most crowded core: 1 / ceil(threads asked /
  cores), while its other threads wait at the barrier.
Without a host every component has its own hardware and runs at full speed.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import simpy


class Cpu:
    """Who is busy on the host, and how fast that lets each one run."""

    def __init__(self, env: simpy.Environment, cores: float | None):
        self.env, self.cores = env, cores
        self._busy: dict[object, int] = {}
        self.changed = env.event()
        """Succeeds when the busy set next changes (and is then replaced)."""

    def speed(self, threads: int = 1) -> float:
        """The share of its own speed a busy component of `threads` threads gets now."""
        asked = sum(self._busy.values())
        if self.cores is None or asked <= self.cores:
            return 1.0
        if threads == 1:
            return self.cores / asked
        return 1.0 / math.ceil(asked / self.cores)

    def set_busy(self, who: object, threads: int, busy: bool) -> None:
        if self.cores is None or (who in self._busy) == busy:
            return
        if busy:
            self._busy[who] = threads
        else:
            del self._busy[who]
        changed, self.changed = self.changed, self.env.event()
        changed.succeed()

    def work(self, who: object, threads: int, seconds: float) -> Generator[Any, Any, float]:
        """Run `seconds` of work (measured alone) on the host; returns the seconds it took."""
        start = self.env.now
        self.set_busy(who, threads, True)
        remaining = seconds
        try:
            while remaining > 1e-12:
                rate, at = self.speed(threads), self.env.now
                yield self.env.timeout(remaining / rate) | self.changed
                remaining -= (self.env.now - at) * rate
        finally:
            self.set_busy(who, threads, False)
        return self.env.now - start
