"""Per-tenant quotas on what the fleet spends, held in Redis so every replica sees the same
counts (the settings `tenant_max_episodes`, `tenant_max_tokens_per_minute`; runs and stored
bytes are counted by the trainer and the weight-store).

    episodes   a sorted set per tenant: one member per episode in flight, scored by when its
               lease lapses (`LEASE_S`), so a replica that died frees its count by itself
    tokens     a counter per tenant and minute, expiring after two minutes

`take_episodes` is atomic (a Lua script): of two replicas racing for a tenant's last
episode, one gets it. A caller past a quota gets `QuotaExceeded`, whose message names the
quota (`quota episodes: ...`); HTTP answers it with 429, rollout's task worker waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from treadle_common import names

LEASE_S = 900.0
"""An episode's count lapses this long after it started unless released (a dead replica's)."""

_TAKE = """
local key, now, lease, limit, n = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]),
    tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local held = redis.call('ZCARD', key)
if limit > 0 and held + n > limit then return held end
for i = 5, #ARGV do redis.call('ZADD', key, now + lease, ARGV[i]) end
redis.call('EXPIRE', key, math.ceil(lease))
return -1
"""


class QuotaExceeded(Exception):
    """A tenant is past one of its quotas; the message names it."""


@dataclass
class TenantQuotas:
    r: aioredis.Redis
    max_episodes: int = 0
    max_tokens_per_minute: int = 0

    def __post_init__(self) -> None:
        self._take = self.r.register_script(_TAKE)

    async def take_episodes(self, tenant: str, ids: list[str]) -> None:
        """Count episodes `ids` in flight for `tenant`, or `QuotaExceeded` (none counted)."""
        now = time.time()
        held = await self._take(
            keys=[names.tenant_episodes(tenant)],
            args=[now, LEASE_S, self.max_episodes, len(ids), *ids],
        )
        if int(held) >= 0:
            raise QuotaExceeded(
                f"quota episodes: tenant {tenant!r} has {held} episodes in flight, "
                f"{len(ids)} more would pass its {self.max_episodes}"
            )

    async def release_episodes(self, tenant: str, ids: list[str]) -> None:
        if ids:
            await self.r.zrem(names.tenant_episodes(tenant), *ids)

    async def check_tokens(self, tenant: str) -> None:
        """`QuotaExceeded` if `tenant` already generated its tokens of this minute."""
        if not self.max_tokens_per_minute:
            return
        used = int(await self.r.get(names.tenant_tokens(tenant, _minute())) or 0)
        if used >= self.max_tokens_per_minute:
            raise QuotaExceeded(
                f"quota tokens_per_minute: tenant {tenant!r} generated {used} tokens this "
                f"minute, its most is {self.max_tokens_per_minute}; try again in "
                f"{60 - int(time.time()) % 60} s"
            )

    async def add_tokens(self, tenant: str, n: int) -> None:
        if n <= 0:
            return
        key = names.tenant_tokens(tenant, _minute())
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.incrby(key, n)
            pipe.expire(key, 120)
            await pipe.execute()

    async def blocked(self, tenant: str) -> str | None:
        """Why `tenant` may start no episode now (a quota it is at), or None."""
        try:
            await self.check_tokens(tenant)
            if self.max_episodes:
                key = names.tenant_episodes(tenant)
                await self.r.zremrangebyscore(key, "-inf", time.time())
                held = await self.r.zcard(key)
                if held >= self.max_episodes:
                    return f"quota episodes: tenant {tenant!r} has {held} in flight"
        except QuotaExceeded as exc:
            return str(exc)
        return None


def _minute() -> int:
    return int(time.time() // 60)
