"""The event loop a Treadle process runs on (`treadle_common.aio`, `TREADLE_EVENT_LOOP`)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from pydantic import ValidationError

from treadle_common import aio
from treadle_common.settings import Settings

pytestmark = pytest.mark.unit


async def loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


def test_run_gives_the_coroutines_result_on_the_loop_asked_for():
    assert aio.run(loop_type()) is uvloop.Loop  # the default
    assert aio.run(loop_type(), "uvloop") is uvloop.Loop
    assert not issubclass(aio.run(loop_type(), "asyncio"), uvloop.Loop)


def test_an_unknown_loop_is_refused_by_name():
    coro = loop_type()
    with pytest.raises(ValueError, match="'trio'"):
        aio.run(coro, "trio")  # type: ignore[arg-type]
    coro.close()


def test_the_setting_defaults_to_uvloop_and_refuses_others(monkeypatch):
    monkeypatch.delenv("TREADLE_EVENT_LOOP", raising=False)
    assert Settings().event_loop == "uvloop"
    monkeypatch.setenv("TREADLE_EVENT_LOOP", "asyncio")
    assert Settings().event_loop == "asyncio"
    monkeypatch.setenv("TREADLE_EVENT_LOOP", "trio")
    with pytest.raises(ValidationError, match="event_loop"):
        Settings()
