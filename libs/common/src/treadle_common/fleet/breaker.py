"""An env's circuit breaker for one run, shared by every rollout replica through Redis.

Each episode's outcome, once its retries are over (played, or failed by its env: the env
raised or its sandbox failed; rollout decides, `treadle_rollout.failures.env_failed`), goes
into a window of the run's last `window` episodes of that env
(`names.env_health`). Once the window is full and at least `failure_rate` of it failed, the
breaker opens: the run's state gets `broken:{env}` with why (how many failed, the last
error). It stays open for the run: rollout dead-letters the run's later tasks of that env
(`env_circuit_open`) without playing them, and the run's trainer ends the run as failed with
that reason (`broken_envs` in its status). Opening is atomic (one script), so replicas that
record at once open it once.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.clients import streams

_RECORD = """
local s = (redis.call('HGET', KEYS[1], ARGV[1]) or '') .. ARGV[2]
local w = tonumber(ARGV[3])
if #s > w then s = string.sub(s, #s - w + 1) end
redis.call('HSET', KEYS[1], ARGV[1], s)
local _, failed = string.gsub(s, '1', '')
local field = 'broken:' .. ARGV[1]
if #s >= w and failed >= tonumber(ARGV[4]) * w and redis.call('HEXISTS', KEYS[2], field) == 0 then
  local why = string.format('%d of its last %d episodes failed; the last: %s', failed, w, ARGV[5])
  redis.call('HSET', KEYS[2], field, why)
  return why
end
return false
"""
BROKEN_PREFIX = "broken:"
"""A run-state field naming an env whose breaker opened; its value says why."""


async def record(
    r: aioredis.Redis,
    run: str,
    env: str,
    failed: list[bool],
    error: str,
    window: int,
    failure_rate: float,
) -> str | None:
    """Episodes' outcomes (a group's, in one call), `error` the last failure's; why the
    breaker opened, if these outcomes opened it. A `window` of 0 records nothing (no
    breaker)."""
    if window <= 0 or not failed:
        return None
    why = await r.eval(
        _RECORD,
        2,
        names.env_health(run),
        names.run_state(run),
        env,
        "".join("1" if f else "0" for f in failed),
        window,
        failure_rate,
        error[:500],
    )
    return streams.text(why) if why else None


async def why_open(r: aioredis.Redis, run: str, env: str) -> str | None:
    """Why the run's breaker for `env` is open, or None while it is closed."""
    why = await r.hget(names.run_state(run), BROKEN_PREFIX + env)
    return streams.text(why) if why is not None else None


def open_in(state: dict[str, str]) -> dict[str, str]:
    """The envs whose breaker is open, with why, from a run's state hash (as text)."""
    return {
        k.removeprefix(BROKEN_PREFIX): v for k, v in state.items() if k.startswith(BROKEN_PREFIX)
    }
