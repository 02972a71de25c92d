"""The weight-store service as a real process, on both backends (local disk and S3)."""

import asyncio
import os
import signal

import grpc
import httpx
import nats
import pytest
import torch
from minio import Minio

from tests.support.services import api_get
from treadle_common.clients import weights as weights_client
from treadle_common.clients.torch_weights import (
    ChunkCache,
    TorchWeightClient,
    byte_view,
    fetch_into,
    state_dict_to_raw,
)
from treadle_common.clients.weights import (
    WeightStoreClient,
    build_manifest,
    chunk_hash,
    hash_pieces,
    layout_manifest,
    watch,
)
from treadle_common.proto.treadle.v1 import weights_pb2 as pb

pytestmark = pytest.mark.integration
MB = 2**20


def state(seed: int, numel: int = 300_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.0": torch.randn(numel, generator=g), "layer.1": torch.randn(1000, generator=g)}


def code_of(excinfo) -> grpc.StatusCode:
    return excinfo.value.code()


async def test_publish_fetch_delta_and_announce_to_a_late_subscriber(
    service, infra, weight_store_env
):
    ws = service("weight-store", **weight_store_env)
    client = WeightStoreClient(ws.grpc_addr)
    v1_state = state(0)
    first = await client.publish("m", state_dict_to_raw(v1_state), trainer_step=1)
    assert first.version == 1 and first.bytes_received == 1_204_000
    v2_state = {"layer.0": v1_state["layer.0"], "layer.1": v1_state["layer.1"] + 1}
    second = await client.publish(
        "m", state_dict_to_raw(v2_state), trainer_step=2, parent_version=1
    )
    assert second.version == 2 and second.bytes_received == 4000  # only the changed tensor travels

    # a version is announced once it is durable; then a replica that starts late learns the
    # latest version from JetStream
    for _ in range(200):
        if all(v.durable for v in await client.list_versions("m")):
            break
        await asyncio.sleep(0.05)
    nc = await nats.connect(infra.nats_url)
    announced: list[int] = []

    async def on_announce(a: pb.WeightAnnouncement) -> None:
        announced.append(a.version)

    await watch(nc.jetstream(), "m", on_announce)
    for _ in range(100):
        if announced:
            break
        await asyncio.sleep(0.05)
    assert announced == [2]
    # the torch client's watch: the latest version first, then each new one
    watcher = TorchWeightClient(ws.grpc_addr).watch(nc, "m")
    assert (await asyncio.wait_for(anext(watcher), 10)).version == 2
    await client.publish("m", state_dict_to_raw(state(5)))
    assert (await asyncio.wait_for(anext(watcher), 10)).version == 3
    await watcher.aclose()
    await nc.close()

    # a replica holding v1 fetches only what changed, in place
    torch_client = TorchWeightClient(ws.grpc_addr)
    replica = {k: v.clone() for k, v in v1_state.items()}
    storage = replica["layer.0"].data_ptr()
    cache = ChunkCache.from_state_dict(replica)
    manifest, received = await fetch_into(torch_client.store, "m", 2, replica, cache)
    assert manifest.version == 2 and received == 4000
    assert all(torch.equal(replica[k], v2_state[k]) for k in v2_state)
    assert replica["layer.0"].data_ptr() == storage
    assert await torch_client.latest("m") == 3
    assert await torch_client.latest("unknown-model") is None

    listing = api_get(f"{ws.http}/v1/models/m/versions").json()["versions"]
    assert [(int(v["version"]), int(v["parent_version"])) for v in listing] == [
        (1, -1),
        (2, 1),
        (3, -1),
    ]
    assert api_get(f"{ws.http}/v1/models").json() == {"models": ["m"]}
    assert api_get(f"{ws.http}/v1/models/m/versions/7").status_code == 404
    assert "'m' has no version 7" in api_get(f"{ws.http}/v1/models/m/versions/7").text
    await torch_client.close()
    await client.close()


async def test_a_waiting_reader_gets_a_version_as_soon_as_it_commits(service, weight_store_env):
    """`WaitForVersion`: a reader that needs a version the store does not have yet waits in
    the store and is answered by that version's commit, durable or not; a wait that runs out
    answers with the latest; bad input is INVALID_ARGUMENT."""
    ws = service("weight-store", **weight_store_env)
    client = WeightStoreClient(ws.grpc_addr)
    assert await client.wait_for_version("w", 1, timeout_s=0.2) is None  # nothing yet
    await client.publish("w", state_dict_to_raw(state(0)), trainer_step=1)
    assert await client.wait_for_version("w", 1, timeout_s=0) == 1  # held: at once
    waiting = asyncio.create_task(client.wait_for_version("w", 2, timeout_s=60))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # version 2 does not exist: the reader waits in the store
    await client.publish("w", state_dict_to_raw(state(1)), trainer_step=2)
    # answered by the commit, long before its 60 s (the test's own 30 s bound is only there
    # so that a broken wait fails instead of hanging)
    assert await asyncio.wait_for(waiting, 30) == 2
    fetched = await client.fetch("w", 2)  # and served at once
    assert fetched.manifest.version == 2
    assert await client.wait_for_version("w", 9, timeout_s=0.2) == 2  # ran out: the latest
    for bad, message in [
        (pb.WaitForVersionRequest(model="../x", version=1), "invalid model name"),
        (pb.WaitForVersionRequest(model="w", version=1, timeout_s=-1), "timeout_s"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.stub.WaitForVersion(bad)
        assert code_of(refused) == grpc.StatusCode.INVALID_ARGUMENT
        assert message in refused.value.details()
    await client.close()


async def test_pipelined_publish_over_many_batches(service, weight_store_env, monkeypatch):
    """One chunk per MissingChunks batch, more batches than the lookahead: batches are hashed
    and asked about ahead while earlier ones stream; a chunk repeated in a later batch
    travels once; a republish with one tensor changed sends only its chunk."""
    monkeypatch.setattr(weights_client, "PUBLISH_BATCH_BYTES", 1)
    ws = service("weight-store", **weight_store_env)
    client = TorchWeightClient(ws.grpc_addr)
    same = torch.randn(2 * MB // 4)
    tensors = {"a": torch.randn(3 * MB), "b": same, "c": same.clone(), "d": torch.randn(10)}
    first = await client.store.publish("m", state_dict_to_raw(tensors))
    unique = 12 * MB + 2 * MB + 40  # "c" is "b"'s bytes: not sent again
    assert first.bytes_received == unique and first.num_chunks_received == 3 + 1 + 1
    replica = {k: torch.zeros_like(v) for k, v in tensors.items()}
    await client.fetch("m", first.version, into=replica)
    assert all(torch.equal(replica[k], tensors[k]) for k in tensors)
    tensors["d"] += 1
    second = await client.store.publish("m", state_dict_to_raw(tensors))
    assert second.bytes_received == 40 and second.num_chunks_received == 1
    await client.fetch("m", second.version, into=replica)
    assert torch.equal(replica["d"], tensors["d"])
    await client.close()


async def test_concurrent_publishers_of_one_version_one_wins(service, weight_store_env):
    ws = service("weight-store", **weight_store_env)
    client = WeightStoreClient(ws.grpc_addr)
    results = await asyncio.gather(
        *(
            client.publish("m", state_dict_to_raw(state(seed, 1000)), version=3)
            for seed in range(4)
        ),
        return_exceptions=True,
    )
    winners = [r for r in results if isinstance(r, pb.PublishResponse)]
    losers = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(winners) == 1 and len(losers) == 3
    assert all(e.code() == grpc.StatusCode.ALREADY_EXISTS for e in losers)
    winner_seed = results.index(winners[0])
    stored = await client.fetch("m", 3)
    expected, _ = build_manifest("m", state_dict_to_raw(state(winner_seed, 1000)))
    assert [c.hash for t in stored.manifest.tensors for c in t.chunks] == [
        c.hash for t in expected.tensors for c in t.chunks
    ]
    await client.close()


async def test_interrupted_publish_leaves_nothing_visible_and_resumes(service, weight_store_env):
    ws = service("weight-store", **weight_store_env)
    client = WeightStoreClient(ws.grpc_addr)
    big = {"w": torch.randn(3 * MB)}  # 12 MiB -> 3 chunks
    pending = layout_manifest("m", state_dict_to_raw(big))
    hash_pieces(pending.pieces)
    chunks = pending.chunks()
    first_chunk = pending.manifest.tensors[0].chunks[0].hash
    gate = asyncio.Event()

    async def broken():
        yield pb.PublishRequest(chunk=pb.Chunk(hash=first_chunk, data=bytes(chunks[first_chunk])))
        gate.set()
        await asyncio.sleep(3600)  # the trainer dies here, before the manifest

    call = client.stub.Publish(broken())
    await gate.wait()
    await asyncio.sleep(0.3)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await client.list_versions("m") == []
    for _ in range(100):  # the chunk that arrived whole is kept (its write may still be landing)
        missing = await client.stub.MissingChunks(pb.MissingChunksRequest(hashes=list(chunks)))
        if first_chunk not in missing.missing:
            break
        await asyncio.sleep(0.05)
    assert first_chunk not in missing.missing and len(missing.missing) == 2  # resume sends the rest
    done = await client.publish_pending(pending)
    assert done.version == 1 and done.num_chunks_received == 2
    await client.close()


async def test_bad_input_gets_clear_status_and_service_stays_up(service, weight_store_env):
    ws = service("weight-store", **weight_store_env)
    client = WeightStoreClient(ws.grpc_addr)
    with pytest.raises(grpc.aio.AioRpcError) as bad_name:
        await client.publish("../etc", state_dict_to_raw(state(1, 10)))
    assert (
        code_of(bad_name) == grpc.StatusCode.INVALID_ARGUMENT
        and "invalid model name" in bad_name.value.details()
    )
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await client.get_manifest("nope", 1)
    assert code_of(missing) == grpc.StatusCode.NOT_FOUND and "'nope'" in missing.value.details()

    async def lying_chunk():
        yield pb.PublishRequest(chunk=pb.Chunk(hash="0" * 32, data=b"not that"))

    with pytest.raises(grpc.aio.AioRpcError) as lie:
        await client.stub.Publish(lying_chunk())
    assert (
        code_of(lie) == grpc.StatusCode.INVALID_ARGUMENT and "content hash" in lie.value.details()
    )

    oversize = bytes(17 * MB)

    async def too_big():
        yield pb.PublishRequest(chunk=pb.Chunk(hash=chunk_hash(oversize), data=oversize))

    with pytest.raises(grpc.aio.AioRpcError) as big:
        await client.stub.Publish(too_big())
    assert (
        code_of(big) == grpc.StatusCode.INVALID_ARGUMENT and "the limit is" in big.value.details()
    )

    async def no_manifest():
        yield pb.PublishRequest(chunk=pb.Chunk(hash=chunk_hash(b"abc"), data=b"abc"))

    with pytest.raises(grpc.aio.AioRpcError) as unfinished:
        await client.stub.Publish(no_manifest())
    assert "nothing was committed" in unfinished.value.details()

    dangling = pb.WeightManifest(model="m", version=-1)
    dangling.tensors.add(name="w", dtype="F32", shape=[1]).chunks.add(hash="1" * 32, size=4)

    async def manifest_only():
        yield pb.PublishRequest(manifest=dangling)

    with pytest.raises(grpc.aio.AioRpcError) as lacks:
        await client.stub.Publish(manifest_only())
    assert code_of(lacks) == grpc.StatusCode.ABORTED and "lacks" in lacks.value.details()
    assert await client.list_versions("m") == []

    # fetching into a target of the wrong dtype or shape is a clear error, before any write
    await client.publish("m", state_dict_to_raw(state(1, 10)))
    torch_client = TorchWeightClient(ws.grpc_addr)
    wrong_dtype = {"layer.0": torch.zeros(10, dtype=torch.float16), "layer.1": torch.zeros(1000)}
    with pytest.raises(ValueError, match=r"'layer.0' is F32\[10\], the target is F16\[10\]"):
        await torch_client.fetch("m", 1, into=wrong_dtype)
    wrong_shape = {"layer.0": torch.zeros(11), "layer.1": torch.zeros(1000)}
    with pytest.raises(ValueError, match=r"the target is F32\[11\]"):
        await torch_client.fetch("m", 1, into=wrong_shape)
    assert httpx.get(f"{ws.http}/readyz").status_code == 200
    await torch_client.close()
    await client.close()


def corrupt(env: dict, tmp_root, digest: str) -> None:
    if env["TREADLE_WEIGHT_STORE_BACKEND"] == "local":
        path = tmp_root / "chunks" / digest[:2] / digest
        path.write_bytes(b"x" + path.read_bytes()[1:])
        return
    import io

    from tests.support.services import S3Server

    s3 = S3Server(env["TREADLE_S3_ENDPOINT"])
    client = Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key, secure=False)
    client.put_object(
        env["TREADLE_WEIGHT_STORE_BUCKET"], f"chunks/{digest[:2]}/{digest}", io.BytesIO(b"bad"), 3
    )


async def test_corrupted_chunk_is_an_error_never_served(service, weight_store_env, tmp_path):
    ws = service("weight-store", TREADLE_WEIGHT_STORE_CACHE_MB="0", **weight_store_env)
    client = WeightStoreClient(ws.grpc_addr, attempts=1)
    await client.publish("m", state_dict_to_raw(state(1, 1000)), durable=True)  # on disk/S3
    assert (await client.list_versions("m"))[0].durable
    manifest = await client.get_manifest("m", 1)
    corrupt(weight_store_env, tmp_path / "store", manifest.tensors[0].chunks[0].hash)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.fetch("m", 1)
    assert code_of(err) == grpc.StatusCode.DATA_LOSS and "corrupted" in err.value.details()
    await client.close()


async def test_retention_pins_and_gc_while_a_reader_is_active(service, weight_store_env):
    ws = service(
        "weight-store",
        TREADLE_WEIGHT_STORE_KEEP_LAST="2",
        TREADLE_WEIGHT_STORE_GC_GRACE_S="0",
        TREADLE_WEIGHT_STORE_CACHE_MB="0",
        **weight_store_env,
    )
    client = WeightStoreClient(ws.grpc_addr)
    states = {v: state(v, 16 * MB) for v in range(1, 6)}  # 64 MiB + 4 KB each: 17 chunks
    await client.publish("m", state_dict_to_raw(states[1]))
    await client.set_pin("m", 1)
    await client.publish("m", state_dict_to_raw(states[2]))

    # a slow reader holds version 2 while newer versions push it out of the retention window
    stream = client.stub.Fetch(pb.FetchRequest(model="m", version=2))
    items = [await anext(aiter(stream)), await anext(aiter(stream))]
    # 64 MiB exceed gRPC's flow-control window: the server is still streaming, holding a lease
    assert api_get(f"{ws.http}/v1/info").json()["readers"] == {"m@2": 1}
    for v in (3, 4, 5):  # durable: written now, not in a gap the open reader never leaves
        await client.publish("m", state_dict_to_raw(states[v]), durable=True)
    # retention follows the publishes (in the background): 3 goes; 2 is leased, 1 pinned,
    # 4-5 are the newest two
    for _ in range(100):
        if [v.version for v in await client.list_versions("m")] == [1, 2, 4, 5]:
            break
        await asyncio.sleep(0.1)
    assert [v.version for v in await client.list_versions("m")] == [1, 2, 4, 5]
    # and GC followed it: version 3's chunks are freed, version 2's (being read) are not
    v2_hashes, v3_hashes = (
        list(build_manifest("m", state_dict_to_raw(states[v]))[1]) for v in (2, 3)
    )
    for _ in range(100):
        gone = await client.stub.MissingChunks(
            pb.MissingChunksRequest(hashes=v3_hashes, probe=True)
        )
        if len(gone.missing) == 17:
            break
        await asyncio.sleep(0.1)
    assert len(gone.missing) == 17
    assert not (
        await client.stub.MissingChunks(pb.MissingChunksRequest(hashes=v2_hashes, probe=True))
    ).missing
    gc = await client.garbage_collect()
    assert list(gc.versions_deleted) == [] and gc.chunks_deleted == 0
    items += [item async for item in stream]
    data = b"".join(item.chunk.data for item in items[1:])
    assert data == b"".join(bytes(t.numpy().tobytes()) for t in states[2].values())

    gc = await client.garbage_collect()  # the reader is gone: now 2 goes, with its chunks
    assert [r.version for r in gc.versions_deleted] == [2] and gc.chunks_deleted == 17
    assert [v.version for v in await client.list_versions("m")] == [1, 4, 5]
    with pytest.raises(grpc.aio.AioRpcError) as pinned:
        await client.delete_version("m", 1)
    assert code_of(pinned) == grpc.StatusCode.FAILED_PRECONDITION
    await client.set_pin("m", 1, pinned=False)
    assert await client.delete_version("m", 1) == 17
    assert [v.version for v in await client.list_versions("m")] == [4, 5]
    fetched = await client.fetch("m", 4)  # survivors are intact
    assert b"".join(fetched.chunks[c.hash] for c in fetched.manifest.tensors[0].chunks) == bytes(
        states[4]["layer.0"].numpy().tobytes()
    )
    await client.close()


def _cache_counts(http: str) -> dict[str, float]:
    counts = {}
    for line in api_get(f"{http}/metrics").text.splitlines():
        if line.startswith("treadle_weight_cache_total{"):
            counts[line.split('result="')[1].split('"')[0]] = float(line.split()[-1])
    return counts


async def test_fanout_reads_each_chunk_once_from_the_backend(service, weight_store_env):
    ws = service("weight-store", **weight_store_env)
    client = WeightStoreClient(ws.grpc_addr)
    await client.publish("m", state_dict_to_raw({"w": torch.randn(4 * MB)}))  # 4 chunks
    await client.close()
    ws.stop()  # a fresh process: the cache is cold
    ws = service("weight-store", **weight_store_env)
    clients = [WeightStoreClient(ws.grpc_addr) for _ in range(8)]
    results = await asyncio.gather(*(c.fetch("m", 1) for c in clients))
    assert all(r.bytes_received == 16 * MB for r in results)
    counts = _cache_counts(ws.http)
    assert counts["miss"] == 4  # one backend read per chunk, shared by 8 fetchers
    assert counts.get("hit", 0) + counts.get("shared", 0) == 28
    for c in clients:
        await c.close()


async def test_version_numbers_are_never_reused_after_a_crash(service, weight_store_env):
    """Numbers come from a durable reservation: after a SIGKILL, the next auto-numbered
    version is past every number the dead store may have handed out (here the latest,
    deleted before the crash, as a version lost with it would be); after a clean shutdown
    the numbering goes on exactly."""
    ws = service("weight-store", **weight_store_env)
    ports = {"TREADLE_HTTP_PORT": ws.http.rsplit(":", 1)[1]}
    ports["TREADLE_GRPC_PORT"] = (ws.grpc_addr or "").rsplit(":", 1)[1]
    client = WeightStoreClient(ws.grpc_addr)
    for seed in range(3):
        await client.publish("m", state_dict_to_raw(state(seed)))
    await client.delete_version("m", 3)
    assert [v.version for v in await client.list_versions("m")] == [1, 2]
    await client.close()
    os.killpg(ws.proc.pid, signal.SIGKILL)
    assert ws.proc.wait(timeout=10) == -signal.SIGKILL

    ws = service("weight-store", **weight_store_env, **ports)
    client = WeightStoreClient(ws.grpc_addr)
    after_crash = await client.publish("m", state_dict_to_raw(state(7)))
    assert after_crash.version > 3  # not 3 again: a replica may have held the old 3
    await client.close()
    assert ws.stop() == 0  # SIGTERM: the exact next number is written back

    ws = service("weight-store", **weight_store_env, **ports)
    client = WeightStoreClient(ws.grpc_addr)
    after_restart = await client.publish("m", state_dict_to_raw(state(8)))
    assert after_restart.version == after_crash.version + 1
    await client.close()


async def test_a_fetch_survives_the_store_killed_mid_stream_on_the_version_it_resolved(
    service, weight_store_env
):
    """The store is SIGKILLed after the first chunk of a fetch of `latest` (v1) and comes back
    while a newer v2 is published: the fetch resumes (only the chunks it lacks) and completes
    byte-exact on v1, not on the newer latest."""
    ws = service("weight-store", **weight_store_env)
    ports = {"TREADLE_HTTP_PORT": ws.http.rsplit(":", 1)[1]}
    ports["TREADLE_GRPC_PORT"] = (ws.grpc_addr or "").rsplit(":", 1)[1]
    weights = {"w": torch.randn(6 * MB)}  # 6 chunks of 4 MB
    client = WeightStoreClient(ws.grpc_addr)
    await client.publish("m", state_dict_to_raw(weights))
    for _ in range(200):  # on disk before the kill (a version not yet durable would be lost)
        if all(v.durable for v in await client.list_versions("m")):
            break
        await asyncio.sleep(0.05)
    stream = client.fetch_stream("m")  # latest
    manifest = await anext(stream)
    first = await anext(stream)
    chunks = {first.hash: bytes(first.data)}
    os.killpg(ws.proc.pid, signal.SIGKILL)
    ws.proc.wait(timeout=10)
    ws = service("weight-store", **weight_store_env, **ports)
    other = WeightStoreClient(ws.grpc_addr)
    newer = await other.publish("m", state_dict_to_raw({"w": torch.zeros(6 * MB)}))
    assert newer.version > 1  # the latest now
    await other.close()
    async for chunk in stream:  # the broken stream is resumed with what it has
        chunks[chunk.hash] = bytes(chunk.data)
    await client.close()
    assert manifest.version == 1
    payload = b"".join(chunks[c.hash] for c in manifest.tensors[0].chunks)
    assert payload == byte_view(weights["w"]).tobytes()
