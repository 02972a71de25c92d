"""What the env-gateway refuses a caller with. Each error's gRPC and HTTP status is its
class's (`treadle_common.runtime.errors`); the gRPC servicer (`grpc.py`) and the HTTP runtime answer
with it, each in one place.

| error | gRPC | HTTP | when |
|---|---|---|---|
| `EnvError` (`envs/base.py`) | INVALID_ARGUMENT | 400 | a task or an action the env cannot serve |
| `UnknownEnv` (`envs/base.py`) | NOT_FOUND | 404 | no environment of that name |
| `UnknownSession` | NOT_FOUND | 404 | no open session of that id (closed, expired, elsewhere) |
| `CapacityExceeded` | RESOURCE_EXHAUSTED | 429 | the replica holds its most sessions |
| `EnvCrashed` | INTERNAL | 500 | the env raised while starting an episode |
"""

from __future__ import annotations

from treadle_common.runtime import errors
from treadle_env_gateway.envs.base import EnvError, UnknownEnv


class UnknownSession(errors.NotFound, KeyError):
    """No open session of that id (a `KeyError` too: a missing key of the session table)."""


class CapacityExceeded(errors.TooManyRequests):
    """The replica holds its most sessions."""


class EnvCrashed(errors.ServiceError):
    """The env raised while starting an episode (its bug, not the request's)."""


__all__ = ["CapacityExceeded", "EnvCrashed", "EnvError", "UnknownEnv", "UnknownSession"]
