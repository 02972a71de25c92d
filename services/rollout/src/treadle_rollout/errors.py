"""What rollout refuses a caller with, and how each edge answers it, in one place.

- Its own API's refusals are `treadle_common.runtime.errors` classes (status in the class), answered
  `{"detail": message}` by the service runtime:

| error | HTTP | when |
|---|---|---|
| `NoAdapter` | 404 | no adapter (or adapter version) of that name |
| `NoPolicy` | 404 | the served model is not the policy a request names, nor an adapter of it |
| `BadAdapter` | 400 | an adapter this engine cannot serve, or named like the policy |
| `TooManyAdapters` | 429 | `MAX_ADAPTERS` are served |
| `PolicyConflict` | 409 | a run's policy cannot take the version asked for |
| `NotConnected` | 503 | NATS (or Redis) not connected yet: ask again |

- The OpenAI-compatible routes answer in OpenAI's error format (`{"error": {message, type,
  param, code}}`, what the official clients parse): `OpenAIError`, and a request that fails
  validation on those paths (`invalid_openai_request`). `install(app)` registers both.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from treadle_common.runtime import errors


class NoAdapter(errors.NotFound):
    pass


class NoPolicy(errors.NotFound):
    pass


class BadAdapter(errors.BadRequest):
    pass


class TooManyAdapters(errors.TooManyRequests):
    pass


class PolicyConflict(errors.Conflict):
    pass


class NotConnected(errors.Unavailable):
    pass


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def openai_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def invalid_openai_request(errors_: Sequence[Any], skip: int = 0) -> OpenAIError:
    """A request body's validation errors as OpenAI's 400 naming the first bad field (`skip`:
    location parts before the field, e.g. FastAPI's `body`)."""
    first = errors_[0] if errors_ else {}
    param = ".".join(str(p) for p in first.get("loc", ())[skip:]) or None
    message = f"invalid request: {first.get('msg', 'malformed')}"
    if first.get("type") == "extra_forbidden":
        message = f"unsupported field `{param}`: this server does not implement it"
    elif param:
        message = f"invalid `{param}`: {first.get('msg')}"
    return OpenAIError(400, message, param=param)


def install(app: FastAPI) -> None:
    """OpenAI-format answers for `OpenAIError` and for invalid bodies on the OpenAI paths
    (other paths keep the runtime's 422)."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return openai_response(exc)

    default_handler = app.exception_handlers.get(RequestValidationError)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        if request.url.path.startswith(OPENAI_PATHS):
            return openai_response(invalid_openai_request(exc.errors(), skip=1))
        if default_handler is not None:
            response = default_handler(request, exc)
            return await response if inspect.isawaitable(response) else response
        return JSONResponse({"detail": exc.errors()}, status_code=422)
