"""The run's fenced lease against a real redis-server: one owner at a time, renewal and
release by the holder only, and a ledger commit, feed or read refused to a trainer whose
lease another took over."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from treadle_common import names
from treadle_trainer.run.lease import Fenced, Lease
from treadle_trainer.run.ledger import Ledger, LedgerEntry

pytestmark = pytest.mark.integration


@pytest.fixture
async def r(infra):
    client = aioredis.from_url(infra.redis_url)
    yield client
    await client.aclose()


async def test_one_owner_at_a_time_and_only_the_holder_renews_or_releases(r):
    run = uuid.uuid4().hex
    a, b = Lease(r, run, "a", 300), Lease(r, run, "b", 300)
    assert await a.acquire() and not await b.acquire()  # SET NX
    assert await a.renew() and not await b.renew()
    await b.release()  # not b's: a keeps it
    assert await a.holds()
    await asyncio.sleep(0.4)  # a stalls past its lease
    assert not await a.holds() and await b.acquire()
    assert b.token > a.token  # fencing tokens only grow
    assert not await a.renew()  # a cannot take it back by renewing
    await a.release()
    assert await b.holds()
    await b.release()
    assert not await r.exists(names.run_owner(run))


async def test_a_stale_owner_cannot_commit_its_ledger(r):
    run = uuid.uuid4().hex
    a, b = Lease(r, run, "a", 10_000), Lease(r, run, "b", 10_000)
    assert await a.acquire()
    stale = Ledger(r, run, a)
    stale.add(LedgerEntry(3, "step", 3, [], ["t1"], {}))
    await r.delete(names.run_owner(run))  # a's lease lapsed (it was frozen) ...
    assert await b.acquire()  # ... and b took the run over
    with pytest.raises(Fenced, match="lost its lease"):
        await stale.commit(3, Path("/ckpt/a-3"))
    assert await r.xlen(names.ledger_stream(run)) == 0
    assert await r.hget(names.run_state(run), "checkpoint_step") is None
    owner = Ledger(r, run, b)
    owner.add(LedgerEntry(3, "step", 3, [], ["t1"], {}))
    await owner.commit(3, Path("/ckpt/b-3"))
    assert await r.xlen(names.ledger_stream(run)) == 1
    assert await r.hget(names.run_state(run), "checkpoint_path") == b"/ckpt/b-3"


async def test_a_renewal_during_a_transaction_only_retries_it(r):
    run = uuid.uuid4().hex
    a = Lease(r, run, "a", 10_000)
    assert await a.acquire()
    renewed = []

    async def queue(pipe):
        if not renewed:  # the owner's own renewal lands between WATCH and EXEC
            renewed.append(await a.renew())
        pipe.incr(f"test:{run}:n")

    await a.transaction(queue)
    assert renewed == [True] and int(await r.get(f"test:{run}:n")) == 1
