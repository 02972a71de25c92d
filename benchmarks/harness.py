"""Shared plumbing of the `treadle bench` workloads: a server process next to the client,
and identity (de)serializers for the raw-bytes baselines."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator

import grpc


def identity(data: bytes) -> bytes:
    return data


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server_process(module: str, *args: str) -> Iterator[subprocess.Popen]:
    """`python -m module args...`, once it printed `ready`; terminated on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", (
            f"{module} did not start"
        )
        yield proc
    finally:
        proc.terminate()
        proc.wait()


async def serve(server: grpc.aio.Server, port: int) -> None:
    """Listen on 127.0.0.1:port, say `ready`, serve until terminated."""
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()
