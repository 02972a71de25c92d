"""Every service's HTTP connections run with TCP_NODELAY (a keep-alive response is not held
~40 ms by Nagle behind the client's delayed ACK)."""

from __future__ import annotations

import asyncio
import socket

from treadle_common.runtime.service import bind_socket


async def _accepted_nodelay() -> int:
    sock = bind_socket("test", "http", "127.0.0.1", 0)
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(handle, sock=sock)
    port = sock.getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    value = await asyncio.wait_for(seen, 10)
    writer.close()
    server.close()
    await server.wait_closed()
    return value


def test_connections_accepted_on_a_service_socket_have_nodelay():
    assert asyncio.run(_accepted_nodelay()) == 1
