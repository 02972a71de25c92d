"""The engine process: an `HFEngine` serving the rollout service over a local socket.

    python -m treadle_rollout.engines.process_main <socket fd> <engine options as JSON>

Started by `process.ProcessEngine`, which holds the other end of the socket (`wire.py`).
Requests arrive as messages; pieces of every running request leave as one frame per
event-loop turn. Weight swaps are fetched here, from the weight-store address (and token)
the service passes: only the version number crosses, never the weights. The process ignores
SIGINT and SIGTERM (the service drains through it) and exits when the socket closes, which
includes the service dying.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
from opentelemetry import context
from safetensors.torch import load as load_safetensors

from treadle_common.clients.weights import WeightStoreClient
from treadle_common.runtime import tracing
from treadle_common.runtime.logs import configure_logging, get_logger
from treadle_rollout import metrics
from treadle_rollout.engines import cpus, wire
from treadle_rollout.engines.base import AdapterUnsupported, ContextOverflow, Generation, SwapStats
from treadle_rollout.engines.hf import HFEngine

log = get_logger(__name__)

COUNTERS = {
    "tokens": metrics.TOKENS,
    "prefill_tokens": metrics.PREFILL_TOKENS,
    "prefix_cache_hit_tokens": metrics.PREFIX_CACHE_HIT_TOKENS,
    "engine_busy_s": metrics.ENGINE_BUSY,
    "restarted_turns": metrics.RESTARTED_TURNS,
}
"""The engine's Prometheus counters: their totals go to the service, which serves them."""
STATE_EVERY_S = 0.05
"""The engine's state (counters, busy time, stats) goes out at least this often while busy."""


def error_of(exc: BaseException) -> list[str]:
    """The exception as [kind, message]; the service raises the same kind."""
    for kind in (ContextOverflow, AdapterUnsupported, ValueError):
        if isinstance(exc, kind):
            return [kind.__name__, str(exc)]
    return ["RuntimeError", f"{type(exc).__name__}: {exc}"]


class EngineServer:
    def __init__(self, engine: HFEngine, outbox: wire.Outbox) -> None:
        self.engine, self.out = engine, outbox
        self.tasks: dict[int, asyncio.Task] = {}
        """Commands running (swaps, adapter changes)."""
        self.requests: dict[int, asyncio.Future[Generation]] = {}
        self.stores: dict[str, WeightStoreClient] = {}
        self._state_at = 0.0
        self._state_queued = False

    def handle(self, message: dict[str, Any]) -> None:
        op, call = message["op"], message.get("id", 0)
        if op == "cancel":
            request = self.requests.pop(call, None)
            if request is not None:
                request.cancel()
            task = self.tasks.pop(call, None)
            if task is not None:
                task.cancel()
        elif op == "generate":
            self.generate(call, message)
        elif op in ("update", "load_adapter", "unload_adapter"):
            run = {
                "update": self.update,
                "load_adapter": self.load_adapter,
                "unload_adapter": self.unload_adapter,
            }[op]
            task = asyncio.create_task(self._answer(call, run(message)))
            self.tasks[call] = task
            task.add_done_callback(lambda _: self.tasks.pop(call, None))
        else:
            self.out.send({"id": call, "err": ["ValueError", f"unknown op {op!r}"]})

    async def _answer(self, call: int, work: Any) -> None:
        try:
            result = await work
        except asyncio.CancelledError:
            return  # the service cancelled: it expects no answer
        except Exception as exc:  # the service decides what it means (and logs it)
            log.debug("engine call failed", call=call, error=repr(exc))
            self.out.send({"id": call, "err": error_of(exc)})
        else:
            self.out.send({"id": call, "ok": result})
        self.send_state(force=True)

    def generate(self, call: int, message: dict[str, Any]) -> None:
        """Pieces go out as the engine hands them over (streams), the rest with the finish;
        no task per request: the engine calls back on this event loop."""
        sent = 0

        def on_piece(piece: Generation) -> None:
            nonlocal sent
            sent += len(piece.tokens)
            self.out.send({"id": call, **wire.generation_to_wire(piece)})
            self.send_state()

        def on_finish(gen: Generation) -> None:
            """The rest goes out with the step's pieces (`engine.on_delivered` writes them)."""
            self.requests.pop(call, None)
            rest = Generation(
                gen.tokens[sent:],
                gen.logprobs[sent:],
                gen.versions[sent:],
                gen.finish_reason,
                gen.top_logprobs[sent:],
            )
            self.out.send({"id": call, **wire.generation_to_wire(rest)})
            self.send_state(force=not self.requests)  # at once when the engine goes idle

        def on_done(future: asyncio.Future[Generation]) -> None:
            """Errors (a finished generation went out with `on_finish`)."""
            if self.requests.pop(call, None) is None or future.cancelled():
                return  # finished, or the service cancelled: it expects no answer
            exc = future.exception()
            if exc is not None:
                self.out.send({"id": call, "err": error_of(exc)})
                self.send_state(force=not self.requests)

        try:
            future = self.engine.submit(
                message["prompt"],
                wire.sampling_from_wire(message["sampling"]),
                on_piece if message.get("stream") else None,
                on_finish,
            )
        except Exception as exc:
            self.out.send({"id": call, "err": error_of(exc)})
            return
        self.requests[call] = future
        future.add_done_callback(on_done)

    async def update(self, message: dict[str, Any]) -> dict[str, Any]:
        address = message["address"]
        store = self.stores.get(address)
        if store is None:
            store = WeightStoreClient(
                address, retry_s=message["retry_s"], token=message.get("token")
            )
            self.stores[address] = store
        # the fetch goes out in the service's swap span's context (its gRPC metadata)
        token = context.attach(tracing.from_headers(message.get("trace")))
        try:
            stats: SwapStats = await self.engine.update_to(store, message["version"])
        finally:
            context.detach(token)
        return {
            "version": stats.version,
            "pause_s": stats.pause_s,
            "fetch_s": stats.fetch_s,
            "bytes_fetched": stats.bytes_fetched,
            "engine_version": self.engine.version,
            "held": sorted(self.engine.held_chunks()),
        }

    async def load_adapter(self, message: dict[str, Any]) -> list[str]:
        tensors = load_safetensors(message["tensors"])
        config = wire.adapter_config_from_wire(message["config"])
        await self.engine.load_adapter(
            message["name"], tensors, config, version=int(message.get("version", 0))
        )
        return self.engine.adapters()

    async def unload_adapter(self, message: dict[str, Any]) -> list[str]:
        await self.engine.unload_adapter(message["name"])
        return self.engine.adapters()

    def send_state(self, force: bool = False) -> None:
        """The state goes out once in the next loop turn (`force`: even if it went out less
        than `STATE_EVERY_S` ago)."""
        if self._state_queued:
            return
        if not force and time.perf_counter() - self._state_at < STATE_EVERY_S:
            return
        self._state_queued = True
        asyncio.get_running_loop().call_soon(self._send_state_now)

    def _send_state_now(self) -> None:
        self._state_queued, self._state_at = False, time.perf_counter()
        counters = {
            name: next(iter(counter.collect())).samples[0].value
            for name, counter in COUNTERS.items()
        }
        self.out.send(
            {
                "state": {
                    "busy_s": self.engine.busy_seconds(),
                    "stats": self.engine.stats(),
                    "counters": counters,
                }
            }
        )

    async def report_state(self) -> None:
        """While requests run, the state goes out with their pieces; this catches the rest."""
        while True:
            await asyncio.sleep(STATE_EVERY_S * 4)
            self.send_state()

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        for request in list(self.requests.values()):
            request.cancel()
        await self.engine.close()
        for store in self.stores.values():
            await store.close()


async def serve(fd: int, options: dict[str, Any]) -> None:
    sock = socket.socket(fileno=fd)
    try:
        engine = HFEngine(
            Path(options["model_dir"]),
            options["model_name"],
            options.get("device"),
            swap_policy=options.get("swap_policy", "continue"),
            max_batch=options.get("max_batch", 64),
            max_context=options.get("max_context"),
            prefix_cache_mb=options.get("prefix_cache_mb", 256),
            logit_noise=options.get("logit_noise", 0.0),
        )
    except Exception as exc:
        sock.sendall(wire.encode_frame([{"failed": error_of(exc)}]))
        sock.close()
        raise

    def on_messages(messages: list[dict[str, Any]]) -> None:
        for message in messages:
            server.handle(message)

    writer, conn = await wire.connect(sock, on_messages)
    server = EngineServer(engine, wire.Outbox(writer))
    engine.on_delivered = server.out.flush  # a step's pieces leave in the call that got them
    server.out.send(
        {
            "ready": {
                "max_context": engine.max_context,
                "device": engine.device,
                "held": sorted(engine.held_chunks()),
            }
        }
    )
    reporter = asyncio.create_task(server.report_state())
    try:
        error = await conn.closed  # the service closed the socket (or is gone)
        if error is not None and not isinstance(error, ConnectionError):
            log.error("service connection failed", error=repr(error))
    finally:
        reporter.cancel()
        await server.close()
        writer.close()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd, options = int(sys.argv[1]), json.loads(sys.argv[2])
    cpus.bind(options.get("cpus"))  # the service set it at spawn; every thread follows
    configure_logging(
        "rollout-engine", options.get("log_level", "INFO"), options.get("log_json", False)
    )
    if options.get("torch_threads"):  # before any torch work
        torch.set_num_threads(options["torch_threads"])
    asyncio.run(serve(fd, options))


if __name__ == "__main__":
    main()
