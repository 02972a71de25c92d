"""Coalescing clients: the calls of one event-loop turn travel as one batch."""

import asyncio

import pytest

from treadle_common.clients.coalesce import Coalescer

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self, fail: bool = False):
        self.batches: list[tuple[object, list]] = []
        self.fail = fail

    async def send(self, key, items) -> None:
        self.batches.append((key, [item for item, _ in items]))
        await asyncio.sleep(0)
        if self.fail:
            raise ConnectionError("gateway unreachable")
        for item, future in items[:-1]:  # the last one is left unresolved on purpose
            future.set_result(item * 10)


async def test_calls_made_together_go_as_one_batch_per_key():
    rec = Recorder()
    batcher = Coalescer(rec.send)

    async def call(key, item):
        return await batcher.submit(key, item)

    started = [asyncio.ensure_future(call("a" if i < 3 else "b", i)) for i in range(5)]
    results = await asyncio.gather(*started, return_exceptions=True)
    assert sorted(rec.batches) == [("a", [0, 1, 2]), ("b", [3, 4])]
    assert results[:2] == [0, 10] and results[3] == 30
    # what the batch left unresolved is an error, never a hang
    assert isinstance(results[2], RuntimeError) and isinstance(results[4], RuntimeError)
    # a call made after the batch went out starts a new one
    later = asyncio.ensure_future(call("a", 7))
    await asyncio.gather(later, return_exceptions=True)
    assert rec.batches[-1] == ("a", [7])


async def test_a_failed_batch_fails_each_of_its_calls_with_its_error():
    batcher = Coalescer(Recorder(fail=True).send)
    calls = [asyncio.ensure_future(batcher.submit(None, i)) for i in range(3)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)


async def test_each_batch_is_sent_in_its_first_callers_context():
    import contextvars

    who = contextvars.ContextVar("who", default="nobody")
    seen: dict = {}

    async def send(key, items):
        seen[key] = who.get()  # e.g. the trace a batch's RPC span joins
        for item, future in items:
            future.set_result(item)

    batcher = Coalescer(send)

    async def call(key, name):
        who.set(name)
        return await batcher.submit(key, name)

    await asyncio.gather(call("g1", "a"), call("g2", "b"), call("g1", "c"))
    assert seen == {"g1": "a", "g2": "b"}
