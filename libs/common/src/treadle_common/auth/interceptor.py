"""Bearer tokens over gRPC: the server interceptor that checks every call against the service's
`auth.GrpcPolicy`, and the client interceptors that put a token into every call's metadata.

    server = grpc.aio.server(interceptors=[ServerAuth(authorizer, policy)])
    channel = secure_or_insecure_channel(address, token)   # clients.grpc_options.channel

The health service (`grpc.health.v1`) stays open: probes carry no token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from treadle_common.auth import policy as auth
from treadle_common.auth.policy import CALLER, AuthError, Authorizer, GrpcPolicy, bearer_token

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_CODES = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED}


def _refusing(handler: grpc.RpcMethodHandler, error: AuthError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `error`."""
    code = _CODES[error.status]

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, error.message)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


class ServerAuth(grpc.aio.ServerInterceptor):
    """Every call needs a token whose role its method's policy allows (fail closed)."""

    def __init__(self, service: str, authorizer: Authorizer, policy: GrpcPolicy):
        self.service = service
        self.authorizer = authorizer
        self.policy = policy

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        handler = await continuation(details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        metadata = dict(details.invocation_metadata or ())
        try:
            token = bearer_token(metadata.get("authorization"))
            who = self.authorizer.identify(token, self.policy.get(method), method)
        except AuthError as error:
            auth.REFUSED.labels(self.service, "grpc", str(error.status)).inc()
            return _refusing(handler, error)
        # the handler runs in this call's task, after this: `auth.caller()` answers `who`
        CALLER.set(who)
        return handler


class _Bearer:
    def __init__(self, token: str):
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self.metadata)
        return details._replace(metadata=metadata)  # type: ignore[attr-defined]


class _UnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[override]
        return await continuation(self._with_token(details), request)


class _UnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[override]
        return await continuation(self._with_token(details), request)


class _StreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[override]
        return await continuation(self._with_token(details), requests)


class _StreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[override]
        return await continuation(self._with_token(details), requests)


def client_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that present `token` on every kind of call (none without a token)."""
    if not token:
        return []
    return [_UnaryUnary(token), _UnaryStream(token), _StreamUnary(token), _StreamStream(token)]
