"""What the typed HTTP clients share: one error for a refused request, and the ops endpoints
every service has (`/readyz`, `/v1/info`)."""

from __future__ import annotations

from typing import TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from treadle_common.api.ops import Readiness, ServiceInfo

M = TypeVar("M", bound=BaseModel)


class ApiError(RuntimeError):
    """A service answered with an HTTP error: its status and what it said."""

    def __init__(self, method: str, url: str, status_code: int, detail: str):
        super().__init__(f"{method} {url}: {status_code} {detail}")
        self.status_code, self.detail = status_code, detail


def _check(response: httpx.Response) -> None:
    if response.is_error:
        request = response.request
        raise ApiError(request.method, str(request.url), response.status_code, response.text)


def parse(response: httpx.Response, model: type[M]) -> M:
    """The response body as `model`; an HTTP error as `ApiError`."""
    _check(response)
    return model.model_validate_json(response.content)


def parse_list(response: httpx.Response, model: type[M]) -> list[M]:
    """A JSON list of `model`s; an HTTP error as `ApiError`."""
    _check(response)
    return TypeAdapter(list[model]).validate_json(response.content)  # type: ignore[valid-type]


def readiness(http: httpx.Client, base_url: str, timeout_s: float = 2.0) -> Readiness:
    """`GET /readyz`: its body is the same whether the service is ready (200) or not (503)."""
    response = http.get(f"{base_url}/readyz", timeout=timeout_s)
    return Readiness.model_validate_json(response.content)


def info(
    http: httpx.Client, base_url: str, model: type[ServiceInfo] = ServiceInfo, timeout_s=2.0
) -> ServiceInfo:
    """`GET /v1/info`, as the service's own model (`RolloutInfo`, `TrainerInfo`, ...)."""
    return parse(http.get(f"{base_url}/v1/info", timeout=timeout_s), model)
