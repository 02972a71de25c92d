"""gRPC channel and server options every Treadle client and server shares.

Keepalive: a client pings an idle connection every `KEEPALIVE_S` and gives it up when no
answer comes within `KEEPALIVE_TIMEOUT_S`, so a call to a peer that died without closing its
socket (SIGKILL behind a NAT, a node gone) fails as UNAVAILABLE instead of hanging; servers
accept those pings. Unary calls carry a deadline (`UNARY_DEADLINE_S` unless they say more);
streams of weights are bounded by keepalive (a dead peer), not by a deadline (a large model
legitimately takes long).
"""

from __future__ import annotations

import grpc

from treadle_common.auth import policy as auth
from treadle_common.auth import tls
from treadle_common.auth.interceptor import client_interceptors

MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE_S = 20
KEEPALIVE_TIMEOUT_S = 10
UNARY_DEADLINE_S = 30.0

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


def channel(address: str, token: str | None = None) -> grpc.aio.Channel:
    """A channel to a Treadle gRPC server that presents `token` on every call (default: the
    caller's `TREADLE_TOKEN` / `TREADLE_TOKEN_FILE`); over TLS when `TREADLE_TLS_CA_FILE` is
    set (`treadle_common.auth.tls`)."""
    token = token if token is not None else auth.token_from_env()
    credentials = tls.channel_credentials()
    if credentials is not None:  # TREADLE_TLS_CA_FILE: the server must prove itself
        return grpc.aio.secure_channel(
            address, credentials, options=CHANNEL_OPTIONS, interceptors=client_interceptors(token)
        )
    return grpc.aio.insecure_channel(
        address, options=CHANNEL_OPTIONS, interceptors=client_interceptors(token)
    )
