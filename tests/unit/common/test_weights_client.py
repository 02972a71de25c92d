"""The weight-store client against a real gRPC server that fails on purpose: an error in
the middle of a publish reaches the caller as itself (a retryable status), never as a bare
CancelledError that would end a run as "failed" with no reason."""

import asyncio

import grpc
import pytest

from treadle_common.clients.weights import RawTensor, WeightStoreClient
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.proto.treadle.v1 import weights_pb2_grpc

pytestmark = pytest.mark.unit


class StoreAway(weights_pb2_grpc.WeightStoreServicer):
    """Opens the publish stream, then answers MissingChunks with UNAVAILABLE (a store that
    went down between the two calls)."""

    def __init__(self):
        self.asked = 0

    async def MissingChunks(self, request, context):
        self.asked += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "store restarting")

    async def Publish(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        return pb.PublishResponse()


async def test_a_store_lost_mid_publish_raises_its_status_not_cancelled():
    server = grpc.aio.server()
    servicer = StoreAway()
    weights_pb2_grpc.add_WeightStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WeightStoreClient(f"127.0.0.1:{port}", attempts=2, retry_s=5.0, token="t")
    try:
        tensors = {"w": RawTensor("F32", (64,), memoryview(bytes(256)))}
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await asyncio.wait_for(client.publish("m", tensors), 30)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert servicer.asked == 2  # retried as the transient error it is
    finally:
        await client.close()
        await server.stop(None)
