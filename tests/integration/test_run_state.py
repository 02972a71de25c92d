"""A run's Redis state stays bounded, against a real redis-server: acked stream entries are
trimmed (never one a consumer still needs), finished runs expire, `treadle runs gc`."""

from __future__ import annotations

import time
import uuid

import pytest
import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.clients import streams
from treadle_common.fleet import retention

pytestmark = pytest.mark.integration


@pytest.fixture
async def r(infra):
    client = aioredis.from_url(infra.redis_url)
    yield client
    await client.aclose()


async def test_trim_keeps_what_the_group_has_not_finished(r):
    stream = f"test:{uuid.uuid4().hex}:trajectories"
    await streams.ensure_group(r, stream, "g")
    for i in range(5):
        await r.xadd(stream, {"pb": str(i)})
    read = await r.xreadgroup("g", "c", {stream: ">"}, count=3)
    ids = [entry_id for entry_id, _ in read[0][1]]
    await r.xack(stream, "g", ids[0], ids[2])  # ids[1] still pending; 2 never delivered
    assert await streams.trim_acked(r, stream, "g") == 1
    assert [e for e, _ in await r.xrange(stream)][0] == ids[1]
    await r.xack(stream, "g", ids[1])
    assert await streams.trim_acked(r, stream, "g") == 2
    assert await r.xlen(stream) == 2  # the undelivered ones stay
    await r.xreadgroup("g", "c", {stream: ">"})
    assert await streams.trim_acked(r, stream, "g") == 0  # delivered, pending: kept


async def test_runs_gc_deletes_only_finished_runs_past_the_horizon(r):
    old, recent, active = (f"gc-{uuid.uuid4().hex[:6]}" for _ in range(3))
    for run in (old, recent, active):
        await r.xadd(names.ledger_stream(run), {"step": 1})
        await r.hset(names.run_state(run), "state", "succeeded")
    await r.hset(names.run_state(old), "ended_at", time.time() - 7200)
    await retention.expire_run(r, recent, retention_s=3600)
    await r.hset(names.run_state(active), mapping={"state": "running"})
    await r.sadd(names.RUNS_KEY, active)
    try:
        assert 0 < await r.ttl(names.ledger_stream(recent)) <= 3600
        found = await retention.finished_runs(r, older_than_s=3600)
        assert old in found and recent not in found and active not in found
        assert await retention.delete_runs(r, [old]) == 2
        assert not await r.exists(names.run_state(old), names.ledger_stream(old))
        assert await r.exists(names.run_state(active))
    finally:
        await r.srem(names.RUNS_KEY, active)
