"""A server-sent-events response that streams in the request's own task.

Starlette's `StreamingResponse` (under uvicorn, which speaks ASGI 2.3) runs the stream in a
task of its own, in an anyio task group beside a task that waits for the client to
disconnect. Under load every task hop waits behind the serving loop's other callbacks (a
few ms each with 32 streams on two cores), and a streamed request crosses several before
its first byte. `EventStream` sends from the request's task, watches for a disconnect from a
plain asyncio task (not on the stream's path), and sends the last events with the end of
the body in one write (`Final`): the connection is free for the client's next request as
soon as it has read `[DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class Final(str):
    """The stream's last events: they end the body (no separate empty end chunk)."""


class EventStream(StreamingResponse):
    """`text/event-stream` from an async iterator of str events; closing the connection
    cancels the iterator (its `finally` runs in this task)."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"open": True, "gone": False}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if state["open"]:  # the client left mid-stream
                state["gone"] = True
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            start = {"status": self.status_code, "headers": self.raw_headers}
            await send({"type": "http.response.start", **start})
            async for events in self.body_iterator:
                last = isinstance(events, Final)
                if last:
                    state["open"] = False
                body = events.encode(self.charset) if isinstance(events, str) else bytes(events)
                await send({"type": "http.response.body", "body": body, "more_body": not last})
            if state["open"]:
                state["open"] = False
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()  # our own cancel: the client is gone, nothing to answer
        finally:
            state["open"] = False
            watcher.cancel()
