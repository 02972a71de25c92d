"""The weight store: immutable, content-addressed versions over a backend.

- Chunks are verified against their xxh3-128 hash when received and when read (a corrupted
  chunk raises `CorruptChunk`, never reaches a reader); reads go through the hot-chunk cache.
  A chunk is stored as its encoded `FetchResponse` (a frame), so serving it from memory or
  the backend sends the stored bytes without re-encoding or copying them. A received chunk
  enters the hot cache at once (a new version is fetched right after it is published).
- Write-behind: a verified chunk is held in memory (*dirty*) and written to the backend by
  idle-priority threads while no publish or fetch streams (or once a chunk has waited
  `max_write_delay_s`, dirty bytes pass half of `max_dirty_bytes`, or someone waits for
  durability), so publishing and fetching run at network speed, not at disk or S3 speed,
  and the disk work fills the gaps between weight updates. Past `max_dirty_bytes`,
  receiving waits for the backend.
- A version becomes visible only by `commit`, once every chunk it names is held and
  verified; one of two concurrent publishers of a version wins. A version is *durable* once
  its manifest is in the backend, which happens only after all of its chunks are: a crash
  never leaves a half-written version behind, it loses the versions not yet durable.
  `commit(durable=True)` waits for that before the version becomes visible. If the backend
  fails for good (disk full, S3 down), versions that depended on the failed writes are
  withdrawn and counted, durable commits fail, and so does every commit until a write
  succeeds again. Versions count from 1 (0 names the base weights of the model directory).
- Retention keeps the last `keep_last` versions plus pinned ones. Garbage collection (one at
  a time) deletes chunks no manifest references, sparing chunks of versions being read
  (reader leases), chunks of publishes in progress, chunks younger than `gc_grace_s` (a
  broken publish can resume) and chunks a publisher was told the store holds in the last
  `PROMISE_S` (it will not send them). The collection after each publish looks only at the
  chunks the store knows (listed by the last full collection, or written since); the periodic
  one and an explicit request list the whole backend. Should a commit still name a chunk the
  store lacks, it fails with `ChunksMissing` (ABORTED), which publishers retry: they ask
  again and send it.
- A publish is idempotent: its manifest's `metadata["publish_id"]` (the client sets a fresh
  one per publish and keeps it across retries) names the version it became, so a retry of a
  publish whose answer was lost gets that version back instead of a duplicate one.
- Manifests are immutable: the last `MANIFEST_CACHE` read or committed are kept parsed in
  memory, so listing, fetching and GC do not read and parse them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Collection
from concurrent.futures import ThreadPoolExecutor

from treadle_common import names
from treadle_common.clients.chunk_codec import frame_header, frame_payload
from treadle_common.clients.weights import chunk_hash
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.runtime.logs import get_logger
from treadle_common.runtime.malloc import reuse_freed_memory
from treadle_weight_store.backends.base import Backend
from treadle_weight_store.cache import ChunkCache
from treadle_weight_store.collection import GarbageCollection
from treadle_weight_store.errors import (
    BackendError,
    BadRequest,
    ChunksMissing,
    CorruptChunk,
    NotFound,
    Precondition,
    StoreError,
    VersionConflict,
)
from treadle_weight_store.manifests import ChunkSets, manifest_chunks
from treadle_weight_store.threads import idle_priority, io
from treadle_weight_store.write_behind import WriteBehind

log = get_logger(__name__)
HASH_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_CHUNK_BYTES = 16 * 2**20
MANIFEST_CACHE = 256
IDEMPOTENCY_WINDOW = 16
VERSION_BLOCK = 64
"""Version numbers reserved (durably) at a time: a crash skips at most this many."""
"""Versions a retried publish is looked for among (by its `publish_id`)."""


def check_model(model: str) -> None:
    if not names.valid_name(model):
        raise BadRequest(
            f"invalid model name {model!r}: use letters, digits, '_', '-' and single inner "
            f"dots, at most {names.NAME_MAX}"
        )


def check_hash(digest: str) -> None:
    if not HASH_RE.match(digest):
        raise BadRequest(f"invalid chunk hash {digest!r}")


def check_manifest(manifest: pb.WeightManifest) -> None:
    """What a publisher's manifest may say: a valid model name, a version other than 0
    (a model's base weights), plain asset file names, chunks within `MAX_CHUNK_BYTES`."""
    check_model(manifest.model)
    if manifest.version == 0:
        raise BadRequest(
            "version 0 is reserved for a model's base weights; publish with -1 or >= 1"
        )
    for asset in manifest.assets:
        if not names.valid_file_name(asset.name):
            raise BadRequest(f"invalid asset name {asset.name!r}: one plain file name")
    for ref in (c for t in [*manifest.tensors, *manifest.assets] for c in t.chunks):
        if ref.size > MAX_CHUNK_BYTES:
            raise BadRequest(
                f"chunk {ref.hash} is {ref.size} bytes; the limit is {MAX_CHUNK_BYTES}"
            )


class WeightStore(WriteBehind, GarbageCollection):
    def __init__(
        self,
        backend: Backend,
        *,
        cache_bytes: int = 1 << 30,
        keep_last: int = 8,
        gc_grace_s: float = 600.0,
        max_dirty_bytes: int = 2 << 30,
        writers: int = 4,
        write_attempts: int = 3,
        max_write_delay_s: float = 10.0,
    ):
        reuse_freed_memory()  # received frames reuse the pages of evicted ones (malloc.py)
        self.backend = backend
        self.cache = ChunkCache(cache_bytes)
        self.keep_last = keep_last
        self.gc_grace_s = gc_grace_s
        self.max_dirty_bytes = max_dirty_bytes
        self.write_attempts = write_attempts
        self.max_write_delay_s = max_write_delay_s
        self._streams = 0  # publish and fetch streams open now: writes wait for a gap
        self._quiet_since = 0.0  # when the last stream ended
        self._urgent = 0  # callers waiting for durability: writes go now
        self._commit_lock = asyncio.Lock()
        self._leases: Counter[tuple[str, int]] = Counter()
        self._publishing: dict[int, set[str]] = {}
        # write-behind state: chunks not yet in the backend, versions not yet durable
        self._dirty: dict[str, bytes] = {}
        self._dirty_bytes = 0
        self._pending: dict[tuple[str, int], pb.WeightManifest] = {}
        self._reserved: dict[str, int] = {}  # model -> numbers below are reserved durably
        self._next: dict[str, int] = {}  # model -> the lowest number this life may hand out
        self._failed: dict[str, str] = {}  # chunk -> why its write failed for good
        self._changed = asyncio.Condition()
        self._manifest_lock = asyncio.Lock()
        self._queue: deque[tuple[str, float]] = deque()  # dirty chunks to write, and since when
        self._writers: set[asyncio.Task] = set()
        self._num_writers = writers
        self._writer = ThreadPoolExecutor(
            writers, thread_name_prefix="weight-writer", initializer=idle_priority
        )
        self.persist_error: str | None = None  # the last write failure, until a write works
        self._failed_at = 0.0
        self._promised: dict[str, float] = {}  # chunk -> when a publisher was told we hold it
        self._gc_lock = asyncio.Lock()
        self._manifests: dict[tuple[str, int], pb.WeightManifest] = {}  # parsed, newest last
        self._chunk_sets = ChunkSets(2 * MANIFEST_CACHE)  # of those and the pending ones
        self._committed_while_collecting: set[str] | None = None  # None: no GC running
        self._newest: dict[str, int] = {}  # model -> the newest version committed here
        # chunks in the backend as of the last full listing plus those written since:
        # digest -> (mtime, size), so a collection after a publish looks at them, not at a
        # listing of the whole backend (90,000 chunk files took 0.43 CPU-s to list)
        self._known: dict[str, tuple[float, int]] = {}
        self._listed = False

    # -- chunks ---------------------------------------------------------------------------------
    async def missing(self, hashes: list[str], promise: bool = True) -> list[str]:
        """Which of `hashes` the store lacks. `promise`: the caller (a publisher) will not
        send the others, so GC leaves them alone for `PROMISE_S`."""
        for digest in hashes:
            check_hash(digest)
        unique = [h for h in dict.fromkeys(hashes) if h not in self._dirty]
        present = await io(self.backend.has_chunks, unique) if unique else []
        lacking = [h for h, ok in zip(unique, present, strict=True) if not ok]
        if promise:
            now, lacked = time.monotonic(), set(lacking)
            for digest in hashes:
                if digest not in lacked:
                    self._promised[digest] = now
        return lacking

    async def put_chunk(
        self, digest: str, data: bytes | memoryview, frame: bytes | None = None
    ) -> None:
        """Verify a chunk and hold it until it is written to the backend (write-behind).
        `frame`, when given, is the received message that holds `data`: it is kept and
        served as is (it is already the fetch message)."""
        check_hash(digest)
        if len(data) > MAX_CHUNK_BYTES:
            raise BadRequest(f"chunk {digest} is {len(data)} bytes; the limit is {MAX_CHUNK_BYTES}")
        if digest in self._dirty:
            return
        # inline: xxh3 hashes 4 MiB in 0.1 to 0.4 ms; a hop to a thread and back per chunk
        # made publishes slower on a busy 2-core machine (docs/services/weight-store.md)
        if chunk_hash(data) != digest:
            raise BadRequest(f"chunk {digest} does not match its content hash")
        if frame is None:
            frame = b"".join((frame_header(digest, len(data)), data))

        def room() -> bool:
            return not self._dirty or self._dirty_bytes + len(frame) <= self.max_dirty_bytes

        if not room():  # back-pressure: the backend catches up first
            async with self._hurry(), self._changed:
                await self._changed.wait_for(room)
        if digest in self._dirty:
            return
        self._dirty[digest] = frame
        self._dirty_bytes += len(frame)
        # hot at once (replicas fetch a new version right after it): the cache then evicts the
        # oldest frames while a version arrives, so the process holds about `cache_bytes` plus
        # what is not yet written, and a new version reuses the memory of the oldest one
        self.cache.put(digest, frame)
        self._failed.pop(digest, None)
        # queued for the writers: a deque append per chunk, no task or retry state while the
        # stream runs (the writers take it in a gap, docs/services/weight-store.md)
        self._queue.append((digest, time.monotonic()))
        if len(self._writers) < self._num_writers:
            self._start_writers()
        if self._may_write():  # no stream waits for this chunk: tell an idle writer
            async with self._changed:
                self._changed.notify_all()

    # -- version numbers ----------------------------------------------------------------------
    async def _number(self, manifest: pb.WeightManifest, versions: list[int]) -> None:
        """Give an unnumbered (-1) version the next number; never one a previous life of the
        store may have handed out. Numbers are reserved durably in blocks
        (`reserved/{model}.json`) before they are used, so after a crash that lost versions
        not yet durable, the next number is past all of them; a clean shutdown writes back
        the exact next number (`release_reserved`)."""
        model = manifest.model
        if model not in self._reserved:
            floor = await io(self.backend.get_reserved, model)
            self._reserved[model] = floor
            self._next[model] = max(floor, 1)
        if manifest.version < 0:
            latest = versions[-1] + 1 if versions else 1
            manifest.version = max(self._next[model], latest)
        if manifest.version >= self._reserved[model]:
            below = manifest.version + VERSION_BLOCK
            await io(self.backend.set_reserved, model, below)
            self._reserved[model] = below
        self._next[model] = max(self._next[model], manifest.version + 1)

    async def release_reserved(self) -> None:
        """On a clean shutdown (after `flush`): the next number is exactly the next one."""
        for model, nxt in self._next.items():
            try:
                await io(self.backend.set_reserved, model, nxt)
            except StoreError as exc:
                log.warning("writing back the next version number failed", error=str(exc))

    def dirty_bytes(self) -> int:
        return self._dirty_bytes

    async def get_frame(self, digest: str) -> bytes:
        """The chunk as its encoded FetchResponse (verified): held in memory, from the cache
        or from the backend."""
        held = self._dirty.get(digest)
        if held is not None:
            return held

        async def load() -> bytes:
            frame = await io(self.backend.get_chunk, digest)
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
            async with self._stream():
                yield received
        finally:
            del self._publishing[id(received)]

    # -- versions -------------------------------------------------------------------------------
    async def versions(self, model: str) -> list[int]:
        check_model(model)
        # pending first: one that becomes durable meanwhile is then in the listing
        pending = {v for m, v in self._pending if m == model}
        return sorted(pending.union(await io(self.backend.list_versions, model)))

    async def wait_for_version(self, model: str, version: int, timeout_s: float) -> int:
        """Until `model` has a committed version >= `version` (visible, durable or not), at
        most `timeout_s`; the newest version then (-1: none). A version committed by another
        store on the same backend is seen at the end of the wait."""
        versions = await self.versions(model)
        if versions and versions[-1] >= version:
            return versions[-1]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(lambda: self._newest.get(model, -1) >= version)
        versions = await self.versions(model)
        return versions[-1] if versions else -1

    async def models(self) -> list[str]:
        """Models with a version, durable or not yet."""
        pending = {model for model, _ in self._pending}
        return sorted(pending.union(await io(self.backend.list_models)))

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
        pending = self._pending.get((model, version))
        if pending is not None:
            return pending
        cached = self._manifests.get((model, version))
        if cached is not None:
            return cached
        manifest = pb.WeightManifest.FromString(await io(self.backend.get_manifest, model, version))
        self._remember(manifest)
        return manifest

    def _remember(self, manifest: pb.WeightManifest) -> None:
        self._manifests[(manifest.model, manifest.version)] = manifest
        while len(self._manifests) > MANIFEST_CACHE:
            del self._manifests[next(iter(self._manifests))]

    async def _delete_manifest(self, model: str, version: int) -> None:
        self._manifests.pop((model, version), None)
        if self._pending.pop((model, version), None) is None:
            await io(self.backend.delete_manifest, model, version)

    async def commit(
        self, manifest: pb.WeightManifest, stored: Collection[str] = (), durable: bool = False
    ) -> pb.WeightManifest:
        """Make a version visible once every chunk it names is held and valid; with `durable`,
        only once it is in the backend. `stored`: chunks this publish stream has just
        verified (not looked up again)."""
        check_manifest(manifest)
        refs = manifest_chunks(manifest)
        failed = refs.intersection(self._failed)
        if failed:  # received, then lost: the backend refused its write
            raise BackendError(self._failed[min(failed)])
        if not durable and self.persist_error is not None:
            raise BackendError(
                f"the {self.backend.name} backend is failing, so versions cannot be kept: "
                f"{self.persist_error}"
            )
        missing = await self.missing(sorted(refs.difference(stored)), promise=False)
        if missing:
            raise ChunksMissing(
                f"manifest names {len(missing)} chunks the store lacks, e.g. {missing[0]}; "
                "ask which are missing and send them"
            )
        if durable:
            await self.wait_written(refs)
        async with self._commit_lock:
            versions = await self.versions(manifest.model)
            done = await self._published_as(manifest, versions)
            if done is not None:
                return done  # a retry of a publish that committed: the same version
            if manifest.version in versions:
                raise VersionConflict(f"{manifest.model} version {manifest.version} already exists")
            await self._number(manifest, versions)
            if not manifest.created_at:
                manifest.created_at = time.time()
            if durable:
                await io(
                    self.backend.put_manifest,
                    manifest.model,
                    manifest.version,
                    manifest.SerializeToString(),
                )
            else:
                self._pending[(manifest.model, manifest.version)] = manifest
            self._remember(manifest)
            if self._committed_while_collecting is not None:  # a GC listed versions before
                self._committed_while_collecting |= refs
            model = manifest.model
            self._newest[model] = max(self._newest.get(model, -1), manifest.version)
        async with self._changed:  # `wait_for_version` callers
            self._changed.notify_all()
        if not durable:
            await self._write_manifests()  # at once if its chunks are all in the backend
        return manifest

    async def _published_as(
        self, manifest: pb.WeightManifest, versions: list[int]
    ) -> pb.WeightManifest | None:
        """The committed manifest of the same publish (same `publish_id`), if any: looked up
        among the model's last `IDEMPOTENCY_WINDOW` versions."""
        publish_id = manifest.metadata.get("publish_id")
        if not publish_id:
            return None
        for version in reversed(versions[-IDEMPOTENCY_WINDOW:]):
            with contextlib.suppress(NotFound):
                earlier = await self.get_manifest(manifest.model, version)
                if earlier.metadata.get("publish_id") == publish_id:
                    return earlier
        return None

    async def info(
        self, model: str, version: int, pins: Collection[int] | None = None
    ) -> pb.VersionInfo:
        """`pins`: the model's pinned versions, when the caller has read them already."""
        m = await self.get_manifest(model, version)
        if pins is None:
            pins = await io(self.backend.get_pins, model)
        return pb.VersionInfo(
            model=model,
            version=m.version,
            trainer_step=m.trainer_step,
            created_at=m.created_at,
            num_bytes=self._chunk_sets.num_bytes(m),
            pinned=m.version in pins,
            parent_version=m.parent_version,
            durable=self.durable(model, m.version),
        )

    async def infos(self, model: str) -> list[pb.VersionInfo]:
        """Every version's info, oldest first. A version that retention or GC deletes between
        the listing and the reading of its manifest is left out, not an error: it is gone."""
        out = []
        pins = await io(self.backend.get_pins, model)  # once, not once per version
        for version in await self.versions(model):
            try:
                out.append(await self.info(model, version, pins))
            except NotFound:
                continue
        return out

    async def set_pin(self, model: str, version: int, pinned: bool) -> pb.VersionInfo:
        version = await self.resolve(model, version)
        await self.get_manifest(model, version)  # NOT_FOUND for an unknown version
        async with self._commit_lock:
            pins = await io(self.backend.get_pins, model)
            pins = pins | {version} if pinned else pins - {version}
            await io(self.backend.set_pins, model, pins)
        return await self.info(model, version)

    async def delete_version(self, model: str, version: int) -> int:
        """Delete one version (not pinned, not being read); GC its unreferenced chunks."""
        version = await self.resolve(model, version)
        await self.get_manifest(model, version)
        if version in await io(self.backend.get_pins, model):
            raise Precondition(f"{model} version {version} is pinned; unpin it first")
        if self._leases[(model, version)]:
            raise Precondition(
                f"{model} version {version} is being read; retry when readers finish"
            )
        await self._delete_manifest(model, version)
        return (await self.gc())[1]

    # -- readers, retention, GC -------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def reading(self, model: str, version: int) -> AsyncIterator[pb.WeightManifest]:
        """Lease a version for the duration of a fetch: retention and GC leave it alone."""
        manifest = await self.get_manifest(model, version)
        key = (model, manifest.version)
        self._leases[key] += 1
        try:
            async with self._stream():
                yield manifest
        finally:
            self._leases[key] -= 1
            if not self._leases[key]:
                del self._leases[key]

    def readers(self) -> dict[str, int]:
        """Active fetches per version, as `model@version`."""
        return {f"{model}@{version}": n for (model, version), n in self._leases.items()}
