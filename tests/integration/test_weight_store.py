"""The weight-store service as a real process: gRPC publish/fetch, NATS announce, HTTP."""

import asyncio

import grpc
import httpx
import nats
import pytest
import torch

from treadle_common.clients.torch_weights import ChunkCache, apply_fetch, state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient, watch
from treadle_common.proto.treadle.v1 import weights_pb2 as pb

pytestmark = pytest.mark.integration


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.0": torch.randn(300_000, generator=g), "layer.1": torch.randn(1000, generator=g)}


async def test_publish_fetch_delta_and_announce(service, infra):
    ws = service("weight-store")
    client = WeightStoreClient(ws.grpc_addr)
    nc = await nats.connect(infra.nats_url)
    announced: list[int] = []

    async def on_announce(a: pb.WeightAnnouncement) -> None:
        announced.append(a.version)

    v1_state = state(0)
    first = await client.publish("m", state_dict_to_raw(v1_state), trainer_step=1)
    assert first.version == 1 and first.bytes_received == 1_204_000
    v2_state = {"layer.0": v1_state["layer.0"], "layer.1": v1_state["layer.1"] + 1}
    second = await client.publish("m", state_dict_to_raw(v2_state), trainer_step=2)
    assert second.version == 2 and second.bytes_received == 4000  # only the changed tensor travels

    # a late joiner learns the latest version from JetStream
    await watch(nc.jetstream(), "m", on_announce)
    for _ in range(50):
        if announced:
            break
        await asyncio.sleep(0.05)
    assert announced == [2]

    # a replica holding v1 fetches only what changed, in place
    replica = {k: v.clone() for k, v in v1_state.items()}
    cache = ChunkCache.from_state_dict(replica)
    fetched = await client.fetch("m", -1, have=cache.have())
    assert fetched.manifest.version == 2 and fetched.bytes_received == 4000
    apply_fetch(fetched, replica, cache)
    assert all(torch.equal(replica[k], v2_state[k]) for k in v2_state)

    listing = httpx.get(f"{ws.http}/v1/models/m/versions").json()["versions"]
    assert [int(v["version"]) for v in listing] == [1, 2]
    await nc.close()
    await client.close()


async def test_bad_input_gets_clear_status_and_service_stays_up(service, tmp_path):
    ws = service("weight-store", TREADLE_WEIGHT_STORE_DIR=str(tmp_path / "store"))
    client = WeightStoreClient(ws.grpc_addr)
    await client.publish("m", state_dict_to_raw(state(1)), version=5)
    with pytest.raises(grpc.aio.AioRpcError) as conflict:
        await client.publish("m", state_dict_to_raw(state(2)), version=5)
    assert conflict.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.aio.AioRpcError) as bad_name:
        await client.publish("../etc", state_dict_to_raw(state(1)))
    assert (
        bad_name.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "invalid model name" in bad_name.value.details()
    )
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await client.get_manifest("m", 99)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    async def lying_chunk():
        yield pb.PublishRequest(chunk=pb.Chunk(hash="0" * 32, data=b"not that"))

    with pytest.raises(grpc.aio.AioRpcError) as lie:
        await client.stub.Publish(lying_chunk())
    assert (
        lie.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "content hash" in lie.value.details()
    )

    # a chunk corrupted on disk is an error, never served
    manifest = await client.get_manifest("m", 5)
    victim = manifest.tensors[0].chunks[0].hash
    path = tmp_path / "store" / "chunks" / victim[:2] / victim
    path.write_bytes(b"x" + path.read_bytes()[1:])
    with pytest.raises(grpc.aio.AioRpcError) as corrupt:
        await client.fetch("m", 5)
    assert corrupt.value.code() == grpc.StatusCode.DATA_LOSS
    assert httpx.get(f"{ws.http}/readyz").status_code == 200
    assert httpx.get(f"{ws.http}/v1/models/nope/versions").json()["versions"] == []
    assert httpx.get(f"{ws.http}/v1/models/m/versions/77").status_code == 404
    await client.close()
