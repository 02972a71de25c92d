"""How an error out of a run's step loop ends the attempt (`status_store.verdict`)."""

from __future__ import annotations

import asyncio

import redis.exceptions as redis_errors

from treadle_trainer.run.lease import Fenced
from treadle_trainer.run.status_store import verdict


def test_a_taken_lease_loses_the_run_on_any_attempt():
    assert verdict(Fenced("taken by t2"), "r", False, False) == ("lost", "taken by t2")
    assert verdict(Fenced(), "r", False, True) == ("lost", "the run's lease was taken over")
    # a cancellation once the lease was lost is the loss, not an interruption
    assert verdict(asyncio.CancelledError(), "r", True, True)[0] == "lost"


def test_an_infrastructure_error_retries_until_the_last_attempt():
    exc = redis_errors.ConnectionError("Connection refused")
    assert verdict(exc, "r", False, False) == ("retrying", "ConnectionError: Connection refused")
    assert verdict(exc, "r", False, True) == ("failed", "ConnectionError: Connection refused")


def test_a_bug_fails_the_run_at_once():
    assert verdict(ValueError("bad batch"), "r", False, False) == (
        "failed",
        "ValueError: bad batch",
    )


async def test_a_call_cancelled_under_the_run_is_an_interruption_but_its_own_cancel_is_not():
    assert verdict(asyncio.CancelledError(), "r", False, False)[0] == "retrying"
    assert verdict(asyncio.CancelledError(), "r", False, True)[0] == "failed"
    seen: list[object] = []

    async def cancelled_task() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError as exc:
            seen.append(verdict(exc, "r", False, False))
            raise

    task = asyncio.ensure_future(cancelled_task())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert seen == [None]  # the caller re-raises: this task is being stopped
