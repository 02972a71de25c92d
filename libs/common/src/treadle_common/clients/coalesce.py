"""Coalescing: the calls made in one event-loop turn, sent as one batch.

Used by the env-gateway and reward clients. A batch is sent once the loop has run the
callbacks that were already queued when its first call came in: work woken together (the
episodes of a group starting, generations finishing in the same engine step) calls together.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

Pending = list[tuple[Any, "asyncio.Future[Any]"]]


class Coalescer(Generic[Item, Result]):
    """Collects the calls made in one event-loop turn and sends them as one batch per key.

    `send(key, [(item, future), ...])` must resolve every future; whatever it leaves
    unresolved when it returns or raises gets its error."""

    def __init__(self, send: Callable[[Hashable, Pending], Awaitable[None]]):
        self._send = send
        self._pending: dict[Hashable, Pending] = {}
        self._contexts: dict[Hashable, contextvars.Context] = {}
        self._scheduled = False
        self._sending: set[asyncio.Task] = set()

    def submit(self, key: Hashable, item: Item) -> asyncio.Future[Result]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        if key not in self._pending:  # the batch is sent in its first caller's context (trace)
            self._contexts[key] = contextvars.copy_context()
        self._pending.setdefault(key, []).append((item, future))
        if not self._scheduled:  # after the callbacks already queued: the turn's other calls
            self._scheduled = True
            loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        contexts, self._contexts = self._contexts, {}
        loop = asyncio.get_running_loop()
        for key, items in pending.items():
            task = loop.create_task(self._send_all(key, items), context=contexts[key])
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_all(self, key: Hashable, items: Pending) -> None:
        error: BaseException = RuntimeError("batch ended without a result for this call")
        try:
            await self._send(key, items)
        except Exception as exc:  # every caller of the batch gets the batch's error
            error = exc
        except BaseException as exc:
            error = exc
            raise
        finally:
            for _, future in items:
                if future.done():
                    continue
                if isinstance(error, Exception):
                    future.set_exception(error)
                else:  # cancelled (shutting down): so are its callers
                    future.cancel()
