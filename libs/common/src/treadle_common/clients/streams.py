"""Redis Streams as durable work queues: protobuf entries, consumer groups, ack after durable.

Every entry holds one serialized protobuf in field `pb`. Consumers read with XREADGROUP and
XACK only once the work is durable downstream; entries left pending by a dead consumer are
reclaimed with XAUTOCLAIM after `min_idle_ms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError, Message
from redis.exceptions import ResponseError

from treadle_common.names import STREAM_FIELD

M = TypeVar("M", bound=Message)


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (and the stream) if missing; reading starts at the beginning."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def add(r: aioredis.Redis | aioredis.client.Pipeline, stream: str, message: Message):
    return await r.xadd(stream, {STREAM_FIELD: message.SerializeToString()})


@dataclass(frozen=True)
class InvalidEntry:
    """An entry that is not a valid message: consumers ack it and count `reason`."""

    reason: str


def decode(entry_fields: dict, cls: type[M]) -> M | InvalidEntry:
    raw = entry_fields.get(STREAM_FIELD.encode())
    if raw is None:
        return InvalidEntry(f"entry has no {STREAM_FIELD!r} field")
    message = cls()
    try:
        message.ParseFromString(raw)
    except DecodeError as exc:
        return InvalidEntry(f"not a {cls.__name__} protobuf: {exc}")
    return message


async def read_group(
    r: aioredis.Redis,
    streams: list[str],
    group: str,
    consumer: str,
    cls: type[M],
    *,
    count: int = 16,
    block_ms: int | None = 1000,
) -> list[tuple[str, str, M | InvalidEntry]]:
    """New entries for this consumer: (stream, entry id, message); `block_ms` None: no wait."""
    if not streams:
        return []
    reply: Any = await r.xreadgroup(
        group, consumer, {s: ">" for s in streams}, count=count, block=block_ms
    )
    out = []
    for stream, entries in reply or []:
        for entry_id, fields in entries:
            out.append((text(stream), text(entry_id), decode(fields, cls)))
    return out


async def reclaim(
    r: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    cls: type[M],
    *,
    min_idle_ms: int,
    count: int = 16,
) -> list[tuple[str, str, M | InvalidEntry]]:
    """Take over entries idle longer than `min_idle_ms` (their consumer died)."""
    reply: Any = await r.xautoclaim(stream, group, consumer, min_idle_ms, "0-0", count=count)
    entries = reply[1]  # redis 7 appends a third element (deleted ids); 6.2 does not
    return [(stream, text(entry_id), decode(fields, cls)) for entry_id, fields in entries if fields]


async def pending_own(
    r: aioredis.Redis, stream: str, group: str, consumer: str, cls: type[M], count: int = 1000
) -> list[tuple[str, str, M | InvalidEntry]]:
    """Entries already delivered to this consumer and not acked (replay after a restart)."""
    reply: Any = await r.xreadgroup(group, consumer, {stream: "0"}, count=count)
    out = []
    for _, entries in reply or []:
        for entry_id, fields in entries:
            if fields:
                out.append((stream, text(entry_id), decode(fields, cls)))
    return out


async def backlog(r: aioredis.Redis, stream: str, group: str, cap: int = 100_000) -> int:
    """Entries of `stream` the consumer group has not finished: not yet delivered + pending."""
    if not await r.exists(stream):
        return 0
    for info in await r.xinfo_groups(stream):
        if text(info["name"]) != group:
            continue
        last = text(info["last-delivered-id"])
        undelivered = await r.xrange(stream, min=f"({last}", count=cap)  # works on Redis 6.2
        return len(undelivered or []) + int(info["pending"])
    return await r.xlen(stream)  # no consumer has read yet


def text(value: bytes | str) -> str:
    """A Redis reply as text (bytes unless the client decodes responses)."""
    return value.decode() if isinstance(value, bytes) else value
