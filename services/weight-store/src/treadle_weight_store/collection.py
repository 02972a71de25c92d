"""Retention and garbage collection: versions beyond the last `keep_last` (not pinned, not
being read) are deleted, then chunks no manifest references, sparing chunks being written,
received by a publish in progress, younger than `gc_grace_s` or promised to a publisher in
the last `PROMISE_S`. One collection at a time.

`GarbageCollection` is the part of `WeightStore` (`store.py`) that does this; its state is the
store's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_weight_store.backends.base import Backend
from treadle_weight_store.cache import ChunkCache
from treadle_weight_store.errors import NotFound
from treadle_weight_store.manifests import ChunkSets
from treadle_weight_store.threads import io

PROMISE_S = 300.0  # chunks reported present to a publisher survive GC this long


class GarbageCollection:
    backend: Backend
    cache: ChunkCache
    keep_last: int
    gc_grace_s: float
    _leases: Counter[tuple[str, int]]
    _publishing: dict[int, set[str]]
    _dirty: dict[str, bytes]
    _promised: dict[str, float]
    _gc_lock: asyncio.Lock
    _committed_while_collecting: set[str] | None
    _known: dict[str, tuple[float, int]]
    _listed: bool
    _chunk_sets: ChunkSets
    versions: Callable[[str], Awaitable[list[int]]]
    models: Callable[[], Awaitable[list[str]]]
    get_manifest: Callable[[str, int], Awaitable[pb.WeightManifest]]
    _delete_manifest: Callable[[str, int], Awaitable[None]]

    async def apply_retention(self, model: str) -> list[int]:
        """Delete versions beyond the last `keep_last`, except pinned and leased ones."""
        versions = await self.versions(model)
        pins = await io(self.backend.get_pins, model)
        doomed = [
            v for v in versions[: -self.keep_last] if v not in pins and not self._leases[(model, v)]
        ]
        for version in doomed:
            await self._delete_manifest(model, version)
        return doomed

    def _in_use(self, digest: str) -> bool:
        """Taken since the collection listed what is referenced: being written, named by a
        version committed meanwhile, received by a publish in progress, or promised."""
        return (
            digest in self._dirty
            or digest in (self._committed_while_collecting or ())
            or digest in self._promised
            or any(digest in received for received in self._publishing.values())
        )

    async def gc(self, full: bool = True) -> tuple[list[pb.VersionRef], int, int]:
        """Apply retention to every model, then delete chunks nothing references (one
        collection at a time: two would race each other's deletes). `full` lists the whole
        backend (chunks of an earlier life or another store); else only the chunks listed
        before or written since are looked at (the collection after each publish)."""
        async with self._gc_lock:
            return await self._gc(full or not self._listed)

    async def _gc(self, full: bool) -> tuple[list[pb.VersionRef], int, int]:
        started = time.time()
        self._committed_while_collecting = set()
        try:
            return await self._collect(started, full)
        finally:
            self._committed_while_collecting = None

    async def _list_chunks(self, started: float) -> None:
        """`_known` from a listing of the backend, plus chunks written since it began."""
        listed = await io(lambda: list(self.backend.list_chunks()))
        since = {d: k for d, k in self._known.items() if k[0] >= started}
        self._known = {d: (mtime, size) for d, mtime, size in listed} | since
        self._listed = True

    async def _collect(self, started: float, full: bool) -> tuple[list[pb.VersionRef], int, int]:
        deleted_versions = []
        referenced: set[str] = set()
        for model in await self.models():
            deleted_versions += [
                pb.VersionRef(model=model, version=v) for v in await self.apply_retention(model)
            ]
            for version in await self.versions(model):
                with contextlib.suppress(NotFound):
                    referenced |= self._chunk_sets(await self.get_manifest(model, version))
        for received in self._publishing.values():
            referenced |= received
        referenced.update(self._dirty)  # being written: not listed yet, or just now
        promised_since = time.monotonic() - PROMISE_S
        self._promised = {h: t for h, t in self._promised.items() if t > promised_since}
        referenced.update(self._promised)
        horizon = started - self.gc_grace_s
        if full:
            await self._list_chunks(started)
        doomed = [
            (digest, size)
            for digest, (mtime, size) in self._known.items()
            if mtime <= horizon and digest not in referenced
        ]
        num_chunks = num_bytes = 0
        for digest, size in doomed:
            if self._in_use(digest):
                continue
            self.cache.discard(digest)
            await io(self.backend.delete_chunk, digest)
            self._known.pop(digest, None)
            num_chunks += 1
            num_bytes += size
        return deleted_versions, num_chunks, num_bytes
