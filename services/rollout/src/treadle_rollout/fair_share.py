"""Fair shares of one replica's slots among the runs it serves: each run's scheduling claim
(weight, priority, tenant: `fleet.RunPolicy`), the tasks read and waiting for their turn, what
each run's tasks held their slots for, and its tenant's quotas.

The task worker (`worker.py`) asks whose ready task starts when a slot frees: among the
streams `eligible` (the highest priority with work) and `within_quota`, the scheduling policy
picks (`treadle_common.fleet.scheduling`); a started task is `charge`d its run's mean
slot-seconds and settles the difference when it ends.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from treadle_common import names
from treadle_common.fleet import scheduling
from treadle_common.fleet.quotas import QuotaExceeded, TenantQuotas
from treadle_common.proto.treadle.v1 import task_pb2

PRIORITY_HOLD_S = 2.0
"""A run that had work this recently still holds its priority: lower-priority runs wait
(a sync run's next tasks come after its training step). While its tasks run it holds it too,
unless its last pause between tasks on this replica was longer than this: then the slots it
would keep free refill before its next tasks come anyway (`treadle sim share` measured such
a hold idling 6 to 11% of a fleet's slots for nothing), and lower priorities may use them."""


class FairShare:
    def __init__(
        self,
        policy: scheduling.Policy | None,
        quotas: TenantQuotas | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`clock`: seconds, monotonic (the simulator's virtual time drives the same code)."""
        self.clock = clock
        self.policy = policy or scheduling.WeightedFairShare()
        """Which run's ready task starts when a slot frees (`treadle_common.fleet.scheduling`)."""
        self.quotas = quotas
        """Tenants' episode and token quotas: a run whose tenant is at one waits its turn."""
        self.quota_waits = 0
        self.claims: dict[str, scheduling.Claim] = {}
        """Per task stream: its run's claim."""
        self.ready: dict[str, list[tuple[str, object, float]]] = {}
        """Per task stream: tasks read (ours, pending) waiting for the policy's turn."""
        self._slot_s: dict[str, float] = {}  # per run: mean seconds a task held its slot
        self._busy_at: dict[str, float] = {}  # per task stream: when it last had work
        self._running: collections.Counter[str] = collections.Counter()  # tasks in flight
        self._idle_since: dict[str, float] = {}  # per task stream: when it ran out of work
        self._last_pause: dict[str, float] = {}  # per task stream: how long it last had none
        self._mean_slot_s = 1.0

    def contenders(self, active: set[str]) -> tuple[list[str], list[str]]:
        """Who may start a ready task now: the streams of runs that ended (not in `active`;
        their tasks are cancelled first, with no turn to wait for), else the `eligible`
        streams of the active ones, each list oldest ready task first."""
        ready = sorted((s for s, q in self.ready.items() if q), key=self.created)
        gone = [s for s in ready if s not in active]
        return gone, [] if gone else self.eligible(ready)

    def pick(self, eligible: list[str]) -> str:
        """The stream whose ready task starts next, among `eligible` ones."""
        chosen = self.policy.pick([self.claims[s] for s in eligible])
        return names.tasks_stream(chosen.run_id)

    async def within_quota(self, ready: list[str]) -> list[str]:
        """The ready streams whose tenant is at none of its quotas (the others wait)."""
        if self.quotas is None:
            return ready
        blocked: dict[str, str | None] = {}
        for tenant in {self.claims[s].tenant for s in ready}:
            blocked[tenant] = await self.quotas.blocked(tenant)
        within = [s for s in ready if blocked[self.claims[s].tenant] is None]
        self.quota_waits += len(within) < len(ready)
        return within

    async def lease(self, stream: str, entry_id: str, task) -> list[str] | None:
        """Count the task's episodes against its tenant's quota: their ids, or None."""
        if self.quotas is None or not self.quotas.max_episodes:
            return []
        if not isinstance(task, task_pb2.Task):
            return []
        ids = [f"{entry_id}/{i}" for i in range(max(1, task.group_size))]
        try:
            await self.quotas.take_episodes(self.claims[stream].tenant, ids)
        except QuotaExceeded:
            self.quota_waits += 1
            return None
        return ids

    def eligible(self, ready: list[str]) -> list[str]:
        """The ready streams whose run has the highest priority among the runs with work:
        ready, or either within the last `PRIORITY_HOLD_S` (a sync run between two steps,
        training), or in flight when its pauses are that short. Lower-priority runs wait
        meanwhile: a higher priority's tasks never queue behind theirs, and their in-flight
        episodes end without successors."""
        now = self.clock()
        for stream in ready:
            self._busy_at[stream] = now
            if (idle := self._idle_since.pop(stream, None)) is not None:
                self._last_pause[stream] = now - idle
        if not self.policy.strict_priority:
            return ready
        working = [
            s
            for s, at in self._busy_at.items()
            if now - at < PRIORITY_HOLD_S or (self._running[s] and self._holds_while_running(s))
        ]
        if not working:
            return ready
        top = max(self.claims[s].priority for s in working if s in self.claims)
        return [s for s in ready if self.claims[s].priority >= top]

    def _holds_while_running(self, stream: str) -> bool:
        """Whether the run's tasks in flight keep lower priorities waiting: unless its last
        pause (no task ready or running here) outlasted `PRIORITY_HOLD_S`; a run not yet
        seen to pause holds."""
        return self._last_pause.get(stream, 0.0) <= PRIORITY_HOLD_S

    def charge(self, claim: scheduling.Claim) -> Callable[[], None]:
        """Charge `claim` a slot now, at its run's mean slot-seconds per task so far; the
        returned callback, when the task ends, charges the difference to what it held. A
        run whose tasks hold slots long (slow tools, a reward timeout storm) pays for the
        time, not for the count, so it cannot crowd the others out of the slots."""
        estimate = self._slot_s.get(claim.run_id, self._mean_slot_s)
        self.policy.charge(claim, estimate)
        started = self.clock()

        stream = names.tasks_stream(claim.run_id)
        self._running[stream] += 1

        def settle() -> None:
            self._running[stream] -= 1
            self._busy_at[stream] = self.clock()
            if not self._running[stream] and not self.ready.get(stream):
                self._idle_since[stream] = self.clock()
            held = self.clock() - started
            self.policy.charge(claim, held - estimate)
            mean = self._slot_s.get(claim.run_id, held)
            self._slot_s[claim.run_id] = 0.8 * mean + 0.2 * held
            self._mean_slot_s = 0.9 * self._mean_slot_s + 0.1 * held

        return settle

    def tenant_of(self, run: str) -> str:
        """The tenant of an active run (from its claim; `default` when it named none)."""
        claim = self.claims.get(names.tasks_stream(run))
        return claim.tenant if claim is not None else "default"

    def created(self, stream: str) -> float:
        """When the task waiting first in `stream` was fed (the claims' order: oldest first,
        which is all a first-come policy looks at)."""
        task = self.ready[stream][0][1]
        return task.created_at if isinstance(task, task_pb2.Task) else 0.0
