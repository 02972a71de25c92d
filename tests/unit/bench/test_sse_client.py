"""The bench's lean SSE client (`treadle_bench.sse_client`) against a real uvicorn server:
events split anywhere arrive whole, connections are reused, errors are raised."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from treadle_bench.sse_client import SSEClient, SSEError

pytestmark = pytest.mark.unit


async def events(request):
    body = await request.json()

    async def pieces():
        for i in range(body["n"]):  # every event in two writes, split inside its JSON
            yield f'data: {{"i": {i}, '
            yield f'"text": "{body["text"]}"}}\n\n'
            await asyncio.sleep(0)
        yield "data: [DONE]\n\n"

    return StreamingResponse(pieces(), media_type="text/event-stream")


async def refuse(request):
    return JSONResponse({"error": {"message": "no such model"}}, status_code=404)


async def cut(request):
    async def pieces():
        yield 'data: {"i": 0}\n\n'
        raise RuntimeError("the server fails mid-stream")

    return StreamingResponse(pieces(), media_type="text/event-stream")


@pytest.fixture
async def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = Starlette(
        routes=[
            Route("/events", events, methods=["POST"]),
            Route("/refuse", refuse, methods=["POST"]),
            Route("/cut", cut, methods=["POST"]),
        ]
    )
    srv = uvicorn.Server(uvicorn.Config(app, port=port, log_level="critical", lifespan="off"))
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    yield port
    srv.should_exit = True
    await task


async def test_events_split_anywhere_arrive_whole_on_one_reused_connection(server):
    client = SSEClient("127.0.0.1", server, {"Authorization": "Bearer t"})
    for n in (3, 40, 1):
        got: list[bytes] = []
        await client.post("/events", {"n": n, "text": "héllo"}, got.append)
        assert got[-1] == b"[DONE]"
        assert [json.loads(d) for d in got[:-1]] == [{"i": i, "text": "héllo"} for i in range(n)]
    assert len(client._all) == 1  # keep-alive: one connection served all three
    await client.close()


async def test_an_error_status_and_a_broken_stream_raise(server):
    client = SSEClient("127.0.0.1", server)
    with pytest.raises(SSEError, match="HTTP 404.*no such model"):
        await client.post("/refuse", {}, lambda data: None)
    got: list[bytes] = []
    with pytest.raises(SSEError, match="closed mid-response"):
        await client.post("/cut", {}, got.append)
    assert got == [b'{"i": 0}']  # what came before the break was delivered
    # the broken connection is not reused: the next request gets a new one and succeeds
    await client.post("/events", {"n": 2, "text": "x"}, got.append)
    assert got[-1] == b"[DONE]" and len(client._all) >= 2
    await client.close()
