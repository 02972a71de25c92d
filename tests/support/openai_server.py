"""Rollout's OpenAI routes over a real HF engine, served by uvicorn on a free port, for tests
that drive them with the official clients; the engine's calls are recorded, so a test can
compare a trajectory with exactly what the engine saw and produced."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from tests.support.services import free_port
from treadle_rollout import chat, errors, openai_api, openai_router
from treadle_rollout.engines.base import Engine, Generation, Sampling
from treadle_rollout.engines.hf import HFEngine


@dataclass
class Served:
    url: str
    engine: Engine
    frontend: openai_api.OpenAIFrontend
    calls: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(prompt, generated tokens) of every finished engine request, in order."""


def _record(engine: Engine, calls: list) -> None:
    generate, stream = engine.generate, engine.stream

    async def recorded_generate(prompt: list[int], sampling: Sampling) -> Generation:
        gen = await generate(prompt, sampling)
        calls.append((list(prompt), list(gen.tokens)))
        return gen

    async def recorded_stream(
        prompt: list[int], sampling: Sampling
    ) -> AsyncGenerator[Generation, None]:
        tokens: list[int] = []
        async for piece in stream(prompt, sampling):
            tokens += piece.tokens
            yield piece
        calls.append((list(prompt), tokens))

    engine.generate = recorded_generate  # type: ignore[method-assign]
    engine.stream = recorded_stream  # type: ignore[method-assign]


def openai_app(frontend: openai_api.OpenAIFrontend) -> FastAPI:
    """Rollout's OpenAI routes and OpenAI-format errors on an app of their own."""
    app = FastAPI()
    app.state.frontend = frontend
    errors.install(app)
    app.include_router(openai_router.router)
    return app


@contextlib.asynccontextmanager
async def serve(
    model_dir: Path, redis=None, engine: Engine | None = None, **frontend_kwargs
) -> AsyncIterator[Served]:
    """`engine`: a started engine to serve (default: a new `HFEngine` of `model_dir`), which
    is closed afterwards."""
    engine = engine or HFEngine(model_dir, "tiny")
    frontend = openai_api.OpenAIFrontend(
        engine, chat.SessionRecorder(engine.tokenizer), redis=redis, **frontend_kwargs
    )
    app = openai_app(frontend)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    served = Served(f"http://127.0.0.1:{port}/v1", engine, frontend)
    _record(engine, served.calls)
    try:
        yield served
    finally:
        server.should_exit = True
        await task
        await engine.close()
