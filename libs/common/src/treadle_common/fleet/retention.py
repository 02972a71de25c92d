"""Finished runs' Redis state: what bounds it.

While a run goes, its trainer trims the task and trajectory streams after every checkpoint
(`streams.trim_acked`: only entries their consumer group acked). When it ends, the trainer
sets `ended_at` and gives every key of the run (`names.run_keys`) a TTL of
`trainer_run_retention_s`; `treadle runs gc` deletes finished runs sooner.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.api.runs import FINAL_STATES
from treadle_common.clients import streams


async def expire_run(
    r: aioredis.Redis | aioredis.client.Pipeline, run: str, retention_s: float
) -> None:
    """Queue (on a pipeline) or run: mark the run ended now and expire its keys."""
    await r.hset(names.run_state(run), "ended_at", time.time())
    for key in names.run_keys(run):
        await r.expire(key, max(1, int(retention_s)))


async def finished_runs(r: aioredis.Redis, older_than_s: float) -> list[str]:
    """Runs that ended (succeeded or failed) more than `older_than_s` ago and are not active."""
    active = {streams.text(m) for m in await r.smembers(names.RUNS_KEY)}
    horizon = time.time() - older_than_s
    out = []
    async for key in r.scan_iter(match=names.run_state("*"), count=500):
        run = names.run_of(streams.text(key))
        state, ended = await r.hmget(key, "state", "ended_at")
        if run in active or state is None or streams.text(state) not in FINAL_STATES:
            continue
        if ended is not None and float(ended) <= horizon:
            out.append(run)
    return sorted(out)


async def delete_runs(r: aioredis.Redis, runs: list[str]) -> int:
    """Delete every key of `runs`; how many keys went."""
    deleted = 0
    for run in runs:
        deleted += int(await r.delete(*names.run_keys(run)))
    return deleted
