"""A played env's way to the policy: HTTP requests of an OpenAI client, carried over the
`Play` call that rollout opened (see `env.proto`), never over a network connection of their own.

`openai_client(model)` is an `openai.AsyncOpenAI` whose HTTP transport hands each request to
`model`; the env's agent code uses it like any OpenAI client.
"""

from __future__ import annotations

import importlib
import logging
from functools import cache
from typing import Any

from treadle_env_gateway.envs.base import Model

BASE_URL = "http://policy.treadle.invalid/v1"
"""What the env's client believes it talks to (nothing resolves it: the transport relays)."""


@cache
def _transport_class(httpx_module: str) -> type:
    """A transport of `httpx_module` (the `openai` package pins its own httpx: `httpx2` in
    openai 3.x, `httpx` before) that relays each request to a `Model`."""
    httpx: Any = importlib.import_module(httpx_module)

    class RelayTransport(httpx.AsyncBaseTransport):
        def __init__(self, model: Model):
            self.model = model

        async def handle_async_request(self, request):
            body = await request.aread()
            reply = await self.model.request(request.method, request.url.path, body)
            return httpx.Response(
                reply.status,
                headers={"content-type": reply.content_type or "application/json"},
                content=reply.body,
                request=request,
            )

    return RelayTransport


def openai_client(model: Model) -> Any:
    """An `openai.AsyncOpenAI` on `model` (the `openai` package comes with the envs that use
    it: `treadle-env-gateway[verifiers]`)."""
    import openai

    httpx_module = "httpx"
    for base in openai.DefaultAsyncHttpxClient.__mro__:
        if base.__name__ == "AsyncClient":  # the httpx this openai is built on
            httpx_module = base.__module__.split(".")[0]
            break
    httpx: Any = importlib.import_module(httpx_module)
    logging.getLogger(httpx_module).setLevel(logging.WARNING)  # not a log line per model call
    transport = _transport_class(httpx_module)(model)
    return openai.AsyncOpenAI(
        base_url=BASE_URL,
        api_key="relayed",  # sent nowhere: the transport relays over Play
        http_client=httpx.AsyncClient(transport=transport, timeout=None),
        max_retries=0,  # rollout answers every request; a retry would be a second turn
    )
