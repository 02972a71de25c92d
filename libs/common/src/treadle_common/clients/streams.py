"""Redis Streams as durable work queues: protobuf entries, consumer groups, ack after durable.

Every entry holds one serialized protobuf in field `pb`. Consumers read with XREADGROUP and
XACK only once the work is durable downstream; entries left pending by a dead consumer are
reclaimed with XAUTOCLAIM after `min_idle_ms`.

An entry belongs to the consumer it is pending for. While it works on one, a consumer
`heartbeat`s it (XCLAIM ... JUSTID resets its idle time, so it is not reclaimed however long
the work legitimately waits), and `commit_owned` adds its results and acks it in one Lua
script only if it still owns it: a consumer whose entry was reclaimed (it stalled past
`min_idle_ms`) can neither renew it nor commit it, so every entry's results land once.
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
    return entries(reply, cls)


def entries(reply: Any, cls: type[M]) -> list[tuple[str, str, M | InvalidEntry]]:
    """An XREADGROUP reply as (stream, entry id, message)."""
    out = []
    for stream, items in reply or []:
        for entry_id, fields in items:
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


_OWNED = "#redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2]) == 1"
_HEARTBEAT = f"""
if not ({_OWNED}) then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""
_COMMIT = f"""
if not ({_OWNED}) then return 0 end
for i = 6, #ARGV do redis.call('XADD', KEYS[2], '*', ARGV[4], ARGV[i]) end
if ARGV[5] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[5], #ARGV - 5) end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


async def heartbeat(
    r: aioredis.Redis, stream: str, group: str, consumer: str, entry_id: str
) -> bool:
    """Reset the idle time of an entry `consumer` works on; False: it no longer owns it
    (another consumer reclaimed it, or it was acked)."""
    return bool(await r.eval(_HEARTBEAT, 1, stream, group, consumer, entry_id))


async def commit_owned(
    r: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    entry_id: str,
    *,
    out_stream: str,
    messages: list[Message],
    counter: tuple[str, str] | None = None,
) -> bool:
    """Atomically, if `consumer` still owns the entry: XADD `messages` to `out_stream`,
    HINCRBY `counter` (hash key, field) by their number and XACK the entry. False: not its
    owner any more; nothing was written."""
    state_key, field = counter or (out_stream, "")
    payloads = [m.SerializeToString() for m in messages]
    keys = (stream, out_stream, state_key)
    args = (group, consumer, entry_id, STREAM_FIELD, field, *payloads)
    return bool(await r.eval(_COMMIT, 3, *keys, *args))


async def deliveries(r: aioredis.Redis, stream: str, group: str, entry_id: str) -> int:
    """How many times a pending entry was delivered (0: it is not pending)."""
    reply: Any = await r.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
    return int(reply[0]["times_delivered"]) if reply else 0


async def trim_acked(r: aioredis.Redis, stream: str, group: str) -> int:
    """Delete the entries of `stream` that `group` has finished with (delivered and acked):
    XTRIM MINID up to its oldest pending, or else its first undelivered, entry. For a stream
    one consumer group reads. How many entries went."""
    if not await r.exists(stream):
        return 0
    info = next((g for g in await r.xinfo_groups(stream) if text(g["name"]) == group), None)
    if info is None:
        return 0
    pending: Any = await r.xpending(stream, group)
    if pending["pending"]:
        first = text(pending["min"])
    else:
        ms, seq = text(info["last-delivered-id"]).split("-")
        first = f"{ms}-{int(seq) + 1}"
    return int(await r.xtrim(stream, minid=first, approximate=False))


def text(value: bytes | str) -> str:
    """A Redis reply as text (bytes unless the client decodes responses)."""
    return value.decode() if isinstance(value, bytes) else value
