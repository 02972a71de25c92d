"""What the trainer refuses a caller with. Each error's HTTP and gRPC status is its class's
(`treadle_common.runtime.errors`); the service runtime turns any of them into the response, so no
route or domain module builds an HTTP error itself.

| error | status | when |
|---|---|---|
| `PathNotAllowed` | 400 | a client names a server path outside `TREADLE_TRAINER_PATH_ROOTS` |
| `InvalidInput` | 400 | data that cannot be trained on (token ids, loss inputs, Tinker configs) |
| `NotFound` | 404 | no such run, session, client, sampler, checkpoint or request |
| `Forbidden` | 403 | another tenant's run, session or checkpoint |
| `Conflict` | 409 | exists already, owned by another trainer, a base model in use |
| `IncompatibleCheckpoint` | 409 | a checkpoint of another model or backend layout |
| `Gone` | 410 | a finished Tinker session |
| `BackendRefused` | 422 | a recipe asks for a backend this trainer's ranks cannot run |
| `CorruptCheckpoint` | 422 | a checkpoint whose files do not match their digests |
| `TooManyRequests` | 429 | a limit (sessions, clients) or a tenant's quota |
| `Unavailable` | 503 | draining, or a run's state unreadable for now |
"""

from __future__ import annotations

from treadle_common.runtime.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    ServiceError,
    TooManyRequests,
    Unavailable,
    Unprocessable,
)


class PathNotAllowed(BadRequest):
    """A client-named server path outside the directories this trainer allows."""


class InvalidInput(BadRequest, ValueError):
    """The caller's input cannot be trained on (HTTP 400; in a Tinker future, a `user`
    error)."""


class BackendRefused(Unprocessable):
    """A backend this trainer's ranks cannot run."""


class TrackerUnavailable(Unprocessable):
    """A `logging.trackers` entry whose client library this trainer lacks."""


class IncompatibleCheckpoint(Conflict, ValueError):
    """A checkpoint of another model, or of a backend that lays its files out otherwise."""


class CorruptCheckpoint(Unprocessable, ValueError):
    """A checkpoint whose files are missing or do not match the digests in its meta.json."""


__all__ = [
    "BackendRefused",
    "BadRequest",
    "Conflict",
    "CorruptCheckpoint",
    "Forbidden",
    "Gone",
    "IncompatibleCheckpoint",
    "InvalidInput",
    "NotFound",
    "PathNotAllowed",
    "ServiceError",
    "TooManyRequests",
    "Unavailable",
]
