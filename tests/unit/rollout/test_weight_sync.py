"""WeightSync against scripted fakes: a demanded version is waited for, never fetched before
the store has it, and fetched as soon as the store commits it, before its announcement (which
waits for durability); a lost announcement is made up for by asking the store."""

import asyncio

import pytest

from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_rollout.engines.base import SwapStats
from treadle_rollout.weight_sync import WeightSync

pytestmark = pytest.mark.unit


class ScriptedEngine:
    model_name = "m"

    def __init__(self):
        self.version = 1
        self.fetched: list[int] = []

    async def update_to(self, store, version):
        if version not in store.versions:
            raise RuntimeError(f"version {version} fetched before it was published")
        self.fetched.append(version)
        self.version = version
        return SwapStats(version, 0.0, 0.0, 0)


class ScriptedStore:
    def __init__(self):
        self.versions = {1}
        self.polls = 0

    async def latest(self, model):
        self.polls += 1
        return max(self.versions)

    async def wait_for_version(self, model, version, timeout_s):
        """The store's long poll: answers once it holds `version`, or after `timeout_s`."""
        self.polls += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while max(self.versions) < version and loop.time() < deadline:
            await asyncio.sleep(0.005)
        return max(self.versions)


class NoNats:
    """`WeightSync.run` watches JetStream first; announcements are delivered by the test."""

    def jetstream(self):
        return None


@pytest.fixture
def sync(monkeypatch):
    async def no_watch(js, model, callback):
        return None

    monkeypatch.setattr("treadle_rollout.weight_sync.watch", no_watch)
    engine, store = ScriptedEngine(), ScriptedStore()
    return WeightSync(engine, store, poll_s=0.05), engine, store


async def test_a_demanded_version_is_fetched_once_announced_and_not_before(sync):
    weights, engine, store = sync
    runner = asyncio.create_task(weights.run(NoNats()))
    waiter = asyncio.create_task(weights.ensure_version(2))
    await asyncio.sleep(0.2)  # polls meanwhile: the store's latest is still 1
    assert not waiter.done() and engine.fetched == [] and store.polls >= 2
    store.versions.add(2)
    await weights.on_announcement(pb.WeightAnnouncement(model="m", version=2))
    await asyncio.wait_for(waiter, 2)
    assert engine.fetched == [2] and weights.last_error is None
    runner.cancel()


async def test_a_demanded_version_is_fetched_as_soon_as_the_store_commits_it(monkeypatch):
    async def no_watch(js, model, callback):
        return None

    monkeypatch.setattr("treadle_rollout.weight_sync.watch", no_watch)
    engine, store = ScriptedEngine(), ScriptedStore()
    weights = WeightSync(engine, store, poll_s=3600)  # one call waits for the whole test
    runner = asyncio.create_task(weights.run(NoNats()))
    waiter = asyncio.create_task(weights.ensure_version(2))  # fed while the trainer publishes
    await asyncio.sleep(0.05)
    assert not waiter.done() and engine.fetched == []
    store.versions.add(2)  # committed, not yet announced (durable)
    await asyncio.wait_for(waiter, 2)
    assert engine.fetched == [2] and store.polls == 1
    store.versions.add(3)  # not announced, and no task demands it: nothing asks
    await asyncio.sleep(0.05)
    assert engine.fetched == [2] and store.polls == 1
    runner.cancel()


async def test_a_lost_announcement_is_made_up_for_by_polling_the_store(sync):
    weights, engine, store = sync
    runner = asyncio.create_task(weights.run(NoNats()))
    waiter = asyncio.create_task(weights.ensure_version(3))
    await asyncio.sleep(0.1)
    store.versions.update({2, 3})  # published, but its announcement never arrives
    await asyncio.wait_for(waiter, 2)
    assert engine.fetched == [3]
    runner.cancel()


async def test_nothing_is_polled_while_no_task_waits(sync):
    weights, engine, store = sync
    runner = asyncio.create_task(weights.run(NoNats()))
    await asyncio.sleep(0.2)
    assert store.polls == 0
    await weights.ensure_version(1)  # held already: returns at once, starts no polling
    await asyncio.sleep(0.2)
    assert store.polls == 0
    runner.cancel()


async def test_a_forged_announcement_does_not_stop_rollout(sync):
    """Version 10^9 is announced but never published: its fetch fails, the store's latest is
    older, so it is dropped and counted, and the real next version is fetched."""
    weights, engine, store = sync
    runner = asyncio.create_task(weights.run(NoNats()))
    await weights.on_announcement(pb.WeightAnnouncement(model="m", version=10**9))
    store.versions.add(2)
    await weights.on_announcement(pb.WeightAnnouncement(model="m", version=2))
    await asyncio.wait_for(weights.ensure_version(2), 5)
    assert engine.fetched == [2] and engine.version == 2
    assert weights.bad_announcements == 1 and weights.version_lag == 0
    runner.cancel()
