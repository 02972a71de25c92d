"""The server side of `treadle bench weights`: one process hosting the real WeightStore gRPC
servicer and, for the baseline, a plain gRPC byte stream (`treadle.bench.Raw`).

    python -m treadle_bench.weights_server PORT DATA_DIR
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import grpc

from treadle_bench.harness import identity
from treadle_bench.harness import serve as serve_forever
from treadle_common.runtime.logs import configure_logging
from treadle_weight_store.public import (
    LocalBackend,
    WeightStore,
    WeightStoreServicer,
    add_to_server,
)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 2**20),
    ("grpc.max_receive_message_length", 64 * 2**20),
]
CHUNK = 4 * 2**20


async def upload(request_iterator, context) -> bytes:
    """Client streams raw chunks; the server counts them (publish's raw twin)."""
    total = 0
    async for data in request_iterator:
        total += len(data)
    return str(total).encode()


def download_handler(payload: bytes):
    async def download(request: bytes, context):
        """Server streams `int(request)` bytes in 4 MiB messages (fetch's raw twin)."""
        remaining = int(request)
        while remaining > 0:
            n = min(CHUNK, remaining)
            yield payload[:n]
            remaining -= n

    return download


async def serve(port: int, root: Path) -> None:
    configure_logging("bench-server", level="WARNING")
    server = grpc.aio.server(options=CHANNEL_OPTIONS)

    async def no_announce(_manifest) -> None:
        return None

    store = WeightStore(LocalBackend(root), keep_last=1000)  # service defaults otherwise
    add_to_server(WeightStoreServicer(store, no_announce), server)
    payload = os.urandom(CHUNK)
    raw = grpc.method_handlers_generic_handler(
        "treadle.bench.Raw",
        {
            "Upload": grpc.stream_unary_rpc_method_handler(upload, identity, identity),
            "Download": grpc.unary_stream_rpc_method_handler(
                download_handler(payload), identity, identity
            ),
        },
    )
    server.add_generic_rpc_handlers((raw,))
    await serve_forever(server, port)


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), Path(sys.argv[2])))
