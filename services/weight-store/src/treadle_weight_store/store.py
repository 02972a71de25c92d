"""The weight store: immutable, content-addressed versions over a backend.

- Chunks are verified against their xxh3-128 hash when received and when read (a corrupted
  chunk raises `CorruptChunk`, never reaches a reader); reads go through the hot-chunk cache.
  A chunk is stored as its encoded `FetchResponse` (a frame), so serving it from the cache
  or the backend sends the stored bytes without re-encoding or copying them.
- A version becomes visible only by `commit`, after every chunk it names is stored; the
  backend creates the manifest atomically, so one of two concurrent publishers wins.
  Versions count from 1 (0 names the base weights of the model directory).
- Retention keeps the last `keep_last` versions plus pinned ones. Garbage collection deletes
  chunks no manifest references, sparing chunks of versions being read (reader leases),
  chunks of publishes in progress and chunks younger than `gc_grace_s` (a broken publish can
  resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from treadle_common.clients.chunk_codec import frame_header, frame_payload
from treadle_common.clients.weights import chunk_hash
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_weight_store.backends.base import Backend
from treadle_weight_store.cache import ChunkCache
from treadle_weight_store.errors import (
    BackendError,
    BadRequest,
    CorruptChunk,
    NotFound,
    Precondition,
    StoreError,
)

HASH_RE = re.compile(r"^[0-9a-f]{32}$")
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_CHUNK_BYTES = 16 * 2**20


def check_model(model: str) -> None:
    if not MODEL_RE.match(model):
        raise BadRequest(f"invalid model name {model!r}: use letters, digits, '.', '_' or '-'")


def check_hash(digest: str) -> None:
    if not HASH_RE.match(digest):
        raise BadRequest(f"invalid chunk hash {digest!r}")


def manifest_chunks(manifest: pb.WeightManifest) -> set[str]:
    refs = {c.hash for t in manifest.tensors for c in t.chunks}
    return refs | {c.hash for a in manifest.assets for c in a.chunks}


async def _io(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking backend call in a thread; backend failures surface as `BackendError`."""
    try:
        return await asyncio.to_thread(fn, *args)
    except StoreError:
        raise
    except Exception as exc:  # OSError (disk full, ...), S3Error, connection errors
        raise BackendError(f"storage backend failed: {type(exc).__name__}: {exc}") from exc


class WeightStore:
    def __init__(
        self,
        backend: Backend,
        *,
        cache_bytes: int = 1 << 30,
        keep_last: int = 8,
        gc_grace_s: float = 600.0,
    ):
        self.backend = backend
        self.cache = ChunkCache(cache_bytes)
        self.keep_last = keep_last
        self.gc_grace_s = gc_grace_s
        self._commit_lock = asyncio.Lock()
        self._leases: Counter[tuple[str, int]] = Counter()
        self._publishing: dict[int, set[str]] = {}

    # -- chunks ---------------------------------------------------------------------------------
    async def missing(self, hashes: list[str]) -> list[str]:
        for digest in hashes:
            check_hash(digest)
        unique = list(dict.fromkeys(hashes))
        present = await _io(self.backend.has_chunks, unique) if unique else []
        return [h for h, ok in zip(unique, present, strict=True) if not ok]

    async def put_chunk(
        self, digest: str, data: bytes | memoryview, frame: bytes | None = None
    ) -> None:
        """Verify and store a chunk. `frame`, when given, is the received message that holds
        `data`: it is stored and cached as is (it is already the fetch message)."""
        check_hash(digest)
        if len(data) > MAX_CHUNK_BYTES:
            raise BadRequest(f"chunk {digest} is {len(data)} bytes; the limit is {MAX_CHUNK_BYTES}")
        parts = (frame_header(digest, len(data)), data) if frame is None else (frame,)

        def verify_and_write() -> None:  # in a worker thread: xxhash releases the GIL
            if chunk_hash(data) != digest:
                raise BadRequest(f"chunk {digest} does not match its content hash")
            self.backend.put_chunk(digest, parts)

        await _io(verify_and_write)
        if frame is not None:  # replicas fetch a new version right after it is published
            self.cache.put(digest, frame)

    async def get_frame(self, digest: str) -> bytes:
        """The chunk as its encoded FetchResponse (verified), from the cache or the backend."""

        async def load() -> bytes:
            frame = await _io(self.backend.get_chunk, digest)
            chunk = frame_payload(frame)
            if chunk is None or chunk.hash != digest or chunk_hash(chunk.data) != digest:
                raise CorruptChunk(
                    f"chunk {digest} is corrupted in the {self.backend.name} backend"
                )
            return frame

        return await self.cache.get(digest, load)

    @contextlib.asynccontextmanager
    async def publishing(self) -> AsyncIterator[set[str]]:
        """Track the chunks of one publish stream so GC spares them until it ends."""
        received: set[str] = set()
        self._publishing[id(received)] = received
        try:
            yield received
        finally:
            del self._publishing[id(received)]

    # -- versions -------------------------------------------------------------------------------
    async def versions(self, model: str) -> list[int]:
        check_model(model)
        return await _io(self.backend.list_versions, model)

    async def models(self) -> list[str]:
        return await _io(self.backend.list_models)

    async def resolve(self, model: str, version: int) -> int:
        if version >= 0:
            return version
        versions = await self.versions(model)
        if not versions:
            raise NotFound(f"model {model!r} has no versions")
        return versions[-1]

    async def get_manifest(self, model: str, version: int) -> pb.WeightManifest:
        check_model(model)
        version = await self.resolve(model, version)
        return pb.WeightManifest.FromString(await _io(self.backend.get_manifest, model, version))

    async def commit(
        self, manifest: pb.WeightManifest, stored: Collection[str] = ()
    ) -> pb.WeightManifest:
        """Make a version visible once every chunk it names is stored and valid. `stored`:
        chunks this publish stream has just verified and written (not looked up again)."""
        check_model(manifest.model)
        if manifest.version == 0:
            raise BadRequest(
                "version 0 is reserved for a model's base weights; publish with -1 or >= 1"
            )
        for ref in (c for t in [*manifest.tensors, *manifest.assets] for c in t.chunks):
            if ref.size > MAX_CHUNK_BYTES:
                raise BadRequest(
                    f"chunk {ref.hash} is {ref.size} bytes; the limit is {MAX_CHUNK_BYTES}"
                )
        missing = await self.missing(sorted(manifest_chunks(manifest).difference(stored)))
        if missing:
            raise BadRequest(
                f"manifest names {len(missing)} chunks the store lacks, e.g. {missing[0]}"
            )
        async with self._commit_lock:
            if manifest.version < 0:
                versions = await self.versions(manifest.model)
                manifest.version = versions[-1] + 1 if versions else 1
            if not manifest.created_at:
                manifest.created_at = time.time()
            await _io(
                self.backend.put_manifest,
                manifest.model,
                manifest.version,
                manifest.SerializeToString(),
            )
        return manifest

    async def info(self, model: str, version: int) -> pb.VersionInfo:
        m = await self.get_manifest(model, version)
        pins = await _io(self.backend.get_pins, model)
        return pb.VersionInfo(
            model=model,
            version=m.version,
            trainer_step=m.trainer_step,
            created_at=m.created_at,
            num_bytes=sum(c.size for t in m.tensors for c in t.chunks),
            pinned=m.version in pins,
            parent_version=m.parent_version,
        )

    async def set_pin(self, model: str, version: int, pinned: bool) -> pb.VersionInfo:
        version = await self.resolve(model, version)
        await self.get_manifest(model, version)  # NOT_FOUND for an unknown version
        async with self._commit_lock:
            pins = await _io(self.backend.get_pins, model)
            pins = pins | {version} if pinned else pins - {version}
            await _io(self.backend.set_pins, model, pins)
        return await self.info(model, version)

    async def delete_version(self, model: str, version: int) -> int:
        """Delete one version (not pinned, not being read); GC its unreferenced chunks."""
        version = await self.resolve(model, version)
        await self.get_manifest(model, version)
        if version in await _io(self.backend.get_pins, model):
            raise Precondition(f"{model} version {version} is pinned; unpin it first")
        if self._leases[(model, version)]:
            raise Precondition(
                f"{model} version {version} is being read; retry when readers finish"
            )
        await _io(self.backend.delete_manifest, model, version)
        return (await self.gc())[1]

    # -- readers, retention, GC -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def reading(self, model: str, version: int) -> AsyncIterator[pb.WeightManifest]:
        """Lease a version for the duration of a fetch: retention and GC leave it alone."""
        manifest = await self.get_manifest(model, version)
        key = (model, manifest.version)
        self._leases[key] += 1
        try:
            yield manifest
        finally:
            self._leases[key] -= 1
            if not self._leases[key]:
                del self._leases[key]

    def readers(self) -> dict[str, int]:
        """Active fetches per version, as `model@version`."""
        return {f"{model}@{version}": n for (model, version), n in self._leases.items()}

    async def apply_retention(self, model: str) -> list[int]:
        """Delete versions beyond the last `keep_last`, except pinned and leased ones."""
        versions = await self.versions(model)
        pins = await _io(self.backend.get_pins, model)
        doomed = [
            v for v in versions[: -self.keep_last] if v not in pins and not self._leases[(model, v)]
        ]
        for version in doomed:
            await _io(self.backend.delete_manifest, model, version)
        return doomed

    async def gc(self) -> tuple[list[pb.VersionRef], int, int]:
        """Apply retention to every model, then delete chunks nothing references."""
        deleted_versions = []
        referenced: set[str] = set()
        for model in await self.models():
            deleted_versions += [
                pb.VersionRef(model=model, version=v) for v in await self.apply_retention(model)
            ]
            for version in await self.versions(model):
                with contextlib.suppress(NotFound):
                    referenced |= manifest_chunks(await self.get_manifest(model, version))
        for received in self._publishing.values():
            referenced |= received
        horizon = time.time() - self.gc_grace_s
        chunks = await _io(lambda: list(self.backend.list_chunks()))
        num_chunks = num_bytes = 0
        for digest, mtime, size in chunks:
            if digest in referenced or mtime > horizon:
                continue
            self.cache.discard(digest)
            await _io(self.backend.delete_chunk, digest)
            num_chunks += 1
            num_bytes += size
        return deleted_versions, num_chunks, num_bytes
