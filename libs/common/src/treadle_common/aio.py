"""The event loop every Treadle process runs on.

`uvloop` (libuv) by default: its transports, callbacks and timers are C, where asyncio's are
Python. A service spends most of its serving loop in them under load (on the bench's two
cores, rollout's streamed OpenAI API gave 4-8% more tokens/s on uvloop than on asyncio's
loop, in each of 3 paired runs). `asyncio`: the standard library's loop, for debugging or a
platform uvloop does not build on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

EventLoop = Literal["uvloop", "asyncio"]

T = TypeVar("T")


def loop_factory(kind: EventLoop) -> Callable[[], asyncio.AbstractEventLoop]:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if kind == "asyncio":
        return asyncio.new_event_loop
    raise ValueError(f"event loop {kind!r}: expected 'uvloop' or 'asyncio'")


def run(main: Coroutine[Any, Any, T], kind: EventLoop = "uvloop") -> T:
    """`asyncio.run(main)` on a new loop of `kind`."""
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)
