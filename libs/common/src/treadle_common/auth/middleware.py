"""Authentication at the edge of every HTTP service, before a request's body is read.

An ASGI middleware finds the route a request is for, checks its bearer token (or Tinker's
`X-API-Key`) against the roles the route declares (`x-treadle-roles`, see `auth.roles`), and
answers 401/403 itself when the caller may not call it: a caller without a token never gets
a byte of its body read, parsed or validated (FastAPI validates bodies before dependencies
run, so a route-level check alone answered 422 to strangers). A request for no route goes on
to the app (its 404 / 405). The identity it found is in `scope["state"]` and `auth.CALLER`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import fastapi.routing
from starlette.datastructures import Headers
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from treadle_common.auth import policy as auth

IDENTITY = "identity"
"""Where the middleware leaves the caller in `scope["state"]`."""


def declared_roles(route: Any) -> list[str] | None:
    return (getattr(route, "openapi_extra", None) or {}).get(auth.ROLES_KEY)


def declared_errors(route: Any) -> str | None:
    return (getattr(route, "openapi_extra", None) or {}).get(auth.ERRORS_KEY)


def refusal(error: auth.AuthError, errors: str | None) -> dict[str, Any]:
    """The body of a refusal, in the route's declared error format."""
    if errors == "openai":  # as OpenAI's API answers a bad key (its clients parse `error`)
        code = "invalid_api_key" if error.status == 401 else "permission_denied"
        return {
            "error": {
                "message": error.message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        }
    return {"detail": error.message}


def flat(routes: Sequence[BaseRoute]) -> list[Any]:
    """Every route, included routers' too (FastAPI keeps an included router as one entry of
    `app.routes` and resolves its routes as it serves; `iter_route_contexts` lists them)."""
    contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    return list(contexts(routes)) if contexts is not None else list(routes)


def route_of(routes: Sequence[Any], scope: Scope) -> Any | None:
    """The route that serves `scope` (path and method both match), if any."""
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route
    return None


class Authenticate:
    def __init__(
        self,
        app: ASGIApp,
        routes: Callable[[], Sequence[BaseRoute]],
        identify: Callable[[str | None, list[str] | None, str], auth.Identity],
        on_refuse: Callable[[int], Any] | None = None,
    ):
        self.app, self.routes, self.identify, self.on_refuse = app, routes, identify, on_refuse
        self._flat: tuple[int, list[Any]] = (-1, [])

    def _routes(self) -> list[Any]:
        routes = self.routes()
        if self._flat[0] != len(routes):
            self._flat = (len(routes), flat(routes))
        return self._flat[1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_of(self._routes(), scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        declared = declared_roles(route)
        who = auth.ANONYMOUS
        if declared != [auth.PUBLIC]:
            headers = Headers(scope=scope)
            token = auth.bearer_token(headers.get("authorization"))
            token = token or auth.api_key_token(headers.get("x-api-key"))
            path = getattr(route, "path", scope.get("path", ""))
            try:
                who = self.identify(token, declared, f"{scope['method']} {path}")
            except auth.AuthError as error:
                if self.on_refuse is not None:
                    self.on_refuse(error.status)
                await _refuse(send, error, declared_errors(route))
                return
        scope.setdefault("state", {})[IDENTITY] = who
        auth.CALLER.set(who)
        await self.app(scope, receive, send)


async def _refuse(send: Send, error: auth.AuthError, errors: str | None) -> None:
    body = json.dumps(refusal(error, errors)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
