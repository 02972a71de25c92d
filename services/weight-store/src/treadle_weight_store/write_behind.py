"""Write-behind: a verified chunk is held in memory (*dirty*) and written to the backend by
idle-priority threads in the gaps between publish and fetch streams (or once it has waited
`max_write_delay_s`, dirty bytes pass half of `max_dirty_bytes`, or someone waits for
durability). A version's manifest is written only after all of its chunks are (it is then
*durable*); a write that fails for good withdraws the versions that needed it.

`WriteBehind` is the part of `WeightStore` (`store.py`) that does this; its state is the
store's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from concurrent.futures import ThreadPoolExecutor

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.runtime import metrics
from treadle_common.runtime.logs import get_logger
from treadle_weight_store.backends.base import Backend
from treadle_weight_store.cache import ChunkCache
from treadle_weight_store.errors import BackendError, StoreError, VersionConflict
from treadle_weight_store.manifests import ChunkSets
from treadle_weight_store.threads import io

log = get_logger(__name__)
WRITE_BATCH_CHUNKS = 256
WRITE_BATCH_BYTES = 64 * 2**20
"""The most one writer takes from the queue for one backend call (made durable together)."""
WRITE_GAP_S = 0.05
"""How long the store must have been without a stream before the writers take the gap: a
fetch that follows its publish at once (a replica answered at the commit) starts before the
disk work, which would otherwise share the cores with it (`treadle bench weights`)."""


class WriteBehind:
    backend: Backend
    cache: ChunkCache
    max_dirty_bytes: int
    write_attempts: int
    max_write_delay_s: float
    persist_error: str | None
    _streams: int
    _quiet_since: float
    _urgent: int
    _dirty: dict[str, bytes]
    _dirty_bytes: int
    _pending: dict[tuple[str, int], pb.WeightManifest]
    _failed: dict[str, str]
    _failed_at: float
    _changed: asyncio.Condition
    _manifest_lock: asyncio.Lock
    _queue: deque[tuple[str, float]]
    _writers: set[asyncio.Task]
    _num_writers: int
    _writer: ThreadPoolExecutor
    _manifests: dict[tuple[str, int], pb.WeightManifest]
    _known: dict[str, tuple[float, int]]
    _chunk_sets: ChunkSets
    _delete_manifest: Callable[[str, int], Awaitable[None]]

    def _start_writers(self) -> None:
        while len(self._writers) < self._num_writers:
            task = asyncio.create_task(self._write_loop())
            self._writers.add(task)
            task.add_done_callback(self._writers.discard)

    def _may_write(self) -> bool:
        """Writing now does not slow a stream down, or cannot wait any longer."""
        return (
            self._gap() <= 0
            or self._urgent > 0
            or self._dirty_bytes * 2 >= self.max_dirty_bytes
            or (bool(self._queue) and self._overdue() <= 0)
        )

    def _gap(self) -> float:
        """Seconds until the store has been without a stream for `WRITE_GAP_S` (inf while one
        runs)."""
        if self._streams:
            return math.inf
        return self._quiet_since + WRITE_GAP_S - time.monotonic()

    def _overdue(self) -> float:
        """Seconds until the oldest queued chunk has waited `max_write_delay_s`."""
        return self._queue[0][1] + self.max_write_delay_s - time.monotonic()

    async def _write_loop(self) -> None:
        """One writer: takes the queued chunks (up to `WRITE_BATCH_CHUNKS` or about
        `WRITE_BATCH_BYTES`) in arrival order whenever `_may_write`, and writes them in one
        backend call."""
        while True:
            async with self._changed:
                while not (self._queue and self._may_write()):
                    with contextlib.suppress(TimeoutError):
                        wake = min(self._overdue(), self._gap()) if self._queue else None
                        async with asyncio.timeout(wake):
                            await self._changed.wait()
                batch: list[str] = []
                size = 0
                while self._queue and len(batch) < WRITE_BATCH_CHUNKS and size < WRITE_BATCH_BYTES:
                    digest, _ = self._queue.popleft()
                    batch.append(digest)
                    size += len(self._dirty[digest])
            try:
                if len(batch) == 1:
                    await self._write_chunk(batch[0], self._dirty[batch[0]])
                else:
                    await self._write_batch(batch)
            except Exception:  # a bug past the chunks' own bookkeeping: keep writing the rest
                log.exception("chunk writer failed", chunks=batch)

    async def _write_batch(self, digests: list[str]) -> None:
        """Several dirty chunks in one backend call (made durable together); should it fail,
        each is written on its own (retried, and failing alone)."""
        started = time.monotonic()
        try:
            items = [(d, (self._dirty[d],)) for d in digests]
            await io(self.backend.put_chunks, items, executor=self._writer)
        except StoreError:
            for digest in digests:
                await self._write_chunk(digest, self._dirty[digest])
            return
        if started > self._failed_at:
            self.persist_error = None
        now = time.time()
        for digest in digests:
            frame = self._dirty.pop(digest)
            self._dirty_bytes -= len(frame)
            self._known.setdefault(digest, (now, len(frame)))
        async with self._changed:
            self._changed.notify_all()
        await self._write_manifests()

    async def _write_chunk(self, digest: str, frame: bytes) -> None:
        """Write one dirty chunk (retrying), then the manifests it was the last chunk of."""
        started = time.monotonic()
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(BackendError),
                stop=stop_after_attempt(self.write_attempts),
                wait=wait_exponential(multiplier=0.2, max=2.0),
                reraise=True,
            ):
                with attempt:
                    started = time.monotonic()
                    await io(self.backend.put_chunk, digest, (frame,), executor=self._writer)
        except StoreError as exc:  # retried above if transient; any other is as final
            self._fail(str(exc))
            self._failed[digest] = str(exc)
            self.cache.discard(digest)  # never served as if the store kept it
            log.error("chunk write failed", chunk=digest, error=str(exc))
            metrics.DROPPED.labels("weight-store", "chunk", "backend_failed").inc()
            for key, manifest in list(self._pending.items()):
                if digest in self._chunk_sets(manifest):
                    self._withdraw(key, str(exc))
        else:
            if started > self._failed_at:  # a write that began after the last failure
                self.persist_error = None
            self._known.setdefault(digest, (time.time(), len(frame)))
        finally:
            self._dirty.pop(digest, None)
            self._dirty_bytes -= len(frame)
            async with self._changed:
                self._changed.notify_all()
        await self._write_manifests()

    @contextlib.asynccontextmanager
    async def _stream(self) -> AsyncIterator[None]:
        self._streams += 1
        try:
            yield
        finally:
            self._streams -= 1
            if not self._streams:
                self._quiet_since = time.monotonic()
            async with self._changed:
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def _hurry(self) -> AsyncIterator[None]:
        self._urgent += 1
        async with self._changed:
            self._changed.notify_all()
        try:
            yield
        finally:
            self._urgent -= 1

    def _fail(self, error: str) -> None:
        self.persist_error = error
        self._failed_at = time.monotonic()

    def _withdraw(self, key: tuple[str, int], reason: str) -> None:
        """A version that can no longer become durable stops being visible (counted)."""
        self._manifests.pop(key, None)
        if self._pending.pop(key, None) is not None:
            log.error("version withdrawn", model=key[0], version=key[1], error=reason)
            metrics.DROPPED.labels("weight-store", "version", "backend_failed").inc()

    async def _write_manifests(self) -> None:
        """Make durable every pending version whose chunks are all in the backend, in order.

        Shielded: the caller (a publish whose client went away) may be cancelled, but a
        manifest write, once started, finishes with its bookkeeping; else the file would
        exist while the version stayed pending, and the next pass would find it taken."""
        await asyncio.shield(self._write_pending())

    def _put_manifest(self, key: tuple[str, int], data: bytes) -> None:
        """Write a pending manifest; the same bytes already there (a write whose answer was
        lost) are as good as written."""
        try:
            self.backend.put_manifest(*key, data)
        except VersionConflict:
            if self.backend.get_manifest(*key) != data:
                raise

    async def _write_pending(self) -> None:
        async with self._manifest_lock:
            for key in sorted(self._pending):
                manifest = self._pending.get(key)
                if manifest is None or not self._chunk_sets(manifest).isdisjoint(self._dirty):
                    continue
                try:
                    await io(
                        self._put_manifest,
                        key,
                        manifest.SerializeToString(),
                        executor=self._writer,
                    )
                except VersionConflict as exc:  # another store wrote a different one
                    self._withdraw(key, str(exc))
                except StoreError as exc:  # the backend failed
                    self._fail(str(exc))
                    self._withdraw(key, str(exc))
                else:
                    if self._pending.pop(key, None) is None:  # deleted while being written
                        with contextlib.suppress(StoreError):  # best effort: it is failing
                            await self._delete_manifest(*key)
                    async with self._changed:
                        self._changed.notify_all()

    async def wait_written(self, digests: Collection[str], hurry: bool = True) -> None:
        """Until none of `digests` is dirty; `BackendError` if the write of one failed.
        `hurry`: the writes go now, without waiting for a gap between streams."""
        wanted = set(digests)
        async with self._hurry() if hurry else contextlib.nullcontext(), self._changed:
            await self._changed.wait_for(lambda: wanted.isdisjoint(self._dirty))
        failed = wanted.intersection(self._failed)
        if failed:
            raise BackendError(self._failed[min(failed)])

    async def flush(self) -> None:
        """Until every held chunk and every pending version is in the backend (or failed)."""
        async with self._hurry(), self._changed:
            await self._changed.wait_for(lambda: not self._dirty and not self._pending)

    async def settle(self) -> None:
        """Until the chunks held now are written (or failed), in their own time: GC then
        sees them."""
        with contextlib.suppress(BackendError):
            await self.wait_written(list(self._dirty), hurry=False)

    def durable(self, model: str, version: int) -> bool:
        return (model, version) not in self._pending

    async def until_durable(self, model: str, version: int) -> bool:
        """Wait until a committed version is in the backend: True; False if it was
        withdrawn (its writes failed) or deleted meanwhile."""
        key = (model, version)
        async with self._changed:
            await self._changed.wait_for(lambda: key not in self._pending)
        if key in self._manifests:
            return True
        try:
            await io(self.backend.get_manifest, model, version)
        except StoreError:
            return False
        return True
