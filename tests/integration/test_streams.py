"""Redis Streams helpers against a real redis-server: groups, ack, reclaim, replay."""

import asyncio

import pytest
import redis.asyncio as aioredis

from treadle_common.clients import streams
from treadle_common.proto.treadle.v1 import task_pb2

pytestmark = pytest.mark.integration


async def test_read_ack_and_reclaim_from_a_dead_consumer(infra):
    r = aioredis.from_url(infra.redis_url)
    stream = "test:streams:tasks"
    await r.delete(stream)
    await streams.ensure_group(r, stream, "g")
    await streams.ensure_group(r, stream, "g")  # idempotent
    for i in range(3):
        await streams.add(r, stream, task_pb2.Task(task_id=f"t{i}"))
    got = await streams.read_group(r, [stream], "g", "dead", task_pb2.Task, count=2, block_ms=100)
    assert [m.task_id for _, _, m in got] == ["t0", "t1"]
    await r.xack(stream, "g", got[0][1])
    # t1 was delivered to a consumer that died: another consumer reclaims it once idle
    await asyncio.sleep(0.05)
    reclaimed = await streams.reclaim(r, stream, "g", "alive", task_pb2.Task, min_idle_ms=10)
    assert [m.task_id for _, _, m in reclaimed] == ["t1"]
    fresh = await streams.read_group(r, [stream], "g", "alive", task_pb2.Task, block_ms=100)
    assert [m.task_id for _, _, m in fresh] == ["t2"]
    # after a restart, a consumer replays what it holds unacked
    replay = await streams.pending_own(r, stream, "g", "alive", task_pb2.Task)
    assert sorted(m.task_id for _, _, m in replay) == ["t1", "t2"]
    await r.aclose()


async def test_backlog_counts_undelivered_and_pending_entries(infra):
    r = aioredis.from_url(infra.redis_url)
    stream = "test:backlog:tasks"
    await r.delete(stream)
    for i in range(5):
        await streams.add(r, stream, task_pb2.Task(task_id=f"t{i}"))
    assert await streams.backlog(r, stream, "g") == 5  # nobody reads yet: the whole stream
    await streams.ensure_group(r, stream, "g")
    read = await streams.read_group(r, [stream], "g", "c1", task_pb2.Task, count=2, block_ms=10)
    assert await streams.backlog(r, stream, "g") == 5  # 3 undelivered + 2 pending
    await r.xack(stream, "g", *[entry_id for _, entry_id, _ in read])
    assert await streams.backlog(r, stream, "g") == 3
    assert await streams.backlog(r, "test:backlog:none", "g") == 0
    await r.aclose()
