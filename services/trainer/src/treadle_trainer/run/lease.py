"""Run ownership: a fenced lease, so two trainers can never both train one run.

    treadle:{run}:fence  INCR -> a fencing token, never reused
    treadle:{run}:owner  "{instance}#{token}", SET NX PX lease_ms (create or take over);
                         a restarted trainer with the same instance name takes its dead
                         self's lease back at once (`reclaim_own`)

The owner renews the lease with compare-and-PEXPIRE (Lua) every lease / 3 and releases it
with compare-and-DEL. Every write that moves the run on (feeding tasks, reading its
trajectories, committing a checkpoint's ledger) runs in a `transaction` that WATCHes the
owner key and checks it still holds this lease's value: a trainer that stalled past its lease
while another took the run over has its next write refused (`Fenced`) and stops, writing
nothing more.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from treadle_common import names
from treadle_common.clients import streams

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RECLAIM = """
local held = redis.call('GET', KEYS[1])
if held and string.sub(held, 1, string.len(ARGV[1])) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Fenced(RuntimeError):
    """This trainer no longer owns the run: another took it over (or its lease lapsed)."""


class Lease:
    def __init__(self, r: aioredis.Redis, run_id: str, instance: str, lease_ms: int):
        self.r = r
        self.run_id = run_id
        self.instance = instance
        self.lease_ms = lease_ms
        self.key = names.run_owner(run_id)
        self.value: str | None = None
        self.token = 0

    async def acquire(self) -> bool:
        """Take the run if nobody holds it: a new fencing token, then SET NX."""
        token = int(await self.r.incr(names.run_fence(self.run_id)))
        value = f"{self.instance}#{token}"
        if not await self.r.set(self.key, value, px=self.lease_ms, nx=True):
            return False
        self.value, self.token = value, token
        await self.r.hset(names.run_state(self.run_id), "owner", value)
        return True

    async def reclaim_own(self) -> bool:
        """Take the run back from this instance's previous life: a trainer restarted under
        the same `TREADLE_INSTANCE` (the supervisor, a StatefulSet) finds its dead self's
        lease and need not wait for it to lapse. Instance names must be unique among live
        trainers (the default, host-pid, is)."""
        token = int(await self.r.incr(names.run_fence(self.run_id)))
        value = f"{self.instance}#{token}"
        prefix = f"{self.instance}#"
        if not await self.r.eval(_RECLAIM, 1, self.key, prefix, value, self.lease_ms):
            return False
        self.value, self.token = value, token
        await self.r.hset(names.run_state(self.run_id), "owner", value)
        return True

    async def renew(self) -> bool:
        """Extend the lease if it is still ours; False: it is not (stop the run)."""
        if self.value is None:
            return False
        return bool(await self.r.eval(_RENEW, 1, self.key, self.value, self.lease_ms))

    async def release(self) -> None:
        """Give the run up (only if still ours): another trainer takes it over at once."""
        if self.value is not None:
            await self.r.eval(_RELEASE, 1, self.key, self.value)

    async def taken(self) -> bool:
        """Another trainer holds the run now (not merely: our lease lapsed)."""
        raw = await self.r.get(self.key)
        return raw is not None and streams.text(raw) != self.value

    async def holds(self) -> bool:
        raw = await self.r.get(self.key)
        return raw is not None and streams.text(raw) == self.value

    async def transaction(
        self, build: Callable[[aioredis.client.Pipeline], Awaitable[None] | None]
    ) -> list[Any]:
        """MULTI/EXEC the commands `build` queues, only while this lease holds the run;
        `Fenced` when it does not. A renewal between the check and EXEC retries."""
        while True:
            async with self.r.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(self.key)
                    raw = await pipe.get(self.key)
                    if raw is None or streams.text(raw) != self.value:
                        raise Fenced(
                            f"run {self.run_id} is owned by "
                            f"{streams.text(raw) if raw else 'nobody'}, not {self.value}: "
                            "this trainer lost its lease"
                        )
                    pipe.multi()
                    queued = build(pipe)
                    if queued is not None:
                        await queued
                    return await pipe.execute()
                except WatchError:
                    continue  # the key was written (our own renewal, or a takeover): check again
