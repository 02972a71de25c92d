"""The trainer's background publisher: newest first, never blocking a step, errors surface."""

import asyncio

import pytest

from treadle_trainer.publisher import Published, Publisher, Snapshot

pytestmark = pytest.mark.unit


class SlowStore:
    """Publishes take until `release` is set; records what was published, in order."""

    def __init__(self):
        self.release = asyncio.Event()
        self.published: list[int] = []
        self.fail_on: int | None = None

    async def publish(self, snapshot: Snapshot) -> int:
        await self.release.wait()
        if snapshot.version == self.fail_on:
            raise RuntimeError(f"store refused version {snapshot.version}")
        self.published.append(snapshot.version)
        return 100 * snapshot.version


def snap(step: int) -> Snapshot:
    return Snapshot(step=step, version=10 + step, state={})


async def test_submit_returns_at_once_and_a_newer_snapshot_replaces_a_waiting_one():
    store, done = SlowStore(), []
    publisher = Publisher(store.publish, done.append)
    for step in (1, 2, 3, 4):  # 1 starts publishing; 2 and 3 wait in turn and are replaced
        await asyncio.wait_for(publisher.submit(snap(step)), 1)
    assert publisher.coalesced == 2 and store.published == []
    store.release.set()
    await publisher.flush()
    assert store.published == [11, 14]
    assert [d.version for d in done] == [11, 14]
    assert all(isinstance(d, Published) and d.latency_s >= d.publish_s for d in done)
    assert done[1].bytes_sent == 1400 and publisher.published_version == 14


async def test_wait_for_returns_once_that_version_or_a_newer_one_is_out():
    store = SlowStore()
    publisher = Publisher(store.publish, lambda d: None)
    await publisher.submit(snap(1))
    waiter = asyncio.ensure_future(publisher.wait_for(11))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # the store has not committed it yet
    store.release.set()
    await asyncio.wait_for(waiter, 1)
    await publisher.wait_for(5)  # older than what is out: at once


async def test_a_failed_publish_is_raised_to_the_next_caller():
    store = SlowStore()
    store.fail_on, publisher = 12, Publisher(store.publish, lambda d: None)
    store.release.set()
    await publisher.submit(snap(1))
    await publisher.submit(snap(2))
    with pytest.raises(RuntimeError, match="refused version 12"):
        await publisher.flush()
    with pytest.raises(RuntimeError, match="refused version 12"):
        await publisher.submit(snap(3))
    with pytest.raises(RuntimeError, match="refused version 12"):
        await publisher.wait_for(13)


async def test_close_drops_what_waits_and_stops_the_publish_in_flight():
    store = SlowStore()
    publisher = Publisher(store.publish, lambda d: None)
    await publisher.submit(snap(1))
    await publisher.submit(snap(2))
    await publisher.close()
    store.release.set()
    await asyncio.sleep(0.05)
    assert store.published == [] and not publisher.busy
