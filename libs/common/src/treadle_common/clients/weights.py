"""Weight-store client and the content-addressed chunk format (no torch needed).

A version is a `WeightManifest`: per tensor, name/dtype/shape and the ordered list of chunk
hashes that make up its raw bytes. Publish sends only the chunks the store lacks; fetch
receives only the chunks the caller does not already hold (delta by construction).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass

import grpc
import xxhash

from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.proto.treadle.v1 import weights_pb2_grpc

CHUNK_BYTES = 4 * 1024 * 1024
LATEST = -1


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


def build_manifest(
    model: str,
    tensors: Mapping[str, RawTensor],
    *,
    version: int = LATEST,
    trainer_step: int = 0,
    parent_version: int = LATEST,
    metadata: Mapping[str, str] | None = None,
) -> tuple[pb.WeightManifest, dict[str, memoryview]]:
    """Hash every chunk; return the manifest and the chunk bytes by hash."""
    manifest = pb.WeightManifest(
        model=model,
        version=version,
        parent_version=parent_version,
        trainer_step=trainer_step,
        created_at=time.time(),
        metadata=dict(metadata or {}),
    )
    chunks: dict[str, memoryview] = {}
    for name, tensor in tensors.items():
        entry = manifest.tensors.add(name=name, dtype=tensor.dtype, shape=list(tensor.shape))
        for piece in split_chunks(tensor.data):
            digest = chunk_hash(piece)
            chunks[digest] = piece
            entry.chunks.add(hash=digest, size=len(piece))
    return manifest, chunks


def chunk_positions(manifest: pb.WeightManifest) -> dict[str, list[str]]:
    """tensor name -> ordered chunk hashes."""
    return {t.name: [c.hash for c in t.chunks] for t in manifest.tensors}


@dataclass
class FetchResult:
    manifest: pb.WeightManifest
    chunks: dict[str, bytes]
    bytes_received: int


class WeightStoreClient:
    """gRPC client for the weight-store (`treadle.v1.WeightStore`)."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ],
        )
        self.stub = weights_pb2_grpc.WeightStoreStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def publish(
        self, model: str, tensors: Mapping[str, RawTensor], **manifest_fields
    ) -> pb.PublishResponse:
        """Publish a version, sending only chunks the store lacks. Returns the committed ref."""
        manifest, chunks = build_manifest(model, tensors, **manifest_fields)
        missing = await self.stub.MissingChunks(pb.MissingChunksRequest(hashes=list(chunks)))

        async def requests() -> AsyncIterator[pb.PublishRequest]:
            for digest in missing.missing:
                yield pb.PublishRequest(chunk=pb.Chunk(hash=digest, data=bytes(chunks[digest])))
            yield pb.PublishRequest(manifest=manifest)

        return await self.stub.Publish(requests())

    async def fetch(
        self, model: str, version: int = LATEST, have: Iterable[str] = ()
    ) -> FetchResult:
        """Fetch a version's manifest plus every chunk not in `have`."""
        manifest: pb.WeightManifest | None = None
        chunks: dict[str, bytes] = {}
        received = 0
        request = pb.FetchRequest(model=model, version=version, have=list(set(have)))
        async for item in self.stub.Fetch(request):
            if item.HasField("manifest"):
                manifest = item.manifest
            else:
                chunks[item.chunk.hash] = item.chunk.data
                received += len(item.chunk.data)
        if manifest is None:
            raise RuntimeError(f"weight-store sent no manifest for {model}@{version}")
        return FetchResult(manifest=manifest, chunks=chunks, bytes_received=received)

    async def list_versions(self, model: str) -> list[pb.VersionInfo]:
        response = await self.stub.ListVersions(pb.ListVersionsRequest(model=model))
        return list(response.versions)

    async def get_manifest(self, model: str, version: int = LATEST) -> pb.WeightManifest:
        return await self.stub.GetManifest(pb.VersionRef(model=model, version=version))


async def ensure_weights_stream(js) -> None:
    """The JetStream stream of weight announcements, keeping the last one per model."""
    from nats.js.api import StreamConfig

    from treadle_common import names

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

    from treadle_common import names

    await ensure_weights_stream(js)

    async def on_message(msg) -> None:
        await callback(pb.WeightAnnouncement.FromString(msg.data))
        await msg.ack()

    return await js.subscribe(
        names.weights_subject(model), cb=on_message, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
    )
