"""Storage backends: where chunks, manifests and pins live (local filesystem or S3)."""

from __future__ import annotations

from treadle_weight_store.backends.base import Backend
from treadle_weight_store.backends.local import LocalBackend


def make_backend(kind: str, **kwargs) -> Backend:
    if kind == "local":
        return LocalBackend(kwargs["root"])
    if kind == "s3":
        from treadle_weight_store.backends.s3 import S3Backend

        return S3Backend(**{k: v for k, v in kwargs.items() if k != "root"})
    raise ValueError(f"unknown weight-store backend {kind!r}; known: local, s3")
