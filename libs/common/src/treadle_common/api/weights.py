"""The weight-store's HTTP API (its data plane is gRPC, `weights.proto`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class VersionInfo(BaseModel):
    """One version, as `weights.proto`'s `VersionInfo`."""

    model: str
    version: int
    trainer_step: int = 0
    created_at: float = 0.0
    num_bytes: int = 0
    pinned: bool = False
    parent_version: int = 0
    durable: bool = False

    @classmethod
    def from_proto(cls, info: Any) -> VersionInfo:
        """From `weights_pb2.VersionInfo` (the gRPC API's message)."""
        return cls(**{name: getattr(info, name) for name in cls.model_fields})


class Versions(BaseModel):
    """`GET /v1/models/{model}/versions`."""

    model: str
    versions: list[VersionInfo]


class Models(BaseModel):
    """`GET /v1/models`."""

    models: list[str]


class ChunkRef(BaseModel):
    """A content-addressed chunk: its xxh3-128 hex and size in bytes."""

    hash: str
    size: int


class TensorEntry(BaseModel):
    name: str
    dtype: str
    """safetensors' dtype name: F32, BF16, F16, I64, ..."""
    shape: list[int]
    chunks: list[ChunkRef]
    """Concatenated in order, they form the tensor's bytes."""


class AssetEntry(BaseModel):
    """A non-tensor file of the model (config.json, tokenizer files)."""

    name: str
    chunks: list[ChunkRef]


class Manifest(BaseModel):
    """`GET /v1/models/{model}/versions/{version}`: a version's manifest, as `weights.proto`'s
    `WeightManifest`."""

    model: str
    version: int
    parent_version: int
    """-1 when none."""
    trainer_step: int
    created_at: float
    tensors: list[TensorEntry]
    metadata: dict[str, str]
    assets: list[AssetEntry]

    @classmethod
    def from_proto(cls, manifest: Any) -> Manifest:
        """From `weights_pb2.WeightManifest`."""

        def chunks(entry: Any) -> list[ChunkRef]:
            return [ChunkRef(hash=c.hash, size=c.size) for c in entry.chunks]

        return cls(
            model=manifest.model,
            version=manifest.version,
            parent_version=manifest.parent_version,
            trainer_step=manifest.trainer_step,
            created_at=manifest.created_at,
            tensors=[
                TensorEntry(name=t.name, dtype=t.dtype, shape=list(t.shape), chunks=chunks(t))
                for t in manifest.tensors
            ],
            metadata=dict(manifest.metadata),
            assets=[AssetEntry(name=a.name, chunks=chunks(a)) for a in manifest.assets],
        )
