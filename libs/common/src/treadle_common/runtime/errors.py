"""Errors a service answers a caller with: each class names its HTTP status and its gRPC status
once, and every edge turns it into a response the same way.

    raise errors.NotFound(f"no run {run_id}")   # anywhere below a route or a servicer

- HTTP: `ServiceRuntime` registers `http_response` for `ServiceError`, so a route never builds
  an `HTTPException`: the answer is `{"detail": message}` with the class's `http_status`.
- gRPC: `grpc_abort(context, exc)` aborts the call with the class's `grpc_status` and the
  message (each servicer's one status wrapper calls it).

A service's `errors.py` names its own refusals as subclasses of these (the trainer's
`PathNotAllowed` is a `BadRequest`), so its module docstring is the one table of what it
answers. Domain code raises them; it never imports the HTTP layer.
"""

from __future__ import annotations

from typing import Any, ClassVar

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse


class ServiceError(Exception):
    """A refusal with a message for the caller."""

    http_status: ClassVar[int] = 500
    grpc_status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(ServiceError):
    """400 / INVALID_ARGUMENT: the request itself is wrong; asking again will not help."""

    http_status = 400
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT


class Forbidden(ServiceError):
    """403 / PERMISSION_DENIED: the caller may not touch this (e.g. another tenant's)."""

    http_status = 403
    grpc_status = grpc.StatusCode.PERMISSION_DENIED


class NotFound(ServiceError):
    """404 / NOT_FOUND."""

    http_status = 404
    grpc_status = grpc.StatusCode.NOT_FOUND


class Conflict(ServiceError):
    """409 / FAILED_PRECONDITION: the request is fine, the state it meets is not (exists,
    owned elsewhere, in use)."""

    http_status = 409
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class Gone(ServiceError):
    """410 / FAILED_PRECONDITION: it existed and has ended."""

    http_status = 410
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class Unprocessable(ServiceError):
    """422 / FAILED_PRECONDITION: well-formed, but what it names cannot be used (a damaged
    checkpoint, a recipe the trainer cannot run)."""

    http_status = 422
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class TooManyRequests(ServiceError):
    """429 / RESOURCE_EXHAUSTED: a limit or a quota; the message names it."""

    http_status = 429
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """503 / UNAVAILABLE: passing (draining, a dependency away): ask again."""

    http_status = 503
    grpc_status = grpc.StatusCode.UNAVAILABLE


async def http_response(_request: Request, exc: Exception) -> JSONResponse:
    """The HTTP answer to a `ServiceError` raised below a route."""
    assert isinstance(exc, ServiceError)
    return JSONResponse({"detail": exc.message}, status_code=exc.http_status)


async def grpc_abort(context: Any, exc: ServiceError) -> None:
    """End a gRPC call with the error's status and message (raises, as `abort` does)."""
    await context.abort(exc.grpc_status, exc.message)
