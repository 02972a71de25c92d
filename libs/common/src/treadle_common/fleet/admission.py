"""Staleness admission: one Redis-backed bound on the groups in flight, shared by every
rollout replica of a run.

The trainer configures the bound when the run starts: `groups_per_step` B, `max_staleness`
S and `base_version` V0 (the version it holds before step 1; it publishes one version per
step). Groups are numbered 0, 1, ... in the order replicas start them; group g is trained at
step g // B + 1 by a trainer holding version V0 + g // B. A replica holding version w may
therefore start group g only while

    g - U < (w - V0 + S + 1) * B

where U counts the started groups no step will train (the trainer's `groups_unusable`: wholly
stale, or no valid member; rollout's `admission_released`: dead-lettered after admission):
their replacements take their places, else a run that lost groups would wait forever.

so that what it generates is at most S versions behind the trainer that consumes it. A
replica that is refused waits for the next version instead of generating work the trainer
would throw away. Admission is idempotent per task: a retried or reclaimed task keeps the
number it was given. Whatever still exceeds the bound (groups finishing far out of order) is
dropped by the trainer and counted with its reason.

When its last step has its batch, the trainer closes admission: a group that has no number
yet is cancelled (its task is acked and counted as `tasks_cancelled`), so replicas stop
generating work no step will train on. `configure` (a restarted trainer) opens it again.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from treadle_common import names

_ADMIT = """
local given = redis.call('HGET', KEYS[2], ARGV[2])
if given then return {1, tonumber(given)} end
if redis.call('HGET', KEYS[1], 'admission_closed') == '1' then return {2, -1} end
local b = tonumber(redis.call('HGET', KEYS[1], 'admission_groups_per_step') or '0')
local started = tonumber(redis.call('HGET', KEYS[1], 'admission_started') or '0')
-- groups started that no step will train (unusable, dead-lettered) free their places
local unusable = tonumber(redis.call('HGET', KEYS[1], 'groups_unusable') or '0')
local released = tonumber(redis.call('HGET', KEYS[1], 'admission_released') or '0')
local live = started - unusable - released
if b > 0 then
  local s = tonumber(redis.call('HGET', KEYS[1], 'admission_max_staleness') or '0')
  local v0 = tonumber(redis.call('HGET', KEYS[1], 'admission_base_version') or '0')
  local w = tonumber(ARGV[1])
  if live >= (w - v0 + s + 1) * b then
    redis.call('HINCRBY', KEYS[1], 'admission_refused', 1)
    return {0, started}
  end
end
redis.call('HINCRBY', KEYS[1], 'admission_started', 1)
redis.call('HSET', KEYS[2], ARGV[2], started)
return {1, started}
"""


@dataclass(frozen=True)
class Decision:
    admitted: bool
    group_index: int
    """The group's number when admitted; the number of groups started when refused."""
    closed: bool = False
    """The run needs no more groups: cancel the task."""


def admitted_key(run: str) -> str:
    return names.run_keys(run)[-1]


async def configure(
    r: aioredis.Redis, run: str, *, groups_per_step: int, max_staleness: int, base_version: int
) -> None:
    """Set the bound of a run (the trainer, at run start); groups_per_step 0 disables it."""
    await r.hset(
        names.run_state(run),
        mapping={
            "admission_groups_per_step": groups_per_step,
            "admission_max_staleness": max_staleness,
            "admission_base_version": base_version,
            "admission_closed": 0,
        },
    )


async def close(r: aioredis.Redis, run: str) -> None:
    """Start no more groups of `run` (the trainer, once its last step has its batch)."""
    await r.hset(names.run_state(run), "admission_closed", 1)


async def admit(r: aioredis.Redis, run: str, task_id: str, version: int) -> Decision:
    """Try to start the group of `task_id` on a replica that holds policy `version`."""
    ok, index = await r.eval(  # type: ignore[misc]
        _ADMIT, 2, names.run_state(run), admitted_key(run), version, task_id
    )
    return Decision(ok == 1, int(index), closed=ok == 2)
