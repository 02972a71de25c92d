"""What crosses between the rollout service and its engine process (`process.py`).

Frames on a local stream socket: a 4-byte big-endian length, then a msgpack array of
messages (maps). The engine process queues its messages and writes them as one frame per
decode step (`Outbox.flush` when the step is delivered, else at the end of the loop turn),
so one step's pieces for every running request cost one write and one read; the service
writes each request at once (`Outbox(immediate=True)`). Each side reads with
`FrameProtocol`, which hands a frame's messages over in the callback that received its
bytes (a stream reader's task would wake a loop turn later: on a busy serving loop, a few
ms of every request's path). Only names, numbers, token ids and safetensors bytes cross:
no pickle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Callable
from typing import Any, Protocol

import msgpack

from treadle_common.model import lora
from treadle_rollout.engines.base import Generation, Sampling

MAX_FRAME = 1 << 31
"""Frames are at most this long (an adapter's tensors are the largest)."""


def decode_body(body: bytes | bytearray) -> list[dict[str, Any]]:
    messages = msgpack.unpackb(body, raw=False)
    if not isinstance(messages, list):
        raise ValueError("a frame holds an array of messages")
    return messages


class FrameProtocol(asyncio.Protocol):
    """Reads frames as their bytes arrive: `on_messages(messages)` for each complete frame,
    in `data_received`; `closed` is done when the connection is (its result: None, or the
    error that ended it, including a malformed frame)."""

    def __init__(self, on_messages: Callable[[list[dict[str, Any]]], None]) -> None:
        self.on_messages = on_messages
        self.closed: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= 4:
            size = int.from_bytes(self._buffer[:4], "big")
            if size > MAX_FRAME:
                self._fail(ValueError(f"a {size}-byte frame is longer than {MAX_FRAME}"))
                return
            if len(self._buffer) < 4 + size:
                return
            body = self._buffer[4 : 4 + size]
            del self._buffer[: 4 + size]
            try:
                messages = decode_body(body)
            except Exception as exc:  # a malformed frame ends the connection
                self._fail(exc)
                return
            self.on_messages(messages)

    def _fail(self, exc: BaseException) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


async def connect(
    sock: socket.socket, on_messages: Callable[[list[dict[str, Any]]], None]
) -> tuple[asyncio.Transport, FrameProtocol]:
    """A connected socket as a transport that delivers frames to `on_messages`."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(
        lambda: FrameProtocol(on_messages), sock=sock
    )
    return transport, protocol


def encode_frame(messages: list[dict[str, Any]]) -> bytes:
    body = msgpack.packb(messages, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


class _Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...


class Outbox:
    """Messages queued during one event-loop turn leave as one frame at its end; with
    `immediate`, each leaves at once (the service's requests: a frame waiting for the end
    of a busy serving loop's turn is a few ms more on every request's path)."""

    def __init__(self, writer: _Writer, immediate: bool = False) -> None:
        self.writer, self.immediate = writer, immediate
        self._queued: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        if self.immediate:
            if not self.writer.is_closing():
                self.writer.write(encode_frame([message]))
            return
        if not self._queued:
            asyncio.get_running_loop().call_soon(self.flush)
        self._queued.append(message)

    def flush(self) -> None:
        """Write what is queued now (the turn's end then finds nothing)."""
        messages, self._queued = self._queued, []
        if messages and not self.writer.is_closing():
            self.writer.write(encode_frame(messages))


def sampling_to_wire(sampling: Sampling) -> dict[str, Any]:
    return dataclasses.asdict(sampling)


def sampling_from_wire(data: dict[str, Any]) -> Sampling:
    data = dict(data)
    data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
    data["stop_strings"] = tuple(data.get("stop_strings", ()))
    return Sampling(**data)


def generation_to_wire(gen: Generation) -> dict[str, Any]:
    return {
        "t": gen.tokens,
        "l": gen.logprobs,
        "v": gen.versions,
        "f": gen.finish_reason,
        "k": gen.top_logprobs,
    }


def generation_from_wire(data: dict[str, Any]) -> Generation:
    return Generation(
        data["t"],
        data["l"],
        data["v"],
        data["f"],
        [[(int(t), float(lp)) for t, lp in step] for step in data["k"]],
    )


def adapter_config_to_wire(config: lora.AdapterConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def adapter_config_from_wire(data: dict[str, Any]) -> lora.AdapterConfig:
    return lora.AdapterConfig(**{**data, "targets": tuple(data["targets"])})
