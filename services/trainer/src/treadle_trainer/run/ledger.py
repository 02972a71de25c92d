"""The run's ledger: every trajectory entry a step used or dropped, committed exactly once.

Entries trained or dropped since the last checkpoint wait here as `LedgerEntry`s (one per
step, plus one at the run's end). A checkpoint commits them in one Redis transaction:

    WATCH owner, check it is still this trainer's lease (fencing)
    MULTI: XACK every entry of those steps + XADD one ledger record per step
           + the run's checkpoint step and path -> EXEC

so a crash either loses the uncommitted steps whole (the restored owner replays their still
pending entries) or none of them. `Drops` counts every dropped trajectory by reason.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.api.runs import RunStatus
from treadle_common.clients import streams
from treadle_common.runtime import metrics
from treadle_trainer.run.lease import Lease

SERVICE = "trainer"


@dataclass
class LedgerEntry:
    """What one step (or the run's end) did with the stream entries it consumed."""

    step: int
    kind: Literal["step", "run_end", "rollback"]
    version: int
    entries: list[str] = field(default_factory=list)
    """Stream entry ids to ack: every one the step used or dropped."""
    trained: list[str] = field(default_factory=list)
    """Trajectory ids the step trained on."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Trajectory id (entry id when there is none) -> why it was not trained."""


@dataclass(frozen=True)
class LooseDrop:
    """An entry dropped as it was read (invalid, duplicate, unknown group): no step used it,
    so the next ledger entry acks it."""

    entry_id: str
    trajectory_id: str
    reason: str


class Drops:
    """Dropped trajectories by reason: in the run's status and in the service's metrics."""

    def __init__(self, status: RunStatus):
        self.status = status
        self.counts: Counter[str] = Counter(status.dropped)

    def count(self, reason: str) -> None:
        self.counts[reason] += 1
        metrics.DROPPED.labels(SERVICE, "trajectory", reason).inc()
        self.status.dropped = dict(self.counts)

    def reload(self) -> None:
        """After the status was restored from a checkpoint."""
        self.counts = Counter(self.status.dropped)


class Ledger:
    def __init__(self, r: aioredis.Redis, run_id: str, lease: Lease):
        self.r = r
        self.run_id = run_id
        self.lease = lease
        self.stream = names.trajectories_stream(run_id)
        self.uncommitted: list[LedgerEntry] = []
        self.loose: list[LooseDrop] = []

    def drop_loose(self, drop: LooseDrop) -> None:
        self.loose.append(drop)

    def add(self, entry: LedgerEntry) -> None:
        """Record a step's entries, with the loose drops read since the last one."""
        loose, self.loose = self.loose, []
        entry.entries += [d.entry_id for d in loose]
        entry.dropped.update({d.trajectory_id or d.entry_id: d.reason for d in loose})
        self.uncommitted.append(entry)

    async def checkpoints(self, scan: int = 256) -> list[Path]:
        """The run's committed checkpoints, newest first (from its last `scan` records)."""
        records: Any = await self.r.xrevrange(names.ledger_stream(self.run_id), count=scan)
        paths = [Path(streams.text(fields[b"checkpoint"])) for _, fields in records]
        return list(dict.fromkeys(paths))

    @property
    def pending_acks(self) -> int:
        return sum(len(e.entries) for e in self.uncommitted)

    async def commit(self, step: int, checkpoint: Path, status: str = "") -> None:
        """Ack and ledger every uncommitted entry, with the checkpoint that holds their
        effect, in one transaction, fenced: refused (`Fenced`) unless this trainer still owns
        the run."""

        def queue(pipe: aioredis.client.Pipeline) -> None:
            for e in self.uncommitted:
                if e.entries:
                    pipe.xack(self.stream, names.TRAINER_GROUP, *e.entries)
                pipe.xadd(
                    names.ledger_stream(self.run_id),
                    {
                        "step": e.step,
                        "kind": e.kind,
                        "version": e.version,
                        "checkpoint": str(checkpoint),
                        "trained": json.dumps(e.trained),
                        "dropped": json.dumps(e.dropped),
                    },
                )
            pipe.hset(
                names.run_state(self.run_id),
                mapping={
                    "checkpoint_step": step,
                    "checkpoint_path": str(checkpoint),
                    "committed_status": status,  # its counters, should the checkpoint be lost
                },
            )

        await self.lease.transaction(queue)
        self.uncommitted.clear()
