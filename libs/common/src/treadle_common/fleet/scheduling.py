"""Who gets the next slot when runs contend: one explicit, pluggable policy.

Every shared resource that several runs queue for asks a `Policy` which waiting run goes
next: rollout's task slots (`treadle_rollout.worker`: which run's group starts next, hence
its env sessions, engine rows and reward calls) and the trainer's torch thread
(`FairTurns`: whose step runs next). A `Claim` is a run with work waiting, its weight and
priority (from the recipe's `scheduling` section) and its tenant.

`WeightedFairShare` (the default) is start-time fair queueing over virtual time:

    pick:   the highest priority among the claims; within it, the least virtual time
            (ties: the run id, so the choice is deterministic)
    charge: a run's virtual time grows by cost / weight for what it was granted (rollout: the
            seconds its task holds a slot, estimated at dispatch and settled at the end;
            trainer: the step's seconds)
    join:   a run that was idle starts at the smallest virtual time of the runs active at its
            priority, so idling banks no credit and a newcomer does not starve the others

so runs of equal priority get shares of the contended capacity proportional to their
weights, and a higher priority's work always goes first. `Fifo` (first come, first served)
is the baseline it is measured against (`treadle bench multirun`).

Work-conserving shares reach only as far as runs queue; the trainer's turns add pacing on top
(`pacing.py`): a run too many weighted steps ahead of its peers waits, so the step rates of
runs that all keep up follow their weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from treadle_common.fleet.pacing import Pacing


@dataclass(frozen=True)
class Claim:
    """A run with work waiting for the resource."""

    run_id: str
    weight: float = 1.0
    priority: int = 0
    tenant: str = "default"


class Policy(Protocol):
    strict_priority: bool
    """Lower priorities wait while a higher one has work (callers that see work come and
    go, like rollout's task slots, hold them back for a moment after it)."""

    def pick(self, claims: Sequence[Claim]) -> Claim:
        """The claim that gets the next slot (`claims` is not empty; the one whose work
        waited longest first)."""
        ...

    def charge(self, claim: Claim, cost: float) -> None:
        """`claim` was granted a slot costing `cost` (its unit is the resource's)."""
        ...


class WeightedFairShare:
    """Strict priority, then weighted fair share by virtual time (see the module)."""

    strict_priority = True

    def __init__(self) -> None:
        self.vtime: dict[str, float] = {}

    def _start(self, claim: Claim, claims: Sequence[Claim]) -> float:
        if claim.run_id in self.vtime:
            return self.vtime[claim.run_id]
        peers = [self.vtime[c.run_id] for c in claims if c.run_id in self.vtime]
        return min(peers, default=0.0)

    def pick(self, claims: Sequence[Claim]) -> Claim:
        top = max(c.priority for c in claims)
        level = [c for c in claims if c.priority == top]
        for claim in level:  # joiners start level with the least-served active run
            self.vtime[claim.run_id] = self._start(claim, level)
        return min(level, key=lambda c: (self.vtime[c.run_id], c.run_id))

    def charge(self, claim: Claim, cost: float) -> None:
        self.vtime[claim.run_id] = self.vtime.get(claim.run_id, 0.0) + cost / claim.weight

    def forget(self, run_id: str) -> None:
        """The run ended: its virtual time goes (a run id is never reused)."""
        self.vtime.pop(run_id, None)


class Fifo:
    """First come, first served: the claim listed first (callers list the claim whose work
    waited longest first): the baseline, blind to weights and priorities."""

    strict_priority = False

    def pick(self, claims: Sequence[Claim]) -> Claim:
        return claims[0]

    def charge(self, claim: Claim, cost: float) -> None:
        pass


POLICIES: dict[str, Callable[[], Policy]] = {"fair": WeightedFairShare, "fifo": Fifo}
"""Policies by name (`TREADLE_SCHEDULING_POLICY`)."""


def make(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; one of {sorted(POLICIES)}")
    return POLICIES[name]()


def turns_for(policy: str, holders: int, pace_lead: float = 0.0) -> FairTurns:
    """Turns under the policy named `policy`, paced by `pace_lead` (fair only; 0: unpaced)."""
    pacing = Pacing(pace_lead) if pace_lead > 0 and policy == "fair" else None
    return FairTurns(make(policy), holders, pacing)


class FairTurns:
    """A resource used by at most `holders` claims at a time (the trainer's torch lanes),
    each turn handed to the waiting claim the policy picks and charged the seconds it was
    held. With `pacing`, a claim too far ahead of its peers waits even while a lane is free
    (`pacing.Pacing`): `held_s` counts those seconds per run."""

    def __init__(self, policy: Policy, holders: int = 1, pacing: Pacing | None = None):
        self.policy = policy
        self.holders = holders
        self.pacing = pacing
        self._waiting: list[tuple[Claim, asyncio.Future[None]]] = []
        self._held = 0
        self._held_since: dict[asyncio.Future[None], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.granted: dict[str, int] = {}
        self.held_s: dict[str, float] = {}

    @contextlib.asynccontextmanager
    async def turn(self, claim: Claim) -> AsyncIterator[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.pacing is not None:
            self.pacing.request(claim)
        self._waiting.append((claim, future))
        try:
            self._next()
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():  # granted as we were cancelled
                    self._release(claim, 0.0)
                else:
                    self._waiting = [(c, f) for c, f in self._waiting if f is not future]
                    self._held_since.pop(future, None)
                raise
            started = time.perf_counter()
            try:
                yield
            finally:
                self._release(claim, time.perf_counter() - started)
        finally:
            if self.pacing is not None:
                self.pacing.done(claim)
                self._next()  # a peer it held back may go now

    def _release(self, claim: Claim, held_s: float) -> None:
        self.policy.charge(claim, held_s)
        self._held -= 1
        self._next()

    def _next(self) -> None:
        self._waiting = [(c, f) for c, f in self._waiting if not f.done()]
        while self._held < self.holders and self._waiting:
            eligible, wake = self._eligible()
            if not eligible:
                self._wake_at(wake)
                return
            chosen = self.policy.pick(eligible)
            index = next(i for i, (c, _) in enumerate(self._waiting) if c is chosen)
            claim, future = self._waiting.pop(index)
            self._held += 1
            self.granted[claim.run_id] = self.granted.get(claim.run_id, 0) + 1
            if self.pacing is not None:  # only pacing holds a claim back
                since = self._held_since.pop(future, None)
                if since is not None:
                    held = self.pacing.clock() - since
                    self.held_s[claim.run_id] = self.held_s.get(claim.run_id, 0.0) + held
                self.pacing.granted(claim)
            future.set_result(None)

    def _eligible(self) -> tuple[list[Claim], float]:
        """The waiting claims pacing lets go now (in waiting order), and the clock time the
        first of the others may go unless a turn changes it first."""
        if self.pacing is None:
            return [c for c, _ in self._waiting], math.inf
        eligible, wake = [], math.inf
        for claim, future in self._waiting:
            until = self.pacing.hold(claim)
            if until is None:
                eligible.append(claim)
            else:
                self._held_since.setdefault(future, self.pacing.clock())
                wake = min(wake, until)
        return eligible, wake

    def _wake_at(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if math.isfinite(when):
            loop = asyncio.get_running_loop()
            assert self.pacing is not None  # only pacing holds a claim back
            delay = max(0.0, when - self.pacing.clock()) + 0.001
            self._timer = loop.call_later(delay, self._next)
