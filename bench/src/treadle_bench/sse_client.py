"""A lean HTTP/1.1 client for streamed (server-sent events) responses: the load generator
of `treadle bench rollout`.

On a small machine the load generator shares the cores with the service it measures, so
every microsecond it spends is taken from the service. This client does what any SSE client
must do, and nothing else: HTTP/1.1 with keep-alive connections, the response parsed by
`httptools` (the C parser uvicorn serves with; chunked transfer decoded), the event stream
split into events and each event's `data:` handed to the caller. On the 2-core dev machine
it spends less than half of aiohttp's CPU per streamed request (under the bench's load:
0.07-0.08 of a core against 0.15-0.19).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httptools

OnData = Callable[[bytes], None]


class SSEError(RuntimeError):
    """The server answered with an error status, or the connection broke mid-response."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._on_data: OnData | None = None
        self._done: asyncio.Future[None] | None = None
        self._buffer = b""
        self._status = 0
        self._error_body = b""
        self._keep_alive = True

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(SSEError(f"malformed response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(SSEError(f"the connection closed mid-response: {exc!r}"))

    # -- httptools callbacks ------------------------------------------------------------------
    def on_status(self, status: bytes) -> None:
        self._status = self._parser.get_status_code()

    def on_headers_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self._status != 200:
            self._error_body += body
            return
        self._buffer += body
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and self._on_data is not None:
                    self._on_data(line[6:] if line.startswith(b"data: ") else line[5:])

    def on_message_complete(self) -> None:
        done, self._done = self._done, None
        if done is None or done.done():
            return
        if self._status != 200:
            done.set_exception(SSEError(f"HTTP {self._status}: {self._error_body[:500]!r}"))
        else:
            done.set_result(None)

    # -- a request ----------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        done, self._done = self._done, None
        if done is not None and not done.done():
            done.set_exception(exc)

    async def request(self, head: bytes, body: bytes, on_data: OnData) -> None:
        assert self.transport is not None and self._done is None
        self._on_data, self._buffer, self._status, self._error_body = on_data, b"", 0, b""
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        await self._done
        if not self._keep_alive:
            self.transport.close()
            self.closed = True


class SSEClient:
    """POSTs JSON and reads the streamed answer; connections are kept and reused."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port
        fixed = {"Host": f"{host}:{port}", "Content-Type": "application/json", **(headers or {})}
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._idle: list[_Connection] = []
        self._all: list[_Connection] = []

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
        self._all.append(conn)
        return conn

    async def post(self, path: str, payload: dict, on_data: OnData) -> None:
        """POST `payload` to `path`; `on_data(data)` for each event's data as it arrives.
        Raises `SSEError` for an error status or a broken connection."""
        body = json.dumps(payload).encode()
        head = (
            f"POST {path} HTTP/1.1\r\n{self._headers}Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        conn = await self._connection()
        try:
            await conn.request(head, body, on_data)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            conn.closed = True
            raise
        if not conn.closed:
            self._idle.append(conn)

    async def close(self) -> None:
        for conn in self._all:
            if conn.transport is not None and not conn.closed:
                conn.transport.close()
        self._idle, self._all = [], []
        await asyncio.sleep(0)  # the transports close in the next loop turn
