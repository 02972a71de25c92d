"""gRPC `treadle.v1.WeightStore`: delta publish (client stream) and fetch (server stream).

On commit the version is announced on JetStream `treadle.weights.{model}` so replicas that
start late still learn the latest version (the stream keeps the last message per subject).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from treadle_common import metrics
from treadle_common.logs import get_logger
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.proto.treadle.v1 import weights_pb2_grpc
from treadle_weight_store.store import (
    BadRequest,
    CorruptChunk,
    LocalStore,
    NotFound,
    StoreError,
    VersionConflict,
)

log = get_logger(__name__)
SERVICE = "weight-store"

_STATUS = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    VersionConflict: grpc.StatusCode.ALREADY_EXISTS,
    CorruptChunk: grpc.StatusCode.DATA_LOSS,
}


@contextlib.asynccontextmanager
async def _as_status(context: grpc.aio.ServicerContext, method: str):
    try:
        yield
        metrics.REQUESTS.labels(SERVICE, method, "ok").inc()
    except StoreError as exc:
        metrics.REQUESTS.labels(SERVICE, method, type(exc).__name__).inc()
        await context.abort(_STATUS[type(exc)], str(exc))


class WeightStoreServicer(weights_pb2_grpc.WeightStoreServicer):
    def __init__(self, store: LocalStore, announce: Callable[[pb.WeightManifest], Awaitable[None]]):
        self.store = store
        self.announce = announce

    async def MissingChunks(self, request, context):
        async with _as_status(context, "MissingChunks"):
            return pb.MissingChunksResponse(
                missing=[h for h in request.hashes if not self.store.has_chunk(h)]
            )

    async def Publish(self, request_iterator: AsyncIterator[pb.PublishRequest], context):
        received = num_bytes = 0
        async with _as_status(context, "Publish"):
            async for item in request_iterator:
                if item.HasField("chunk"):
                    self.store.put_chunk(item.chunk.hash, item.chunk.data)
                    received += 1
                    num_bytes += len(item.chunk.data)
                    continue
                manifest = await self.store.commit(item.manifest)
                log.info(
                    "committed", model=manifest.model, version=manifest.version, new_chunks=received
                )
                await self.announce(manifest)
                return pb.PublishResponse(
                    model=manifest.model,
                    version=manifest.version,
                    num_chunks_received=received,
                    bytes_received=num_bytes,
                )
            raise BadRequest("publish stream ended without a manifest; nothing was committed")

    async def Fetch(self, request: pb.FetchRequest, context):
        async with _as_status(context, "Fetch"):
            manifest = self.store.get_manifest(request.model, request.version)
            yield pb.FetchResponse(manifest=manifest)
            sent = set(request.have)
            for tensor in manifest.tensors:
                for ref in tensor.chunks:
                    if ref.hash in sent:
                        continue
                    sent.add(ref.hash)
                    yield pb.FetchResponse(
                        chunk=pb.Chunk(hash=ref.hash, data=self.store.get_chunk(ref.hash))
                    )

    async def GetManifest(self, request: pb.VersionRef, context):
        async with _as_status(context, "GetManifest"):
            return self.store.get_manifest(request.model, request.version)

    async def ListVersions(self, request: pb.ListVersionsRequest, context):
        async with _as_status(context, "ListVersions"):
            return pb.ListVersionsResponse(
                versions=[
                    self.version_info(request.model, v) for v in self.store.versions(request.model)
                ]
            )

    def version_info(self, model: str, version: int) -> pb.VersionInfo:
        m = self.store.get_manifest(model, version)
        return pb.VersionInfo(
            model=model,
            version=version,
            trainer_step=m.trainer_step,
            created_at=m.created_at,
            num_bytes=self.store.num_bytes(m),
        )
