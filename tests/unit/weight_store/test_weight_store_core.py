"""WeightStore core logic with a scripted failing backend (no server needed)."""

import asyncio
import errno
import fcntl
import os
import threading

import pytest
from prometheus_client import REGISTRY

from treadle_common.clients import chunk_codec as codec
from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.clients.weights import RawTensor, build_manifest, chunk_hash
from treadle_weight_store.backends.local import LocalBackend
from treadle_weight_store.cache import ChunkCache
from treadle_weight_store.errors import BackendError, Precondition
from treadle_weight_store.store import WeightStore

pytestmark = pytest.mark.unit


class GatedDisk(LocalBackend):
    """A local backend whose chunk writes wait for `gate`, then fail with a full disk once
    `budget` writes have succeeded."""

    def __init__(self, root, budget: int = 1_000_000):
        super().__init__(root)
        self.budget = budget
        self.gate = threading.Event()
        self.gate.set()

    def _stage_chunk(self, digest, data, sync):
        assert self.gate.wait(30)
        if self.budget == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget -= 1
        return super()._stage_chunk(digest, data, sync)


def two_tensors(value: float = 1.0):
    import torch

    return build_manifest(
        "m", state_dict_to_raw({"a": torch.full((10,), value), "b": torch.full((10,), -value)})
    )


async def hold(store: WeightStore, chunks) -> None:
    for digest, data in chunks.items():
        await store.put_chunk(digest, bytes(data))


def dropped(kind: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "treadle_dropped_total",
            {"service": "weight-store", "kind": kind, "reason": "backend_failed"},
        )
        or 0.0
    )


async def test_disk_full_is_an_error_and_no_version_appears(tmp_path):
    store = WeightStore(GatedDisk(tmp_path, budget=1), cache_bytes=0, write_attempts=2)
    manifest, chunks = two_tensors()
    await hold(store, chunks)  # held in memory at once; the second write finds the disk full
    with pytest.raises(BackendError, match="No space left on device"):
        await store.commit(manifest, durable=True)  # waits for the disk, which is full
    assert await store.versions("m") == []
    with pytest.raises(BackendError, match="No space left on device"):
        await store.commit(manifest)  # its chunk is lost: not kept in memory either
    with pytest.raises(BackendError, match="backend is failing.*No space left"):
        await store.commit(two_tensors(2.0)[0])  # nor anything else while the disk fails
    assert await store.versions("m") == []
    assert await WeightStore(LocalBackend(tmp_path)).versions("m") == []


async def test_written_behind_version_is_visible_at_once_and_durable_after(tmp_path):
    backend = GatedDisk(tmp_path)
    store = WeightStore(backend, cache_bytes=0)
    manifest, chunks = two_tensors()
    backend.gate.clear()  # the disk is slow: nothing reaches it yet
    await hold(store, chunks)
    committed = await store.commit(manifest)
    assert committed.version == 1 and await store.versions("m") == [1]
    assert not (await store.info("m", 1)).durable and store.dirty_bytes() > 0
    assert [codec.frame_payload(await store.get_frame(h)).hash for h in chunks] == list(chunks)
    assert await store.missing(list(chunks)) == []  # held chunks are not asked for again
    # a crash now loses version 1 whole: the backend has no manifest (nor half a version)
    assert await WeightStore(LocalBackend(tmp_path)).versions("m") == []
    backend.gate.set()
    await store.flush()
    assert (await store.info("m", 1)).durable and store.dirty_bytes() == 0
    restarted = WeightStore(LocalBackend(tmp_path))
    assert await restarted.versions("m") == [1]
    assert [codec.frame_payload(await restarted.get_frame(h)).hash for h in chunks] == list(chunks)


async def test_failed_write_behind_withdraws_the_version_and_counts_it(tmp_path):
    backend = GatedDisk(tmp_path, budget=1)
    store = WeightStore(backend, cache_bytes=0, write_attempts=1)
    manifest, chunks = two_tensors()
    before = dropped("version")
    backend.gate.clear()
    await hold(store, chunks)
    assert (await store.commit(manifest)).version == 1
    backend.gate.set()  # the second chunk's write fails: version 1 can never be durable
    await store.flush()
    assert await store.versions("m") == [] and dropped("version") == before + 1
    assert "No space left" in (store.persist_error or "")
    with pytest.raises(BackendError, match="backend is failing"):
        await store.commit(two_tensors(2.0)[0])
    backend.budget = 10  # space again: the next write succeeds and commits work again
    manifest, chunks = two_tensors(3.0)
    await hold(store, chunks)
    await store.wait_written(chunks)
    # not 1 again: version 1 was visible (a replica may hold it) before it was withdrawn
    assert (await store.commit(manifest, durable=True)).version == 2
    assert store.persist_error is None


async def test_received_bytes_wait_for_the_backend_past_the_dirty_limit(tmp_path):
    import asyncio

    backend = GatedDisk(tmp_path)
    store = WeightStore(backend, cache_bytes=0, max_dirty_bytes=1)
    _, chunks = two_tensors()
    backend.gate.clear()
    (first, a), (second, b) = chunks.items()
    await store.put_chunk(first, bytes(a))  # one chunk is always let in
    blocked = asyncio.create_task(store.put_chunk(second, bytes(b)))
    await asyncio.sleep(0.2)
    assert not blocked.done() and store.dirty_bytes() > 0
    backend.gate.set()
    await asyncio.wait_for(blocked, 10)
    await store.flush()
    assert store.dirty_bytes() == 0 and await store.missing(list(chunks)) == []


async def test_cache_evicts_by_bytes_and_shares_concurrent_loads():
    import asyncio

    cache = ChunkCache(max_bytes=10)
    cache.put("a", b"12345")
    cache.put("b", b"12345")
    cache.put("c", b"123")  # evicts a (least recently used)
    assert cache.num_bytes == 8
    loads = 0

    async def load() -> bytes:
        nonlocal loads
        loads += 1
        await asyncio.sleep(0.01)
        return b"xy"

    results = await asyncio.gather(*(cache.get("d", load) for _ in range(5)))
    assert results == [b"xy"] * 5 and loads == 1
    assert await cache.get("b", load) == b"12345" and loads == 1


def test_chunk_codec_matches_protobuf_both_ways():
    import os

    from treadle_common.clients import chunk_codec as codec
    from treadle_common.proto.treadle.v1 import weights_pb2 as pb

    data, digest = os.urandom(300_000), "ab" * 16
    publish = pb.PublishRequest()
    publish.chunk.hash, publish.chunk.data = digest, data
    fetch = pb.FetchResponse()
    fetch.chunk.hash, fetch.chunk.data = digest, data
    encoded = codec.serialize_publish_request(codec.ChunkView(digest, memoryview(data)))
    assert encoded == publish.SerializeToString() == fetch.SerializeToString()
    view = codec.deserialize_fetch_response(encoded)
    assert view.hash == digest and bytes(view.data) == data and view.frame is encoded
    manifest = pb.FetchResponse(manifest=pb.WeightManifest(model="m", version=3))
    assert codec.deserialize_fetch_response(manifest.SerializeToString()) == manifest
    assert codec.frame_payload(b"\x0a\xff") is None  # truncated: malformed, not a crash


@pytest.mark.parametrize("mode", ["direct", "refused"])
def test_local_backend_writes_unaligned_chunks_exactly(tmp_path, monkeypatch, mode):
    """Large chunks go through O_DIRECT (aligned bulk + buffered tail); a filesystem that
    refuses O_DIRECT (EINVAL) gets ordinary writes instead. The bytes are identical."""
    backend = LocalBackend(tmp_path)
    if mode == "refused":
        real_fcntl = fcntl.fcntl

        def no_direct(fd, cmd, arg=0):
            if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
                raise OSError(errno.EINVAL, "O_DIRECT not supported")
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(fcntl, "fcntl", no_direct)
    header, payload = b"frame-header", os.urandom(3 * 2**20 + 4097)
    backend.put_chunk("a" * 32, (header, memoryview(payload)))
    backend.put_chunk("b" * 32, (b"small",))
    assert backend.get_chunk("a" * 32) == header + payload
    assert backend.get_chunk("b" * 32) == b"small"
    assert sorted(size for _, _, size in backend.list_chunks()) == [5, len(header) + len(payload)]
    assert backend.direct.supported == (mode == "direct")


async def test_a_received_chunk_is_hot_at_once_and_evicts_the_oldest(tmp_path):
    backend = GatedDisk(tmp_path, budget=0)
    backend.gate.clear()  # nothing reaches the disk until the end
    first, second = two_tensors(1.0)[1], two_tensors(2.0)[1]
    frame = len(codec.frame_header("0" * 32, 40)) + 40  # a tensor of 10 floats is one chunk
    store = WeightStore(backend, cache_bytes=2 * frame, write_attempts=1)
    await hold(store, first)
    assert all(digest in store.cache for digest in first)  # cached before it is written
    await hold(store, second)  # a new version makes room by evicting the oldest frames
    assert all(d in store.cache for d in second) and not any(d in store.cache for d in first)
    assert store.cache.num_bytes == 2 * frame and store.dirty_bytes() == 4 * frame
    backend.gate.set()  # and then the disk is full
    await store.flush()
    assert store.dirty_bytes() == 0
    assert not any(d in store.cache for d in second)  # chunks the store lost are not served


async def test_writes_wait_for_a_gap_between_streams_or_their_deadline(tmp_path):
    import asyncio

    store = WeightStore(LocalBackend(tmp_path), cache_bytes=0, max_write_delay_s=60)
    manifest, chunks = two_tensors()
    async with store.publishing():  # a publish (or a fetch) is streaming: the disk waits
        await hold(store, chunks)
        await asyncio.sleep(0.3)
        assert store.dirty_bytes() > 0 and not any(LocalBackend(tmp_path).list_chunks())
    await store.flush()  # the stream ended: written now
    assert len(list(LocalBackend(tmp_path).list_chunks())) == 2

    store = WeightStore(LocalBackend(tmp_path / "b"), cache_bytes=0, max_write_delay_s=0.5)
    async with store.publishing():  # a stream that never ends does not hold writes forever
        await hold(store, chunks)
        await asyncio.sleep(0.1)
        assert store.dirty_bytes() > 0
        for _ in range(100):
            if not store.dirty_bytes():
                break
            await asyncio.sleep(0.05)
        assert store.dirty_bytes() == 0


async def test_a_stream_that_follows_another_at_once_keeps_the_disk_waiting(tmp_path):
    """A replica's fetch starts right after the publish it fetches: the writers take a gap
    only once the store has been without a stream for `WRITE_GAP_S`."""
    import asyncio

    from treadle_weight_store.write_behind import WRITE_GAP_S

    store = WeightStore(LocalBackend(tmp_path), cache_bytes=0, max_write_delay_s=60)
    _, chunks = two_tensors()
    async with store.publishing():
        await hold(store, chunks)
    for _ in range(3):  # the next stream opens within the gap, three times over
        async with store.publishing():
            await asyncio.sleep(WRITE_GAP_S / 4)
        assert store.dirty_bytes() > 0, "written between two streams"
    await asyncio.sleep(WRITE_GAP_S * 4)  # a real gap
    for _ in range(100):
        if not store.dirty_bytes():
            break
        await asyncio.sleep(0.02)
    assert store.dirty_bytes() == 0 and len(list(LocalBackend(tmp_path).list_chunks())) == 2


class RecordingDisk(LocalBackend):
    """A local backend that records the order of its chunk writes."""

    def __init__(self, root):
        super().__init__(root)
        self.order: list[str] = []

    def _place(self, tmp, path):
        super()._place(tmp, path)
        self.order.append(path.name)


async def test_received_chunks_queue_for_the_writers_without_a_task_each(tmp_path):
    import asyncio

    import torch

    _, chunks = build_manifest(
        "m", state_dict_to_raw({f"t{i}": torch.full((10,), float(i)) for i in range(12)})
    )
    backend = RecordingDisk(tmp_path)
    store = WeightStore(backend, cache_bytes=0, writers=1, max_write_delay_s=60)
    tasks = len(asyncio.all_tasks())
    async with store.publishing():
        await hold(store, chunks)
        assert len(asyncio.all_tasks()) == tasks + 1  # one writer, not a task per chunk
        await asyncio.sleep(0.1)
        assert backend.order == []  # the stream is open: the writer waits for a gap
    await store.flush()
    assert backend.order == list(chunks)  # in arrival order
    assert store.dirty_bytes() == 0 and await store.missing(list(chunks)) == []


class RefusingDisk(RecordingDisk):
    """Refuses one chunk with a store error that is not transient (no retry helps)."""

    def __init__(self, root, refused: str):
        super().__init__(root)
        self.refused = refused

    def _stage_chunk(self, digest, data, sync):
        if digest == self.refused:
            raise Precondition(f"chunk {digest} refused")
        return super()._stage_chunk(digest, data, sync)


async def test_a_refused_chunk_fails_alone_and_the_writer_goes_on(tmp_path):
    import torch

    _, chunks = build_manifest(
        "m", state_dict_to_raw({f"t{i}": torch.full((10,), float(i)) for i in range(4)})
    )
    refused, *rest = chunks
    backend = RefusingDisk(tmp_path, refused)
    store = WeightStore(backend, cache_bytes=0, writers=1)
    drops = dropped("chunk")
    await hold(store, chunks)
    with pytest.raises(BackendError, match="refused"):
        await store.wait_written([refused])
    await store.flush()  # the one writer did not die with the refused chunk
    assert backend.order == rest and dropped("chunk") == drops + 1  # counted with its reason
    assert await store.missing(list(chunks)) == [refused]  # never counted as stored


async def test_gc_spares_chunks_a_publisher_was_told_are_held(tmp_path):
    """Delta publish vs GC: a chunk reported present must still be there at commit; once the
    promise lapses GC may take it, and the commit then asks for a resend (retryable)."""
    from treadle_weight_store.errors import ChunksMissing

    store = WeightStore(LocalBackend(tmp_path), gc_grace_s=0)
    manifest, chunks = two_tensors()
    await hold(store, chunks)
    await store.commit(manifest, durable=True)
    await store._delete_manifest("m", 1)  # retention dropped the only version using them
    again = pb_copy(manifest)
    assert await store.missing(list(chunks)) == []  # "held: no need to send"
    assert (await store.gc())[1] == 0  # a GC in between spares them
    assert (await store.commit(again)).version == 2  # numbers are never reused
    await store._delete_manifest("m", 2)
    store._promised.clear()  # the promise lapsed (PROMISE_S later)
    assert (await store.gc())[1] == len(chunks)
    with pytest.raises(ChunksMissing, match="lacks"):
        await store.commit(pb_copy(manifest))


def pb_copy(manifest):
    copy = type(manifest)()
    copy.CopyFrom(manifest)
    copy.version = -1
    return copy


async def test_concurrent_collections_do_not_race_each_others_deletes(tmp_path):
    store = WeightStore(LocalBackend(tmp_path), gc_grace_s=0)
    for value in (1.0, 2.0, 3.0):
        manifest, chunks = two_tensors(value)
        await hold(store, chunks)
        await store.commit(manifest, durable=True)
    for version in (1, 2, 3):
        await store._delete_manifest("m", version)
    store._promised.clear()
    results = await asyncio.gather(*(store.gc() for _ in range(4)))
    assert sum(r[1] for r in results) == 6  # each chunk deleted once, no error
    assert list(store.backend.list_chunks()) == []


class CountingBackend(LocalBackend):
    listings = 0

    def list_chunks(self):
        self.listings += 1
        return super().list_chunks()


async def test_a_collection_after_a_publish_looks_at_known_chunks_and_a_full_one_lists(tmp_path):
    """The GC after each publish takes unreferenced chunks written in this life without
    listing the backend; chunks it never saw (an earlier life's) wait for a full listing."""
    from treadle_common.clients.chunk_codec import frame_header

    backend = CountingBackend(tmp_path)
    store = WeightStore(backend, gc_grace_s=0)
    assert (await store.gc(full=False))[1] == 0 and backend.listings == 1  # never listed yet
    manifest, chunks = two_tensors()
    await hold(store, chunks)
    await store.commit(manifest, durable=True)
    orphan = b"an earlier life's chunk"
    digest = chunk_hash(orphan)
    backend.put_chunk(digest, (frame_header(digest, len(orphan)), orphan))
    await store._delete_manifest("m", 1)
    store._promised.clear()
    assert (await store.gc(full=False))[1] == len(chunks)  # this life's, without a listing
    assert backend.listings == 1 and backend.has_chunk(digest)
    assert (await store.gc())[1] == 1 and backend.listings == 2
    assert list(backend.list_chunks()) == []


async def test_a_retried_publish_gets_its_version_back_not_a_new_one(tmp_path):
    """The answer to a publish was lost and the client sent it again (same publish_id): the
    store answers with the version it committed, instead of making a duplicate."""
    store = WeightStore(LocalBackend(tmp_path), cache_bytes=0)
    manifest, chunks = two_tensors()
    manifest.metadata["publish_id"] = "p1"
    await hold(store, chunks)
    first = await store.commit(pb_copy(manifest))
    retried = await store.commit(pb_copy(manifest))
    assert first.version == retried.version == 1 and await store.versions("m") == [1]
    other = pb_copy(manifest)
    other.metadata["publish_id"] = "p2"
    assert (await store.commit(other)).version == 2
    restarted = WeightStore(LocalBackend(tmp_path), cache_bytes=0)
    await store.flush()
    assert (await restarted.commit(pb_copy(manifest))).version == 1  # known after a restart


async def test_a_publish_cancelled_while_its_manifest_is_written_leaves_the_version_durable(
    tmp_path,
):
    """The publisher goes away (its RPC is cancelled) while the store writes the version's
    manifest: the write finishes with its bookkeeping. Before, the file was written but the
    version stayed pending, the next pass found its own file and withdrew the version, and
    the store then refused every publish as failing."""

    class SlowManifests(LocalBackend):
        gate = threading.Event()

        def put_manifest(self, model, version, data):
            assert self.gate.wait(10)
            super().put_manifest(model, version, data)

    backend = SlowManifests(tmp_path)
    store = WeightStore(backend, cache_bytes=0)
    manifest, chunks = two_tensors()
    await hold(store, chunks)
    await store.wait_written(list(chunks))
    commit = asyncio.create_task(store.commit(manifest))
    await asyncio.sleep(0.3)  # the manifest write has started (held at the gate)
    commit.cancel()
    backend.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await commit
    await asyncio.wait_for(store.flush(), 10)
    assert (await store.info("m", 1)).durable and store.persist_error is None
    second, chunks = two_tensors(2.0)
    await hold(store, chunks)
    assert (await store.commit(second)).version == 2
    await asyncio.wait_for(store.flush(), 10)
    assert await store.versions("m") == [1, 2] and store.persist_error is None


class DurableAtOnce:
    """The store as the announcer sees it: every version is durable when asked."""

    async def until_durable(self, model: str, version: int) -> bool:
        return True

    async def flush(self) -> None:
        pass

    async def release_reserved(self) -> None:
        pass


async def test_announcements_of_a_model_go_out_in_version_order():
    """The stream keeps one announcement per model: versions announced at once must not
    land older-last. Version 1's announce is slow (NATS just came back), version 2's fast."""
    from treadle_common.proto.treadle.v1 import weights_pb2 as pb
    from treadle_weight_store.grpc import WeightStoreServicer

    published: list[int] = []

    async def announce(manifest: pb.WeightManifest) -> None:
        await asyncio.sleep(0.05 if manifest.version == 1 else 0)
        published.append(manifest.version)

    servicer = WeightStoreServicer(DurableAtOnce(), announce)  # type: ignore[arg-type]
    for version in (1, 2):
        servicer._announce_when_durable(pb.WeightManifest(model="m", version=version))
    await servicer.drain()
    assert published == [1, 2]


async def test_an_announcement_that_a_newer_one_overtook_is_not_sent():
    from treadle_common.proto.treadle.v1 import weights_pb2 as pb
    from treadle_weight_store.grpc import WeightStoreServicer

    published: list[int] = []
    gate = asyncio.Event()

    class SlowDurable(DurableAtOnce):
        async def until_durable(self, model: str, version: int) -> bool:
            if version == 1:
                await gate.wait()  # version 1 becomes durable after version 2 is out
            return True

    async def announce(manifest: pb.WeightManifest) -> None:
        published.append(manifest.version)
        gate.set()

    servicer = WeightStoreServicer(SlowDurable(), announce)  # type: ignore[arg-type]
    for version in (1, 2):
        servicer._announce_when_durable(pb.WeightManifest(model="m", version=version))
    await servicer.drain()
    assert published == [2]


def test_local_backend_stores_a_batch_together_and_a_failed_batch_leaves_no_temp_files(tmp_path):
    good = {chunk_hash(b"x" * n): b"x" * n for n in (5, 6, 7)}
    backend = RefusingDisk(tmp_path, refused="f" * 32)
    backend.put_chunks([(d, (data,)) for d, data in good.items()])
    assert backend.order == list(good)  # placed in order, after one syncfs of their data
    assert {d: backend.get_chunk(d) for d in good} == good
    with pytest.raises(Precondition):
        backend.put_chunks([(chunk_hash(b"new"), (b"new",)), ("f" * 32, (b"refused",))])
    assert not backend.has_chunk(chunk_hash(b"new"))  # nothing of the failed batch is placed
    assert not list(tmp_path.glob("chunks/*/.tmp-*"))  # and no temp file is left behind


def test_chunk_sets_read_a_manifest_once_and_never_answer_for_another():
    """The figures come back for the very object they were read from; another object under
    the same model and version (parsed again, or different chunks) is read anew; the oldest
    entries go past the bound."""
    from treadle_weight_store.manifests import ChunkSets, manifest_chunks

    def manifest(version: int, content: bytes):
        m, _ = build_manifest("m", {"w": RawTensor("U8", (len(content),), memoryview(content))})
        m.version = version
        return m

    sets = ChunkSets(max_entries=2)
    first = manifest(1, b"a" * 10)
    assert sets(first) == manifest_chunks(first)
    assert sets.num_bytes(first) == 10
    first.tensors[0].chunks[0].hash = "changed"  # never done to a committed one: shows a hit
    assert sets(first) != manifest_chunks(first)
    other = manifest(1, b"b" * 12)  # same model and version, another object
    assert sets(other) == manifest_chunks(other) and sets.num_bytes(other) == 12
    sets(manifest(2, b"c"))
    sets(manifest(3, b"d"))  # `other` is now the oldest: gone
    assert len(sets._read) == 2 and ("m", 1) not in sets._read


async def test_listing_versions_reads_the_pins_once_not_once_per_version(tmp_path):
    """On S3 a read of the pins is a GET: listing 4 versions made 4 of them."""

    class CountingPins(LocalBackend):
        reads = 0

        def get_pins(self, model):
            CountingPins.reads += 1
            return super().get_pins(model)

    store = WeightStore(CountingPins(tmp_path), cache_bytes=0)
    manifest, chunks = two_tensors()
    await hold(store, chunks)
    for _ in range(4):
        await store.commit(pb_copy(manifest))
    await store.set_pin("m", 2, True)
    CountingPins.reads = 0
    infos = await store.infos("m")
    assert [(i.version, i.pinned, i.num_bytes) for i in infos] == [
        (1, False, 80),
        (2, True, 80),
        (3, False, 80),
        (4, False, 80),
    ]
    assert CountingPins.reads == 1
    assert (await store.info("m", 2)).pinned  # on its own, it reads them itself
