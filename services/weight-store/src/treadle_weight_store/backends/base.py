"""The backend interface: a dumb, blocking key-value layout. `WeightStore` (store.py) adds
verification, versioning, pins, retention, caching and concurrency on top.

Layout (same on every backend):
    chunks/ab/abcdef...                  a chunk as its encoded FetchResponse message (header +
                                         payload), named by the payload's xxh3-128 hex
    manifests/{model}/{version:012d}.pb  WeightManifest protobuf
    pins/{model}.json                    pinned versions
    reserved/{model}.json                every version number below it may have been handed
                                         out (by this store or a previous life of it)
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence


def chunk_key(digest: str) -> str:
    return f"chunks/{digest[:2]}/{digest}"


def manifest_key(model: str, version: int) -> str:
    return f"manifests/{model}/{version:012d}.pb"


class Backend(abc.ABC):
    name: str

    @abc.abstractmethod
    def has_chunk(self, digest: str) -> bool: ...

    def has_chunks(self, digests: Sequence[str]) -> list[bool]:
        """`has_chunk` of each; one call, so a store asks in one worker-thread hop (a local
        stat is far cheaper than the hop). Backends with slow lookups parallelize it."""
        return [self.has_chunk(d) for d in digests]

    @abc.abstractmethod
    def put_chunk(self, digest: str, parts: Sequence[bytes | memoryview]) -> None:
        """Store the concatenation of `parts` atomically (all bytes or none); idempotent."""

    def put_chunks(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        """`put_chunk` of each, in one call, so a backend can make them durable together;
        should it fail, some may be stored and the rest not (the caller writes them again
        one by one)."""
        for digest, parts in items:
            self.put_chunk(digest, parts)

    @abc.abstractmethod
    def get_chunk(self, digest: str) -> bytes:
        """The stored bytes; raise `NotFound` if absent."""

    @abc.abstractmethod
    def delete_chunk(self, digest: str) -> None: ...

    @abc.abstractmethod
    def list_chunks(self) -> Iterator[tuple[str, float, int]]:
        """(digest, modification time, size) of every stored chunk."""

    @abc.abstractmethod
    def put_manifest(self, model: str, version: int, data: bytes) -> None:
        """Create atomically; raise `VersionConflict` if it exists (one publisher wins)."""

    @abc.abstractmethod
    def get_manifest(self, model: str, version: int) -> bytes:
        """Raise `NotFound` if absent."""

    @abc.abstractmethod
    def delete_manifest(self, model: str, version: int) -> None: ...

    @abc.abstractmethod
    def list_versions(self, model: str) -> list[int]: ...

    @abc.abstractmethod
    def list_models(self) -> list[str]: ...

    @abc.abstractmethod
    def get_pins(self, model: str) -> set[int]: ...

    @abc.abstractmethod
    def set_pins(self, model: str, pins: set[int]) -> None: ...

    @abc.abstractmethod
    def get_reserved(self, model: str) -> int:
        """Version numbers below this may have been handed out (0: none recorded)."""

    @abc.abstractmethod
    def set_reserved(self, model: str, below: int) -> None:
        """Record, durably, that numbers below `below` may have been handed out."""
