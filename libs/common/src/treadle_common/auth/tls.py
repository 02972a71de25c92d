"""Optional TLS on every transport: HTTP and gRPC servers, and the clients of both, NATS and
Redis.

A server serves TLS when it is given a certificate and key (`TREADLE_TLS_CERT_FILE`,
`TREADLE_TLS_KEY_FILE`): HTTPS on its HTTP port and TLS on its gRPC port, nothing in clear.
A client trusts the CA bundle `TREADLE_TLS_CA_FILE`: with it set, every Treadle gRPC channel
and HTTP client of the process verifies its peers against that CA, and NATS URLs
`tls://...` use it too. Redis takes TLS by its URL alone:
`rediss://:PASSWORD@host:6380?ssl_ca_certs=/path/ca.pem` (redis-py).

Like the bearer token (`auth.token_from_env`), trust is read from the environment, so a
client built anywhere in a process (a service's peers, the CLI, benches) gets it.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

CA_ENV = "TREADLE_TLS_CA_FILE"


def ca_file() -> Path | None:
    """The CA bundle this process's clients trust (`TREADLE_TLS_CA_FILE`), if TLS is on."""
    value = os.environ.get(CA_ENV)
    return Path(value) if value else None


def client_context() -> ssl.SSLContext | None:
    """An SSL context that verifies peers against `TREADLE_TLS_CA_FILE`, or None (clear)."""
    path = ca_file()
    return ssl.create_default_context(cafile=str(path)) if path else None


def httpx_verify() -> ssl.SSLContext | bool:
    """httpx's `verify=`: the CA's context, else the system's trust store."""
    return client_context() or True


def channel_credentials() -> grpc.ChannelCredentials | None:
    """gRPC credentials that verify the server against the CA, or None (a clear channel)."""
    path = ca_file()
    return grpc.ssl_channel_credentials(root_certificates=path.read_bytes()) if path else None


def http_scheme() -> str:
    """`https` when this process's clients speak TLS, else `http`."""
    return "https" if ca_file() else "http"


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key (PEM files)."""

    cert_file: Path
    key_file: Path

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_file.read_bytes(), self.cert_file.read_bytes())]
        )


def server_tls(cert_file: Path | None, key_file: Path | None) -> ServerTls | None:
    """The server's TLS from its settings: both files, or neither (clear)."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("TLS needs both TREADLE_TLS_CERT_FILE and TREADLE_TLS_KEY_FILE")
    if cert_file is None or key_file is None:
        return None
    for path in (cert_file, key_file):
        if not path.is_file():
            raise ValueError(f"TLS file {path} does not exist")
    return ServerTls(cert_file, key_file)
