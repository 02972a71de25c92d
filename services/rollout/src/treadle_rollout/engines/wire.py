"""What crosses between the rollout service and its engine process (`process.py`).

Frames on a local stream socket: a 4-byte big-endian length, then a msgpack array of
messages (maps). Each side queues its messages and writes them as one frame per event-loop
turn (`Outbox`), so one decode step's pieces for every running request cost one write and
one read. Only names, numbers, token ids and safetensors bytes cross: no pickle.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import msgpack

from treadle_common import lora
from treadle_rollout.engines.base import Generation, Sampling

MAX_FRAME = 1 << 31
"""Frames are at most this long (an adapter's tensors are the largest)."""


async def read_frame(reader: asyncio.StreamReader) -> list[dict[str, Any]]:
    """The next frame's messages; `asyncio.IncompleteReadError` once the other side closed."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > MAX_FRAME:
        raise ValueError(f"a {size}-byte frame is longer than {MAX_FRAME}")
    messages = msgpack.unpackb(await reader.readexactly(size), raw=False)
    if not isinstance(messages, list):
        raise ValueError("a frame holds an array of messages")
    return messages


def encode_frame(messages: list[dict[str, Any]]) -> bytes:
    body = msgpack.packb(messages, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


class Outbox:
    """Messages queued during one event-loop turn leave as one frame at its end."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._queued: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        if not self._queued:
            asyncio.get_running_loop().call_soon(self._flush)
        self._queued.append(message)

    def _flush(self) -> None:
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
