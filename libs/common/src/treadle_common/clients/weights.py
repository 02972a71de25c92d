"""Weight-store client and the content-addressed chunk format (no torch needed).

A version is a `WeightManifest`: per tensor, name/dtype/shape and the ordered list of chunk
hashes that make up its raw bytes, plus the model's non-tensor files (assets). Publish sends
only the chunks the store lacks; fetch receives only the chunks the caller does not hold.
Both resume after a broken stream: a retry asks again what is still missing.
Torch helpers (state dicts, in-place fetch) are in `torch_weights.py`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import xxhash
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

from treadle_common import names
from treadle_common.clients import chunk_codec as codec
from treadle_common.clients.chunk_codec import ChunkView
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.proto.treadle.v1 import weights_pb2_grpc
from treadle_common.runtime import grpc_options, tracing
from treadle_common.runtime.malloc import reuse_freed_memory

CHUNK_BYTES = 4 * 1024 * 1024
PUBLISH_BATCH_BYTES = 32 * 1024 * 1024  # chunk bytes per MissingChunks question in a publish
PUBLISH_LOOKAHEAD = 4  # batches hashed and asked about ahead of the one on the wire
LATEST = -1
_RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,  # e.g. a stream reset mid-transfer
    grpc.StatusCode.ABORTED,  # the store lost a chunk it said it held: ask again, resend
)


def chunk_hash(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class RawTensor:
    """A tensor as raw bytes: safetensors dtype name (F32, BF16, ...), shape, C-order bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview


def split_chunks(data: memoryview, chunk_bytes: int = CHUNK_BYTES) -> list[memoryview]:
    return [data[i : i + chunk_bytes] for i in range(0, max(len(data), 1), chunk_bytes)]


@dataclass
class PendingPublish:
    """A version to publish: its manifest and, per chunk, the manifest's `ChunkRef` and the
    bytes. Chunk hashes are filled in lazily (`hash_pieces`), so a publish can hash the next
    chunks while the previous ones are on the wire."""

    manifest: pb.WeightManifest
    pieces: list[tuple[pb.ChunkRef, memoryview]]

    def chunks(self) -> dict[str, memoryview]:
        """The chunk bytes by hash (every piece must be hashed)."""
        return {ref.hash: data for ref, data in self.pieces}


Piece = tuple[pb.ChunkRef, memoryview]


def layout_manifest(
    model: str,
    tensors: Mapping[str, RawTensor],
    *,
    assets: Mapping[str, bytes] | None = None,
    version: int = LATEST,
    trainer_step: int = 0,
    parent_version: int = LATEST,
    metadata: Mapping[str, str] | None = None,
) -> PendingPublish:
    """The manifest with every chunk's size and an empty hash, and the chunks' bytes."""
    manifest = pb.WeightManifest(
        model=model,
        version=version,
        parent_version=parent_version,
        trainer_step=trainer_step,
        created_at=time.time(),
        metadata=dict(metadata or {}),
    )
    pieces: list[tuple[pb.ChunkRef, memoryview]] = []

    def add(entry, data: memoryview) -> None:
        for piece in split_chunks(data):
            pieces.append((entry.chunks.add(size=len(piece)), piece))

    for name, tensor in tensors.items():
        add(
            manifest.tensors.add(name=name, dtype=tensor.dtype, shape=list(tensor.shape)),
            tensor.data,
        )
    for name, data in (assets or {}).items():
        add(manifest.assets.add(name=name), memoryview(data))
    return PendingPublish(manifest, pieces)


def hash_pieces(pieces: Iterable[tuple[pb.ChunkRef, memoryview]]) -> None:
    """Fill in the hash of every piece that has none yet (xxhash releases the GIL, so this
    runs well in a worker thread)."""
    for ref, data in pieces:
        if not ref.hash:
            ref.hash = chunk_hash(data)


def build_manifest(
    model: str, tensors: Mapping[str, RawTensor], **manifest_fields
) -> tuple[pb.WeightManifest, dict[str, memoryview]]:
    """Hash every chunk; return the manifest and the chunk bytes by hash."""
    pending = layout_manifest(model, tensors, **manifest_fields)
    hash_pieces(pending.pieces)
    return pending.manifest, pending.chunks()


def chunk_positions(manifest: pb.WeightManifest) -> dict[str, list[str]]:
    """tensor name -> ordered chunk hashes."""
    return {t.name: [c.hash for c in t.chunks] for t in manifest.tensors}


@dataclass
class FetchResult:
    manifest: pb.WeightManifest
    chunks: dict[str, bytes]
    bytes_received: int


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _RETRYABLE


RETRY_S = 60.0
"""How long a call is retried while the store is unavailable (restarting takes seconds)."""


def retrying(attempts: int | None = None, retry_s: float = RETRY_S) -> AsyncRetrying:
    """Jittered backoff (0.2 s up to 2 s) on retryable errors, for up to `retry_s` seconds
    (and at most `attempts` tries, when given)."""
    stop: stop_base = stop_after_delay(retry_s)
    if attempts is not None:
        stop = stop | stop_after_attempt(attempts)
    return AsyncRetrying(
        retry=retry_if_exception(_retryable),
        stop=stop,
        wait=wait_exponential_jitter(multiplier=0.2, max=2.0),
        reraise=True,
    )


class WeightStoreClient:
    """gRPC client for the weight-store (`treadle.v1.WeightStore`)."""

    def __init__(
        self,
        address: str,
        attempts: int | None = None,
        retry_s: float = RETRY_S,
        token: str | None = None,
    ):
        """`token`: the bearer token it presents (default `TREADLE_TOKEN`)."""
        self.address = address
        self.attempts = attempts
        self.retry_s = retry_s
        self.token = token
        reuse_freed_memory()  # chunk-sized receive buffers reuse their pages (malloc.py)
        self.channel = grpc_options.channel(address, token)
        self.stub = weights_pb2_grpc.WeightStoreStub(self.channel)
        # the two chunk-carrying calls use the copy-free codec (same bytes on the wire).
        # Publish requests are encoded in the request generator, not by a request_serializer:
        # grpc.aio streams multi-megabyte messages about half as fast when it calls a Python
        # serializer per message (measured with `treadle bench weights`)
        self.publish_call = self.channel.stream_unary(
            "/treadle.v1.WeightStore/Publish",
            response_deserializer=pb.PublishResponse.FromString,
        )
        self.fetch_call = self.channel.unary_stream(
            "/treadle.v1.WeightStore/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=codec.deserialize_fetch_response,
        )

    async def close(self) -> None:
        await self.channel.close()

    async def publish(
        self,
        model: str,
        tensors: Mapping[str, RawTensor],
        *,
        durable: bool = False,
        **manifest_fields,
    ) -> pb.PublishResponse:
        """Publish a version, sending only chunks the store lacks; resumes after a broken stream.
        The version is visible once the store holds it; `durable` waits until it is on the
        store's disk or S3 as well (checkpoints, exports)."""
        # one id for this publish and all its retries: the store answers a retry of a
        # publish that committed (its answer lost) with the same version, not a new one
        metadata = {"publish_id": uuid.uuid4().hex, **manifest_fields.pop("metadata", {})}
        pending = layout_manifest(model, tensors, metadata=metadata, **manifest_fields)
        async for attempt in retrying(self.attempts, self.retry_s):
            with attempt:
                return await self.publish_pending(pending, durable=durable)
        raise AssertionError("unreachable")

    async def publish_pending(
        self, pending: PendingPublish, durable: bool = False
    ) -> pb.PublishResponse:
        """One publish attempt, pipelined in batches of about `PUBLISH_BATCH_BYTES`: while one
        batch streams, the next `PUBLISH_LOOKAHEAD` are hashed (in order, in a thread) and the
        store is asked which of their chunks it lacks, each as soon as it is hashed; the
        manifest goes last. A retry re-asks, so it sends only the rest. A small model is one
        batch: one question, as without the pipeline."""
        batches = _batches(pending.pieces)
        hashing: list[asyncio.Task[None]] = []
        planned: deque[asyncio.Task[list[str]]] = deque()

        async def ask(batch: list[Piece], hashed: asyncio.Task[None]) -> list[str]:
            await hashed
            hashes = list(dict.fromkeys(ref.hash for ref, _ in batch))
            request = pb.MissingChunksRequest(hashes=hashes)
            return list((await self.stub.MissingChunks(request)).missing)

        def plan(i: int) -> None:
            if i < len(batches):
                hashing.append(
                    asyncio.ensure_future(_hash_after(batches[i], hashing[-1] if hashing else None))
                )
                planned.append(asyncio.ensure_future(ask(batches[i], hashing[-1])))

        failed: list[Exception] = []

        async def requests() -> AsyncIterator[bytes]:
            sent: set[str] = set()
            try:
                for i, batch in enumerate(batches):
                    missing = await planned.popleft()
                    plan(i + PUBLISH_LOOKAHEAD)
                    data = {ref.hash: piece for ref, piece in batch}
                    for digest in missing:
                        if digest not in sent:  # identical chunks within one version
                            sent.add(digest)
                            yield codec.serialize_publish_request(ChunkView(digest, data[digest]))
            except Exception as exc:  # grpc.aio cancels the call: keep the cause
                failed.append(exc)
                raise
            yield pb.PublishRequest(manifest=pending.manifest, durable=durable).SerializeToString()

        for i in range(PUBLISH_LOOKAHEAD):  # while the stream opens
            plan(i)
        try:
            return await self.publish_call(requests(), metadata=tracing.grpc_metadata())
        except asyncio.CancelledError:
            # a request iterator that raises (MissingChunks found the store away) makes
            # grpc.aio cancel the call locally, which reaches us as CancelledError: raise the
            # cause (retryable UNAVAILABLE) unless this task itself is being cancelled
            task = asyncio.current_task()
            if failed and task is not None and not task.cancelling():
                raise failed[0] from None
            raise
        finally:  # a broken stream: stop hashing and asking ahead
            _cancel_all([*hashing, *planned])

    async def fetch_stream(
        self, model: str, version: int = LATEST, have: Iterable[str] = (), skip_assets: bool = False
    ) -> AsyncIterator[pb.WeightManifest | ChunkView]:
        """The manifest, then every chunk not in `have`; resumes after a broken stream."""
        have_set = set(have)
        resolved = version
        sent_manifest = False
        async for attempt in retrying(self.attempts, self.retry_s):
            with attempt:
                request = pb.FetchRequest(
                    model=model, version=resolved, have=list(have_set), skip_assets=skip_assets
                )
                async for item in self.fetch_call(request, metadata=tracing.grpc_metadata()):
                    if isinstance(item, ChunkView):
                        have_set.add(item.hash)
                        yield item
                    else:
                        resolved = item.manifest.version  # a retry must not jump to a newer latest
                        if not sent_manifest:
                            sent_manifest = True
                            yield item.manifest

    async def fetch(
        self, model: str, version: int = LATEST, have: Iterable[str] = (), skip_assets: bool = False
    ) -> FetchResult:
        """Fetch a version's manifest plus every chunk not in `have`, into memory."""
        manifest: pb.WeightManifest | None = None
        chunks: dict[str, bytes] = {}
        received = 0
        async for item in self.fetch_stream(model, version, have, skip_assets):
            if isinstance(item, pb.WeightManifest):
                manifest = item
            else:
                chunks[item.hash] = bytes(item.data)
                received += len(item.data)
        if manifest is None:
            raise RuntimeError(f"weight-store sent no manifest for {model}@{version}")
        return FetchResult(manifest=manifest, chunks=chunks, bytes_received=received)

    async def latest(self, model: str) -> int | None:
        versions = await self.list_versions(model)
        return versions[-1].version if versions else None

    async def _unary(self, method, request, timeout_s: float = grpc_options.UNARY_DEADLINE_S):
        """A unary call with a deadline, retried (jittered backoff) while the store is
        unavailable or restarting."""
        async for attempt in retrying(self.attempts, self.retry_s):
            with attempt:
                return await method(request, timeout=timeout_s)
        raise AssertionError("unreachable")

    async def wait_for_version(self, model: str, version: int, timeout_s: float) -> int | None:
        """Until the store has committed `version` of `model` or a newer one (it serves a
        committed version before it is durable, hence before it is announced), at most
        `timeout_s` (the store caps it); the newest version then, None when there is none."""
        request = pb.WaitForVersionRequest(model=model, version=version, timeout_s=timeout_s)
        response = await self._unary(
            self.stub.WaitForVersion, request, timeout_s=timeout_s + grpc_options.UNARY_DEADLINE_S
        )
        return response.latest if response.latest >= 0 else None

    async def list_versions(self, model: str) -> list[pb.VersionInfo]:
        response = await self._unary(self.stub.ListVersions, pb.ListVersionsRequest(model=model))
        return list(response.versions)

    async def get_manifest(self, model: str, version: int = LATEST) -> pb.WeightManifest:
        return await self._unary(self.stub.GetManifest, pb.VersionRef(model=model, version=version))

    async def delete_version(self, model: str, version: int) -> int:
        ref = pb.VersionRef(model=model, version=version)
        return (await self._unary(self.stub.DeleteVersion, ref)).chunks_deleted

    async def set_pin(self, model: str, version: int, pinned: bool = True) -> pb.VersionInfo:
        request = pb.PinRequest(model=model, version=version, pinned=pinned)
        return await self._unary(self.stub.SetPin, request)

    async def garbage_collect(self) -> pb.GarbageCollectResponse:
        return await self._unary(
            self.stub.GarbageCollect, pb.GarbageCollectRequest(), timeout_s=600.0
        )


async def ensure_weights_stream(js) -> None:
    """The JetStream stream of weight announcements, keeping the last one per model."""
    from nats.js.api import StreamConfig

    config = StreamConfig(
        name=names.WEIGHTS_STREAM, subjects=["treadle.weights.>"], max_msgs_per_subject=1
    )
    try:
        await js.add_stream(config)
    except Exception:  # exists with another config: bring it to ours
        await js.update_stream(config)


async def watch(js, model: str, callback) -> object:
    """Call `callback(WeightAnnouncement)` for the latest version now and each new one after.

    Late joiners get the latest announcement first (deliver policy last-per-subject).
    """
    from nats.js.api import DeliverPolicy

    await ensure_weights_stream(js)

    async def on_message(msg) -> None:
        await callback(pb.WeightAnnouncement.FromString(msg.data))
        await msg.ack()

    return await js.subscribe(
        names.weights_subject(model), cb=on_message, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
    )


def _batches(pieces: list[Piece]) -> list[list[Piece]]:
    """The pieces in order, cut into batches of about `PUBLISH_BATCH_BYTES`."""
    batches: list[list[Piece]] = [[]]
    batch_bytes = 0
    for piece in pieces:
        if batch_bytes >= PUBLISH_BATCH_BYTES:
            batches.append([])
            batch_bytes = 0
        batches[-1].append(piece)
        batch_bytes += len(piece[1])
    return batches


async def _hash_after(batch: list[Piece], previous: asyncio.Task[None] | None) -> None:
    """Hash `batch` in a thread once the batch before it is hashed: one batch at a time, in
    order."""
    if previous is not None:
        await previous
    await asyncio.to_thread(hash_pieces, batch)


def _cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel what still runs; a task already done has its error (if any) retrieved: the one
    raised to the caller is the publish's."""
    for task in tasks:
        if not task.cancel() and not task.cancelled():
            task.exception()
