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


async def test_only_the_owner_heartbeats_and_commits_an_entry(infra):
    r = aioredis.from_url(infra.redis_url)
    stream, out = "test:owned:tasks", "test:owned:out"
    await r.delete(stream, out, "test:owned:state")
    await streams.ensure_group(r, stream, "g")
    await streams.add(r, stream, task_pb2.Task(task_id="t0"))
    [(_, entry, _)] = await streams.read_group(r, [stream], "g", "a", task_pb2.Task, block_ms=10)
    assert await streams.heartbeat(r, stream, "g", "a", entry)
    assert not await streams.heartbeat(r, stream, "g", "b", entry)  # b does not own it
    await asyncio.sleep(0.05)
    [(_, taken, _)] = await streams.reclaim(r, stream, "g", "b", task_pb2.Task, min_idle_ms=10)
    assert taken == entry and await streams.deliveries(r, stream, "g", entry) == 2
    results = [task_pb2.Task(task_id="r0"), task_pb2.Task(task_id="r1")]
    kw = {"out_stream": out, "messages": results, "counter": ("test:owned:state", "n")}
    assert not await streams.commit_owned(r, stream, "g", "a", entry, **kw)  # a lost it
    assert await r.xlen(out) == 0 and await streams.heartbeat(r, stream, "g", "b", entry)
    assert await streams.commit_owned(r, stream, "g", "b", entry, **kw)
    got = await r.xrange(out)
    assert [task_pb2.Task.FromString(f[b"pb"]).task_id for _, f in got] == ["r0", "r1"]
    assert int(await r.hget("test:owned:state", "n")) == 2
    assert await streams.deliveries(r, stream, "g", entry) == 0  # acked
    assert not await streams.commit_owned(r, stream, "g", "b", entry, **kw)  # once only
    await r.aclose()
