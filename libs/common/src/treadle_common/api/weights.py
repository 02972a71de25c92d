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
