"""Collecting a run's trajectories into complete groups.

    treadle:{run}:trajectories --XREADGROUP (group `trainer`, consumer `owner`)--> validate
        --> GroupBuffer (complete groups), or a counted drop (invalid, duplicate, not ours)

A step takes `tasks_per_step` complete groups that are not wholly stale; wholly stale groups
(and groups with a failed or malformed member) met on the way come along (the step drops
them, counted) without taking a trainable one's place, and the feeder feeds a task for each.
Entries stay pending in Redis until a checkpoint acks them (`ledger.py`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.api.runs import RunStatus
from treadle_common.clients import streams
from treadle_common.config.recipe import RunConfig
from treadle_common.fleet import breaker
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_common.runtime.logs import get_logger
from treadle_common.runtime.progress import Stage
from treadle_trainer.batches import (
    Entry,
    Group,
    GroupBuffer,
    invalid_reason,
    is_whole,
    staleness,
)
from treadle_trainer.run.feeder import EnvCircuitOpen, Feeder
from treadle_trainer.run.lease import Lease
from treadle_trainer.run.ledger import Drops, Ledger, LedgerEntry, LooseDrop

log = get_logger(__name__)
MAX_REPLACED = 2
"""A step replaces at most this many times its groups (unusable ones) at once."""
UNUSABLE = "groups_unusable"
"""Run-state counter: groups taken that no step could train (wholly stale, or no valid
member); each is replaced by a newly fed task."""


class Stopping(Exception):
    """The owner is handing the run off: stop waiting for a batch."""


class Collector:
    def __init__(
        self,
        config: RunConfig,
        r: aioredis.Redis,
        consumer: str,
        status: RunStatus,
        ledger: Ledger,
        drops: Drops,
        fed: set[str],
        stage: Stage,
        lease: Lease,
    ):
        self.config = config
        self.r = r
        self.consumer = consumer
        self.status = status
        self.ledger = ledger
        self.drops = drops
        self.fed = fed
        self.stage = stage
        self.lease = lease
        self.stream = names.trajectories_stream(config.run_id)
        self.buffer = GroupBuffer(config.rollout.group_size)
        self.seen: set[str] = set()
        self.replayed: set[str] = set()
        """Entries the last owner read (replayed at a resume): groups generated for steps
        past the checkpoint, stale once the run goes back to it. Their replacements do not
        count against `MAX_REPLACED` (that bound is for groups that keep coming back bad)."""
        self.vocab_size = 0
        self.collecting = False
        self.stopping = False

    async def replay_pending(self) -> None:
        """What the last owner read but never committed: validated again, in order."""
        for _, entry_id, traj in await streams.pending_own(
            self.r, self.stream, names.TRAINER_GROUP, self.consumer, tpb.Trajectory, 1_000_000
        ):
            self.replayed.add(entry_id)
            self.accept(entry_id, traj)

    def accept(self, entry_id: str, traj: tpb.Trajectory | streams.InvalidEntry) -> None:
        """Validate one entry read from Redis: into the group buffer, or a counted drop."""
        if isinstance(traj, streams.InvalidEntry):
            return self._drop(entry_id, "", "invalid_entry")
        if not traj.trajectory_id or not traj.group_id:
            return self._drop(entry_id, traj.trajectory_id, "missing_ids")
        if traj.trajectory_id in self.seen:
            self.status.duplicates += 1
            return self._drop(entry_id, traj.trajectory_id, "duplicate")
        if traj.group_id not in self.fed and not self.config.trainer.external_groups:
            return self._drop(entry_id, traj.trajectory_id, "unknown_group")
        # a malformed member of one of our groups still completes its group (else the group
        # would wait forever); its step drops it with the reason
        self.seen.add(traj.trajectory_id)
        self.status.trajectories_consumed += 1
        self.buffer.add(Entry(entry_id, traj, invalid_reason(traj, self.vocab_size)))

    def _drop(self, entry_id: str, trajectory_id: str, reason: str) -> None:
        self.ledger.drop_loose(LooseDrop(entry_id, trajectory_id, reason))
        self.status.rejected += 1
        self.drops.count(reason)
        log.warning("trajectory dropped", entry=entry_id, reason=reason)

    async def collect(
        self,
        num_groups: int,
        version: int,
        max_staleness: int,
        refill: Callable[[], Awaitable[int]] | None = None,
    ) -> list[Group]:
        """Read until `num_groups` complete groups that are not wholly stale at `version` are
        buffered, then take them, with the wholly stale ones met on the way. `refill` feeds
        the tasks that replace unusable groups and dead-lettered tasks (at once: this step
        may need them); how many it fed."""
        t = self.config.trainer
        deadline = time.monotonic() + t.batch_timeout_s
        taken: list[Group] = []
        fresh = wasted = replaced = 0
        self.collecting = True
        try:
            while True:
                unusable = 0
                for group in self.buffer.take(num_groups - fresh):
                    taken.append(group)
                    if self._usable(group, version, max_staleness):
                        fresh += 1
                    else:  # the feeder feeds a task in its place (a step would lack it)
                        unusable += 1
                        replayed = all(e.entry_id in self.replayed for e in group.entries)
                        wasted += 0 if replayed else 1
                if unusable:
                    await self.r.hincrby(names.run_state(self.config.run_id), UNUSABLE, unusable)
                    # replaced at once, but not without end: a step whose groups keep coming
                    # back unusable (an env failing every episode) waits for its timeout
                    # instead of burning the dataset
                    if refill is not None and wasted <= MAX_REPLACED * num_groups:
                        await refill()
                if fresh >= num_groups:
                    return taken
                if self.stopping:
                    self.buffer.ready[:0] = taken  # untrained: the next owner replays them
                    raise Stopping()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"only {fresh}/{num_groups} complete groups after {t.batch_timeout_s}s"
                    )
                if not await self.read(block_ms=1000):
                    # nothing came for a second: a run whose env is circuit-broken fails,
                    # and tasks rollout gave up on are replaced, but not without end
                    await self._check_env()
                    if refill is not None and replaced <= MAX_REPLACED * num_groups:
                        replaced += await refill()
        finally:
            self.collecting = False
        self.stopping = False

    async def _check_env(self) -> None:
        """Raise `EnvCircuitOpen` once rollout opened the breaker of the run's env."""
        why = await breaker.why_open(self.r, self.config.run_id, self.config.env.name)
        if why is not None:
            raise EnvCircuitOpen.of(self.config, why)

    @staticmethod
    def _usable(group: Group, version: int, max_staleness: int) -> bool:
        """A group with no failed or malformed member (`step.build_batch` drops such a group
        whole) and a member recent enough to train on."""
        return is_whole(group.entries) and any(
            staleness(e.traj, version) <= max_staleness for e in group.entries
        )

    async def read(self, block_ms: int | None) -> int:
        """Read new trajectories into the buffer (or counted drops); how many were read.

        Fenced: the group read (which moves the entries to this consumer) runs in the
        lease's transaction, so a trainer that lost the run takes nothing from its new owner;
        waiting for new entries is a plain XREAD from the stream's last id, which moves
        nothing."""
        batch, last = await self._read_fenced()
        if not batch and block_ms:
            await self.r.xread({self.stream: last}, count=1, block=block_ms)
            batch, _ = await self._read_fenced()
        for _, entry_id, traj in batch:
            self.accept(entry_id, traj)
        if batch:
            self.stage.tick(len(batch))
        return len(batch)

    async def _read_fenced(self) -> tuple[list, str]:
        cfg = self.config
        count = max(cfg.trainer.tasks_per_step * cfg.rollout.group_size, 64)

        def queue(pipe: aioredis.client.Pipeline) -> None:
            pipe.xreadgroup(names.TRAINER_GROUP, self.consumer, {self.stream: ">"}, count=count)
            pipe.xrevrange(self.stream, count=1)

        reply, last = await self.lease.transaction(queue)
        return streams.entries(reply, tpb.Trajectory), streams.text(last[0][0]) if last else "0-0"

    async def finish(self, feeder: Feeder, step: int, version: int) -> None:
        """After the last step (admission closed): cancel the fed tasks no replica started,
        let the groups in flight land, and drop every trajectory no step used as
        `run_ended`. The final checkpoint acks them with the run's last ledger entry, so the
        run ends with nothing pending and every produced trajectory accounted for once."""
        run = self.config.run_id
        await feeder.cancel_unstarted(f"{self.consumer}-end")
        deadline = time.monotonic() + self.config.trainer.batch_timeout_s
        while await feeder.in_flight() > 0:
            if time.monotonic() > deadline:
                log.warning("run end: tasks still in flight on rollout are left pending", run=run)
                break
            await self.read(block_ms=200)
        while await self.read(block_ms=None):
            pass
        unused = self.buffer.take_all()
        dropped = {e.traj.trajectory_id: "run_ended" for g in unused for e in g.entries}
        for reason in dropped.values():
            self.drops.count(reason)
        entries = [e.entry_id for g in unused for e in g.entries]
        if entries or self.ledger.loose:
            self.ledger.add(LedgerEntry(step, "run_end", version, entries, [], dropped))
