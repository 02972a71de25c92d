"""`hf` engine in its own process: the service's event loop and the engine no longer share
one interpreter lock.

The rollout service's process parses requests, renders chat templates, streams SSE and
talks to Redis, NATS and gRPC; generation needs a core of its own. In one Python process
the two take turns on the GIL, so the HTTP path slows the engine down. `ProcessEngine` is
the `Engine` the service uses; it starts `process_main` (an `HFEngine`) as a child process
and talks to it over a socket pair (`wire.py`: msgpack frames; a request goes at once, a
decode step's pieces come back as one frame). This is how vLLM splits its API server from
its engine core.

- requests (`generate`, `stream`) go as messages; their pieces come back, coalesced: a
  stream that fell behind by several steps gets them as one piece. Closing a stream or
  cancelling a generate cancels the request in the engine.
- a swap (`update_to`) sends the weight-store's address, token and the version; the engine
  process fetches the delta itself, so weights never cross the socket. LoRA adapters
  (`load_adapter`) cross as safetensors bytes.
- the engine's counters (tokens, prefill, prefix-cache hits, busy seconds, restarted
  turns) come back with the pieces and are served on the service's `/metrics`.
- if the engine process dies, every request in it fails and `watch()` raises: the service
  stops with an error (and its supervisor restarts it). If the service dies, the engine
  process sees its socket close and exits.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save as save_safetensors
from transformers import AutoTokenizer

from treadle_common.clients.weights import WeightStoreClient
from treadle_common.model import lora
from treadle_common.runtime import tracing
from treadle_common.runtime.logs import get_logger
from treadle_rollout.engines import prestart, wire
from treadle_rollout.engines.base import (
    AdapterUnsupported,
    ContextOverflow,
    Engine,
    Generation,
    Sampling,
    SwapStats,
)
from treadle_rollout.engines.process_main import COUNTERS

log = get_logger(__name__)

ERRORS: dict[str, type[Exception]] = {
    "ContextOverflow": ContextOverflow,
    "AdapterUnsupported": AdapterUnsupported,
    "ValueError": ValueError,
}
CLOSE_TIMEOUT_S = 10.0
"""How long `close` waits for the engine process to exit before killing it."""


class EngineProcessGone(RuntimeError):
    """The engine process exited: the requests it held are lost to this service."""


@dataclass(eq=False)
class _Call:
    """One request or command in the engine process, as the service waits on it."""

    future: asyncio.Future[Any]
    pieces: list[Generation] = field(default_factory=list)
    progress: asyncio.Event | None = None
    """Streams: set when pieces arrive (and when the call ends)."""
    request: bool = False
    """A generation (not a command)."""


def _merge(pieces: list[Generation]) -> Generation:
    if len(pieces) == 1:
        return pieces[0]
    return Generation(
        [t for p in pieces for t in p.tokens],
        [lp for p in pieces for lp in p.logprobs],
        [v for p in pieces for v in p.versions],
        pieces[-1].finish_reason,
        [k for p in pieces for k in p.top_logprobs],
    )


class ProcessEngine(Engine):
    name = "hf"
    structured_outputs = True  # the HFEngine in the process enforces `Sampling.grammar`

    def __init__(
        self, model_dir: Path, model_name: str, options: dict[str, Any] | None = None
    ) -> None:
        """`options`: the `HFEngine` keyword arguments (`device`, `swap_policy`, `max_batch`,
        `max_context`, `prefix_cache_mb`) and `torch_threads`, `log_level`, `log_json`."""
        self.model_dir, self.model_name = Path(model_dir), model_name
        self.options = {"model_dir": str(model_dir), "model_name": model_name, **(options or {})}
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.version = 0
        self.max_context = 0
        self.device = ""
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._held: set[str] = set()
        self._adapters: list[str] = []
        self._busy_s = 0.0
        self._stats: dict[str, float | int] = {}
        self._counted = dict.fromkeys(COUNTERS, 0.0)
        self._started_at = time.perf_counter()
        self._proc: subprocess.Popen | None = None
        self._conn: wire.FrameProtocol | None = None
        self._first: asyncio.Future[list[dict[str, Any]]] | None = None
        self._closing = False

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process and wait until its model is loaded."""
        started = prestart.take(self.options) or prestart.spawn(self.options)
        self._proc, ours = started
        self._first = asyncio.get_running_loop().create_future()
        self._writer, self._conn = await wire.connect(ours, self._on_messages)
        self._conn.closed.add_done_callback(self._on_closed)
        self._out = wire.Outbox(self._writer, immediate=True)
        either: list[asyncio.Future[Any]] = [self._first, self._conn.closed]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not self._first.done():
            code = await self._wait()
            raise EngineProcessGone(f"the engine process exited with code {code}")
        first = self._first.result()
        ready = first[0].get("ready")
        if ready is None:
            kind, message = first[0].get("failed", ["RuntimeError", "no ready message"])
            await self._wait()
            raise EngineProcessGone(f"the engine process failed to start: {kind}: {message}")
        self.max_context, self.device = ready["max_context"], ready["device"]
        self._held = set(ready["held"])
        for message in first[1:]:
            self._dispatch(message)
        log.info("engine process started", pid=self._proc.pid, device=self.device)

    async def _wait(self) -> int:
        assert self._proc is not None
        return await asyncio.to_thread(self._proc.wait)

    async def watch(self) -> None:
        """Returns when the engine process was closed; raises if it exited on its own."""
        code = await self._wait()
        if not self._closing:
            raise EngineProcessGone(f"the engine process exited with code {code}")

    async def close(self) -> None:
        if self._proc is None or self._closing:
            return
        self._closing = True
        self._writer.close()  # the engine process exits when its socket closes
        try:
            await asyncio.wait_for(self._wait(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("engine process did not exit; killing it", pid=self._proc.pid)
            self._proc.kill()
            await self._wait()
        if self._conn is not None:
            await self._conn.closed

    # -- the socket ---------------------------------------------------------------------------
    def _on_messages(self, messages: list[dict[str, Any]]) -> None:
        """A frame from the engine process (in the callback that read it: no task hop)."""
        if self._first is not None and not self._first.done():
            self._first.set_result(messages)  # the ready (or failed) frame: `start` reads it
            return
        for message in messages:
            self._dispatch(message)

    def _on_closed(self, closed: asyncio.Future[BaseException | None]) -> None:
        error = closed.result()
        if error is not None and not isinstance(error, ConnectionError):
            log.error("engine process connection failed", error=repr(error))
        gone = EngineProcessGone("the engine process exited")
        for call in self._calls.values():
            if not call.future.done():
                call.future.set_exception(gone)
            if call.progress is not None:
                call.progress.set()
        self._calls.clear()

    def _dispatch(self, message: dict[str, Any]) -> None:
        state = message.get("state")
        if state is not None:
            self._take_state(state)
            return
        call = self._calls.get(message["id"])
        if call is None:  # cancelled here first
            return
        if "err" in message:
            kind, text = message["err"]
            self._finish(message["id"], exc=ERRORS.get(kind, RuntimeError)(text))
        elif "ok" in message:
            self._finish(message["id"], result=message["ok"])
        else:
            piece = wire.generation_from_wire(message)
            if call.progress is not None:
                call.pieces.append(piece)
                call.progress.set()
            if piece.finish_reason:
                self._finish(message["id"], result=piece)

    def _finish(self, id_: int, result: Any = None, exc: Exception | None = None) -> None:
        call = self._calls.pop(id_)
        if call.future.done():
            pass
        elif exc is not None:
            call.future.set_exception(exc)
        else:
            call.future.set_result(result)
        if call.progress is not None:
            call.progress.set()

    def _take_state(self, state: dict[str, Any]) -> None:
        self._busy_s, self._stats = state["busy_s"], state["stats"]
        for name, total in state["counters"].items():
            delta = total - self._counted[name]
            if delta > 0:
                COUNTERS[name].inc(delta)
            self._counted[name] = total

    def _call(
        self, message: dict[str, Any], request: bool = False, streamed: bool = False
    ) -> tuple[int, _Call]:
        if self._closing or self._conn is None or self._conn.closed.done():
            raise EngineProcessGone("the engine process is not running")
        id_ = next(self._ids)
        call = _Call(asyncio.get_running_loop().create_future(), request=request)
        if streamed:
            call.progress = asyncio.Event()
        self._calls[id_] = call
        self._out.send({**message, "id": id_})
        return id_, call

    def _cancel(self, id_: int) -> None:
        if self._calls.pop(id_, None) is not None and not self._writer.is_closing():
            self._out.send({"op": "cancel", "id": id_})

    async def _command(self, message: dict[str, Any]) -> Any:
        id_, call = self._call(message)
        try:
            return await asyncio.shield(call.future)
        except asyncio.CancelledError:
            self._cancel(id_)
            raise

    def _check_prompt(self, prompt_tokens: list[int]) -> None:
        if len(prompt_tokens) >= self.max_context:
            raise ContextOverflow(
                f"prompt of {len(prompt_tokens)} tokens leaves no room in the "
                f"{self.max_context}-token context"
            )

    # -- the Engine API -----------------------------------------------------------------------
    async def generate(self, prompt_tokens: list[int], sampling: Sampling) -> Generation:
        self._check_prompt(prompt_tokens)
        message = {"op": "generate", "prompt": list(prompt_tokens)}
        id_, call = self._call({**message, "sampling": wire.sampling_to_wire(sampling)}, True)
        try:
            return await call.future
        finally:
            self._cancel(id_)  # a no-op once it finished

    async def stream(
        self, prompt_tokens: list[int], sampling: Sampling
    ) -> AsyncGenerator[Generation, None]:
        self._check_prompt(prompt_tokens)
        id_, call = self._call(
            {
                "op": "generate",
                "prompt": list(prompt_tokens),
                "sampling": wire.sampling_to_wire(sampling),
                "stream": True,
            },
            request=True,
            streamed=True,
        )
        assert call.progress is not None
        try:
            while True:
                await call.progress.wait()
                call.progress.clear()
                if call.pieces:
                    pieces, call.pieces = call.pieces, []
                    yield _merge(pieces)
                if call.future.done():
                    call.future.result()  # raises the engine's error
                    return
        finally:
            self._cancel(id_)

    async def update_to(self, store: WeightStoreClient, version: int) -> SwapStats:
        result = await self._command(
            {
                "op": "update",
                "address": store.address,
                "retry_s": store.retry_s,
                "token": store.token,
                "version": version,
                # the swap's trace context: the fetch the process makes carries it
                "trace": dict(tracing.grpc_metadata()),
            }
        )
        self.version = result["engine_version"]
        self._held = set(result["held"])
        return SwapStats(
            result["version"], result["pause_s"], result["fetch_s"], result["bytes_fetched"]
        )

    def held_chunks(self) -> set[str]:
        return self._held

    async def load_adapter(
        self, name: str, tensors: dict, config: lora.AdapterConfig, version: int = 0
    ) -> None:
        self._adapters = await self._command(
            {
                "op": "load_adapter",
                "name": name,
                "version": version,
                "tensors": save_safetensors({k: t.contiguous() for k, t in tensors.items()}),
                "config": wire.adapter_config_to_wire(config),
            }
        )

    async def unload_adapter(self, name: str) -> None:
        self._adapters = await self._command({"op": "unload_adapter", "name": name})

    def adapters(self) -> list[str]:
        return list(self._adapters)

    @property
    def running(self) -> int:
        return sum(call.request for call in self._calls.values())

    def busy_fraction(self) -> float:
        return self._busy_s / max(1e-9, time.perf_counter() - self._started_at)

    def busy_seconds(self) -> float:
        return self._busy_s

    def stats(self) -> dict[str, float | int]:
        return dict(self._stats)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None
