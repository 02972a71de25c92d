"""Paced shares: the runs of one priority kept within `lead` weighted turns of each other.

Fair share by virtual time (`scheduling.WeightedFairShare`) is work-conserving: a weight buys
more only where runs queue for the resource. A sync run spends most of its cycle elsewhere
(generation, env, reward, publishing), so on a busy 2-core stack four runs weighted 2:1:1:1
stepped at about 1.4:1:1:1 (docs/concepts/many-runs.md, `treadle bench multirun`). Pacing
makes the weights hold for what a user counts, steps: a run's turns advance it by
1 / weight, and a run `lead` or more ahead of the least advanced peer at its priority waits
for its turn, so the cores it would have used go to the runs behind.

A peer counts only while it keeps up: it waits for or holds a turn, or its last one ended
within the window (`keep_up` times the runs' median gap between a turn and their next request,
at least `min_window_s`). A stalled, failing or far slower run drops out, so it holds the
others back for at most a window at a time (failure containment), and comes back level with
the least advanced peer that kept up (no banked credit, like a newcomer). Higher priorities
are never paced by lower ones (`FairTurns` serves them first anyway).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treadle_common.fleet.scheduling import Claim

GAP_SMOOTHING = 0.2
"""Weight of the newest gap in a run's moving average."""


@dataclass
class _Run:
    priority: int
    units: float = 0.0
    """Turns granted / weight, from the level it joined at."""
    last_end: float = 0.0
    gap: float | None = None
    """Moving average of the time from a turn's end to the run's next request."""
    busy: int = 0
    """Turns it waits for or holds now."""


class Pacing:
    def __init__(
        self,
        lead: float = 2.0,
        keep_up: float = 3.0,
        min_window_s: float = 1.0,
        forget_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if lead <= 0:
            raise ValueError("lead must be positive (no pacing: no Pacing)")
        self.lead, self.keep_up, self.min_window_s = lead, keep_up, min_window_s
        self.forget_s, self.clock = forget_s, clock
        self._runs: dict[str, _Run] = {}

    def window(self) -> float:
        """How recent a peer's last turn must be for it to count as keeping up."""
        gaps = sorted(r.gap for r in self._runs.values() if r.gap is not None)
        median = gaps[len(gaps) // 2] if gaps else 0.0
        return max(self.min_window_s, self.keep_up * median)

    def _keeps_up(self, run: _Run, now: float, window: float) -> bool:
        return run.busy > 0 or now - run.last_end <= window

    def _peers(self, run_id: str, priority: int, now: float, window: float) -> list[_Run]:
        return [
            r
            for rid, r in self._runs.items()
            if rid != run_id and r.priority == priority and self._keeps_up(r, now, window)
        ]

    def request(self, claim: Claim) -> None:
        """`claim` asks for a turn. A newcomer, or a run that fell behind the window, starts
        level with the least advanced peer that kept up."""
        now, window = self.clock(), self.window()
        for rid in [
            r for r, x in self._runs.items() if not x.busy and now - x.last_end > self.forget_s
        ]:
            del self._runs[rid]
        run = self._runs.get(claim.run_id)
        if run is None or not self._keeps_up(run, now, window):
            peers = self._peers(claim.run_id, claim.priority, now, window)
            level = min((p.units for p in peers), default=0.0)
            if run is None:
                run = self._runs[claim.run_id] = _Run(claim.priority, level)
            else:
                run.units = max(run.units, level)
        elif not run.busy:
            gap = now - run.last_end
            run.gap = gap if run.gap is None else run.gap + GAP_SMOOTHING * (gap - run.gap)
        run.priority = claim.priority
        run.busy += 1

    def hold(self, claim: Claim) -> float | None:
        """None if `claim` may take a turn now; else until when it waits at most: the clock
        time the peers it leads drop out of the window unless they take a turn first (which
        `FairTurns` checks again at), or `inf` while one of them waits for or holds a turn."""
        now, window = self.clock(), self.window()
        run = self._runs[claim.run_id]
        peers = self._peers(claim.run_id, run.priority, now, window)
        behind = [p for p in peers if run.units - p.units >= self.lead]
        if not behind:
            return None
        if any(p.busy for p in behind):
            return math.inf
        return max(p.last_end for p in behind) + window

    def granted(self, claim: Claim) -> None:
        self._runs[claim.run_id].units += 1.0 / claim.weight

    def done(self, claim: Claim) -> None:
        """The turn ended (or the wait for it was given up)."""
        run = self._runs[claim.run_id]
        run.busy -= 1
        run.last_end = self.clock()
