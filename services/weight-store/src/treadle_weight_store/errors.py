"""What the weight store refuses a caller with. Each error's gRPC and HTTP status is its
class's (`treadle_common.runtime.errors`): the gRPC servicer (`grpc.py`) and the HTTP runtime answer
with it, each in one place.

| error | gRPC | HTTP | when |
|---|---|---|---|
| `BadRequest` | INVALID_ARGUMENT | 400 | a malformed name, manifest or chunk |
| `NotFound` | NOT_FOUND | 404 | no such model, version or chunk |
| `VersionConflict` | ALREADY_EXISTS | 409 | another publisher committed this version first |
| `Precondition` | FAILED_PRECONDITION | 409 | e.g. deleting a pinned version |
| `ChunksMissing` | ABORTED | 409 | a commit names chunks the store does not hold (retryable) |
| `QuotaExceeded` | RESOURCE_EXHAUSTED | 429 | a tenant's models would pass its stored-bytes quota |
| `CorruptChunk` | DATA_LOSS | 500 | stored bytes do not match their hash; never served |
| `BackendError` | UNAVAILABLE | 503 | the disk or S3 failed; nothing was made visible |
"""

from __future__ import annotations

import grpc

from treadle_common.runtime import errors


class StoreError(errors.ServiceError):
    """Any refusal of the store."""


class BadRequest(StoreError, errors.BadRequest):
    pass


class NotFound(StoreError, errors.NotFound):
    pass


class VersionConflict(StoreError, errors.Conflict):
    """Another publisher committed this version first."""

    grpc_status = grpc.StatusCode.ALREADY_EXISTS


class CorruptChunk(StoreError):
    """Stored bytes do not match their hash; never served."""

    http_status = 500
    grpc_status = grpc.StatusCode.DATA_LOSS


class Precondition(StoreError, errors.Conflict):
    """E.g. deleting a pinned version."""


class BackendError(StoreError, errors.Unavailable):
    """The disk or S3 failed; nothing was made visible."""


class ChunksMissing(StoreError, errors.Conflict):
    """A commit names chunks the store does not hold (e.g. collected after the publisher was
    told they were present). Retryable: the publisher asks again what is missing and sends
    it."""

    grpc_status = grpc.StatusCode.ABORTED


class QuotaExceeded(StoreError, errors.TooManyRequests):
    """A tenant's models would hold more bytes than its quota (`tenant_max_stored_bytes`);
    the message names the quota."""
