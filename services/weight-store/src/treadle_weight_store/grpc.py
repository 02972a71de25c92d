"""gRPC `treadle.v1.WeightStore`: delta publish (client stream) and fetch (server stream).

Publish is resumable: chunks are stored as they arrive, so after a broken stream the client
asks `MissingChunks` again and sends only the rest; nothing is visible until the manifest
commits. Fetch is resumable the same way (the client lists what it already received in
`have`). Both are back-pressured by gRPC flow control; fetch reads ahead a few chunks so the
backend and the network overlap. Once a committed version is durable (in the backend: a
crash of the store cannot lose it) it is announced on JetStream `treadle.weights.{model}`,
so late replicas learn the latest version and no replica hears of a version that may vanish.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from treadle_common.auth import policy as auth
from treadle_common.auth.policy import ANY, TRAINER, WORKERS
from treadle_common.clients import chunk_codec as codec
from treadle_common.clients.chunk_codec import ChunkView
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.proto.treadle.v1 import weights_pb2_grpc
from treadle_common.runtime import metrics, tracing
from treadle_common.runtime.errors import grpc_abort
from treadle_common.runtime.logs import get_logger
from treadle_weight_store.errors import (
    BadRequest,
    StoreError,
)
from treadle_weight_store.store import WeightStore
from treadle_weight_store.tenancy import Tenancy

log = get_logger(__name__)

POLICY = auth.grpc_policy(
    pb,
    "WeightStore",
    MissingChunks=TRAINER,
    Publish=TRAINER,
    DeleteVersion=TRAINER,
    SetPin=TRAINER,
    GarbageCollect=TRAINER,
    Fetch=WORKERS,
    GetManifest=WORKERS,
    WaitForVersion=WORKERS,
    ListVersions=ANY,
    ListModels=ANY,
)
"""Only the trainer role writes (publish, pin, delete, collect); the loop's services read
weights; anyone authenticated lists what exists."""
SERVICE = "weight-store"
READ_AHEAD = 4
GC_MIN_INTERVAL_S = 2.0
MAX_WAIT_S = 20.0
"""The longest a `WaitForVersion` waits (below the clients' 30 s unary deadline)."""
ANNOUNCE_RETRY_S = 300.0
"""How long an announcement is retried while NATS is away (then rollout's poll finds it)."""
SERVICE_NAME = "treadle.v1.WeightStore"


@contextlib.asynccontextmanager
async def _as_status(context: grpc.aio.ServicerContext, method: str):
    try:
        yield
        metrics.REQUESTS.labels(SERVICE, method, "ok").inc()
    except StoreError as exc:
        metrics.REQUESTS.labels(SERVICE, method, type(exc).__name__).inc()
        await grpc_abort(context, exc)
    except auth.AuthError as exc:  # another tenant's model (`tenancy.py`)
        metrics.REQUESTS.labels(SERVICE, method, "refused").inc()
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, exc.message)


def as_chunk(item: ChunkView | pb.PublishRequest) -> ChunkView | None:
    """A publish item as a chunk (the codec already decoded most), or None for the manifest."""
    if isinstance(item, ChunkView):
        return item
    if item.HasField("chunk"):
        return ChunkView(item.chunk.hash, item.chunk.data)
    return None


def add_to_server(servicer: WeightStoreServicer, server: grpc.aio.Server) -> None:
    """Register the servicer; Publish and Fetch use the copy-free chunk codec."""

    class Capture:  # collects the generated handlers so two of them can be swapped
        handlers: dict = {}

        def add_generic_rpc_handlers(self, _handlers) -> None:
            pass

        def add_registered_method_handlers(self, _name, handlers) -> None:
            self.handlers = handlers

    generated = Capture()
    weights_pb2_grpc.add_WeightStoreServicer_to_server(servicer, generated)
    handlers = {
        **generated.handlers,
        "Publish": grpc.stream_unary_rpc_method_handler(
            servicer.Publish,
            request_deserializer=codec.deserialize_publish_request,
            response_serializer=pb.PublishResponse.SerializeToString,
        ),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            servicer.Fetch,
            request_deserializer=pb.FetchRequest.FromString,
            response_serializer=codec.serialize_fetch_response,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class WeightStoreServicer(weights_pb2_grpc.WeightStoreServicer):
    def __init__(
        self,
        store: WeightStore,
        announce: Callable[[pb.WeightManifest], Awaitable[None]],
        max_stored_bytes: int = 0,
    ):
        self.store = store
        self.tenancy = Tenancy(store, max_stored_bytes)
        self.announce = announce
        self._collector: asyncio.Task | None = None
        self._collect_wanted = False
        self._announcing: set[asyncio.Task] = set()
        self._announced: dict[str, int] = {}  # model -> newest version announced
        self._announce_locks: dict[str, asyncio.Lock] = {}
        """One announcement of a model at a time: the stream keeps one message per model,
        so an older version published after a newer one would replace it."""

    async def drain(self) -> None:
        """SIGTERM: versions written behind reach the backend, are announced, and the next
        version number is written back exactly."""
        await self.store.flush()
        if self._announcing:
            await asyncio.gather(*self._announcing, return_exceptions=True)
        await self.store.release_reserved()

    def _collect_soon(self) -> None:
        """Apply retention and collect freed chunks after a publish, off its path: one
        collection at a time, at most one every `GC_MIN_INTERVAL_S`; publishes that land
        while one runs are covered by one more round."""
        self._collect_wanted = True
        if self._collector is None or self._collector.done():
            self._collector = asyncio.create_task(self._collect(), name="collect")

    async def _collect(self) -> None:
        while self._collect_wanted:
            self._collect_wanted = False
            started = time.monotonic()
            try:
                await self.store.settle()  # chunks still being written count as referenced
                await self.store.gc(full=False)  # the periodic one lists the backend
            except StoreError as exc:
                log.error("gc after retention failed", error=str(exc))
            await asyncio.sleep(max(0.0, started + GC_MIN_INTERVAL_S - time.monotonic()))

    def _announce_when_durable(self, manifest: pb.WeightManifest) -> None:
        """Announce once the version is durable; retried with backoff (NATS restarting) until
        it is out, or a newer version of the model is (rollout wants the newest), for up to
        `ANNOUNCE_RETRY_S`. Rollout also polls the store's latest version meanwhile."""
        model, version = manifest.model, manifest.version

        async def announce() -> None:
            if not await self.store.until_durable(model, version):
                return  # withdrawn: never announced
            deadline, delay = time.monotonic() + ANNOUNCE_RETRY_S, 0.2
            lock = self._announce_locks.setdefault(model, asyncio.Lock())
            while self._announced.get(model, -1) < version:
                try:
                    async with lock:  # checked again: a newer version may be out meanwhile
                        if self._announced.get(model, -1) >= version:
                            return
                        await self.announce(manifest)
                        self._announced[model] = version
                    return
                except Exception as exc:
                    if time.monotonic() > deadline:
                        log.error("announcing failed", version=version, error=repr(exc))
                        return
                    log.warning("announcing failed; retrying", version=version, error=repr(exc))
                    await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                    delay = min(delay * 2, 5.0)

        task = asyncio.create_task(announce())
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)

    async def MissingChunks(self, request, context):
        async with _as_status(context, "MissingChunks"):
            missing = await self.store.missing(list(request.hashes), promise=not request.probe)
            return pb.MissingChunksResponse(missing=missing)

    async def Publish(self, request_iterator: AsyncIterator[pb.PublishRequest], context):
        span = tracing.call_span("weight-store.publish", context.invocation_metadata())
        try:
            response = await self._publish(request_iterator, context)
            span.set_attributes(
                {
                    "treadle.model": response.model,
                    "treadle.version": response.version,
                    "treadle.bytes": response.bytes_received,
                }
            )
            return response
        finally:
            span.end()

    async def _publish(self, request_iterator: AsyncIterator[pb.PublishRequest], context):
        num_bytes = 0
        async with _as_status(context, "Publish"), self.store.publishing() as received:
            async for item in request_iterator:
                chunk = as_chunk(item)
                if chunk is not None:
                    # verified and held before the next message arrives: the hash reads the
                    # chunk while it is still in the CPU cache, and no task is made per chunk
                    await self.store.put_chunk(chunk.hash, chunk.data, chunk.frame)
                    received.add(chunk.hash)
                    num_bytes += len(chunk.data)
                    continue
                await self.tenancy.stamp(item.manifest)
                manifest = await self.store.commit(
                    item.manifest, stored=received, durable=item.durable
                )
                self.tenancy.committed(manifest)
                log.info(
                    "committed",
                    model=manifest.model,
                    version=manifest.version,
                    new_chunks=len(received),
                    durable=self.store.durable(manifest.model, manifest.version),
                )
                # announced in the background once durable: NATS away (restarting) never
                # fails a publish whose version is committed
                self._announce_when_durable(manifest)
                self._collect_soon()  # retire old versions and free their chunks, off this path
                return pb.PublishResponse(
                    model=manifest.model,
                    version=manifest.version,
                    num_chunks_received=len(received),
                    bytes_received=num_bytes,
                )
            raise BadRequest("publish stream ended without a manifest; nothing was committed")

    async def Fetch(self, request: pb.FetchRequest, context):
        span = tracing.call_span("weight-store.fetch", context.invocation_metadata())
        span.set_attributes({"treadle.model": request.model, "treadle.version": request.version})
        try:
            async for message in self._fetch(request, context):
                yield message
        finally:
            span.end()

    async def _fetch(self, request: pb.FetchRequest, context):
        async with _as_status(context, "Fetch"):
            await self.tenancy.check(request.model)
        async with (
            _as_status(context, "Fetch"),
            self.store.reading(request.model, request.version) as manifest,
        ):
            yield pb.FetchResponse(manifest=manifest)
            have = set(request.have)
            entries = (
                [*manifest.tensors]
                if request.skip_assets
                else [*manifest.tensors, *manifest.assets]
            )
            wanted = [c.hash for t in entries for c in t.chunks if c.hash not in have]
            wanted = list(dict.fromkeys(wanted))
            reads: list[asyncio.Task[bytes]] = []
            try:
                for i in range(len(wanted)):
                    while len(reads) < READ_AHEAD and i + len(reads) < len(wanted):
                        reads.append(
                            asyncio.create_task(self.store.get_frame(wanted[i + len(reads)]))
                        )
                    yield await reads.pop(0)  # the stored frame is the encoded FetchResponse
            finally:
                for task in reads:
                    task.cancel()

    async def GetManifest(self, request: pb.VersionRef, context):
        async with _as_status(context, "GetManifest"):
            await self.tenancy.check(request.model)
            return await self.store.get_manifest(request.model, request.version)

    async def WaitForVersion(self, request: pb.WaitForVersionRequest, context):
        async with _as_status(context, "WaitForVersion"):
            await self.tenancy.check(request.model)
            if not 0 <= request.timeout_s:
                raise BadRequest(f"timeout_s must be >= 0, not {request.timeout_s}")
            latest = await self.store.wait_for_version(
                request.model, request.version, min(request.timeout_s, MAX_WAIT_S)
            )
            return pb.WaitForVersionResponse(latest=latest)

    async def ListVersions(self, request: pb.ListVersionsRequest, context):
        async with _as_status(context, "ListVersions"):
            await self.tenancy.check(request.model)
            return pb.ListVersionsResponse(versions=await self.store.infos(request.model))

    async def ListModels(self, request, context):
        async with _as_status(context, "ListModels"):
            models = await self.tenancy.visible(await self.store.models())
            return pb.ListModelsResponse(models=models)

    async def DeleteVersion(self, request: pb.VersionRef, context):
        async with _as_status(context, "DeleteVersion"):
            await self.tenancy.check(request.model)
            deleted = await self.store.delete_version(request.model, request.version)
            self.tenancy.forget(request.model)
            return pb.DeleteVersionResponse(chunks_deleted=deleted)

    async def SetPin(self, request: pb.PinRequest, context):
        async with _as_status(context, "SetPin"):
            await self.tenancy.check(request.model)
            return await self.store.set_pin(request.model, request.version, request.pinned)

    async def GarbageCollect(self, request, context):
        async with _as_status(context, "GarbageCollect"):
            versions, chunks, num_bytes = await self.store.gc()
            return pb.GarbageCollectResponse(
                versions_deleted=versions, chunks_deleted=chunks, bytes_deleted=num_bytes
            )
