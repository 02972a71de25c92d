"""Store errors; each maps to one gRPC status and one HTTP status."""

from __future__ import annotations


class StoreError(Exception):
    pass


class BadRequest(StoreError):
    """INVALID_ARGUMENT / 400."""


class NotFound(StoreError):
    """NOT_FOUND / 404."""


class VersionConflict(StoreError):
    """ALREADY_EXISTS / 409: another publisher committed this version first."""


class CorruptChunk(StoreError):
    """DATA_LOSS / 500: stored bytes do not match their hash; never served."""


class Precondition(StoreError):
    """FAILED_PRECONDITION / 409: e.g. deleting a pinned version."""


class BackendError(StoreError):
    """UNAVAILABLE / 503: the disk or S3 failed; nothing was made visible."""


class ChunksMissing(StoreError):
    """ABORTED / 409: a commit names chunks the store does not hold (e.g. collected after the
    publisher was told they were present). Retryable: the publisher asks again what is
    missing and sends it."""


class QuotaExceeded(StoreError):
    """RESOURCE_EXHAUSTED / 429: a tenant's models would hold more bytes than its quota
    (`tenant_max_stored_bytes`); the message names the quota."""
