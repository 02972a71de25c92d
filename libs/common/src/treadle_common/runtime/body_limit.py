"""A cap on HTTP request bodies, before anything parses them.

A body that declares (`Content-Length`) or streams more than the cap is answered 413 with a
message naming the cap; the handler never sees it, so no JSON parser or model ever holds an
unbounded body in memory. Every service's app carries it (`ServiceRuntime`,
`TREADLE_MAX_BODY_MB`).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class _TooLarge(HTTPException):
    """Raised from `receive` mid-body: an HTTPException, so FastAPI's body reading passes it
    on as the 413 it is (it turns other errors there into 400)."""

    def __init__(self, max_bytes: int):
        super().__init__(413, _message(max_bytes))


def _message(max_bytes: int) -> str:
    return f"request body larger than {max_bytes} bytes (TREADLE_MAX_BODY_MB)"


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, on_refuse: Any = None):
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    def _count(self) -> None:
        if self.on_refuse is not None:
            self.on_refuse()

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": _message(self.max_bytes)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0  # the server itself refuses a malformed length
                if declared > self.max_bytes:
                    self._count()
                    await self._refuse(send)
                    return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    self._count()
                    raise _TooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send)
