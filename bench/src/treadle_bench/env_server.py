"""Server side of `treadle bench env`: the real EnvGateway servicer plus a plain gRPC echo
(`treadle.bench.Echo/Call`) in one process.

    python -m treadle_bench.env_server PORT
"""

from __future__ import annotations

import asyncio
import sys

import grpc

from treadle_bench.harness import identity
from treadle_bench.harness import serve as serve_forever
from treadle_common.proto.treadle.v1 import env_pb2_grpc
from treadle_common.runtime.logs import configure_logging
from treadle_env_gateway.public import EnvGatewayServicer, SessionManager


async def echo(request: bytes, context) -> bytes:
    return request


async def serve(port: int) -> None:
    configure_logging("bench-env-server", level="WARNING")
    server = grpc.aio.server()
    sessions = SessionManager(replica="bench", max_sessions=100_000)
    env_pb2_grpc.add_EnvGatewayServicer_to_server(EnvGatewayServicer(sessions), server)
    handler = grpc.method_handlers_generic_handler(
        "treadle.bench.Echo",
        {"Call": grpc.unary_unary_rpc_method_handler(echo, identity, identity)},
    )
    server.add_generic_rpc_handlers((handler,))
    await serve_forever(server, port)


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
