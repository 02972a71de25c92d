"""The policy at an HTTP address, for a played env whose agent runs in another process (a
`verifiers-v1` worker): an OpenAI-compatible endpoint on 127.0.0.1 that relays each request
to its episode's `Model`, which carries it over that session's `Play` call.

Each episode gets its own base URL, `http://127.0.0.1:PORT/e/<token>/v1`, for as long as it
plays; the token (32 random bytes) names the episode, so one process's requests never reach
another episode's policy. Every request must also carry the gateway's key (`Bearer`), which
only the workers it started are given.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from treadle_common.runtime.service import SignalFreeUvicorn, bind_socket
from treadle_env_gateway.envs.base import Model


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status)


class LoopbackPolicy:
    """Started on first use in the gateway's event loop; lives as long as the process."""

    def __init__(self) -> None:
        self.key = secrets.token_urlsafe(32)
        self.models: dict[str, Model] = {}
        self.port = 0
        self._lock = asyncio.Lock()
        self._serving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async with self._lock:
            if self._serving is not None and not self._serving.done():
                return
            sock = bind_socket("env-gateway", "loopback policy", "127.0.0.1", 0)
            config = uvicorn.Config(
                Starlette(
                    routes=[Route("/e/{token}/v1/{path:path}", self._relay, methods=["POST"])]
                ),
                log_level="warning",
                lifespan="off",
                access_log=False,
            )
            self._serving = asyncio.ensure_future(SignalFreeUvicorn(config).serve(sockets=[sock]))
            self.port = sock.getsockname()[1]

    @contextlib.asynccontextmanager
    async def episode(self, model: Model) -> AsyncIterator[str]:
        """The base URL at which `model` answers while the block runs."""
        await self.start()
        token = secrets.token_urlsafe(32)
        self.models[token] = model
        try:
            yield f"http://127.0.0.1:{self.port}/e/{token}/v1"
        finally:
            self.models.pop(token, None)

    async def _relay(self, request: Request) -> Response:
        presented = request.headers.get("authorization", "")
        if not hmac.compare_digest(presented.encode(), f"Bearer {self.key}".encode()):
            return _error(401, "this endpoint is for the gateway's own workers")
        model = self.models.get(request.path_params["token"])
        if model is None:
            return _error(404, "no episode plays at this address (it ended, or never began)")
        body = await request.body()
        reply = await model.request("POST", "/v1/" + request.path_params["path"], body)
        return Response(reply.body, status_code=reply.status, media_type=reply.content_type or None)
