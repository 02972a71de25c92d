"""WeightStore core logic with a scripted failing backend (no server needed)."""

import errno
import fcntl
import os

import pytest

from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.clients.weights import build_manifest
from treadle_weight_store.backends.local import LocalBackend
from treadle_weight_store.cache import ChunkCache
from treadle_weight_store.errors import BackendError
from treadle_weight_store.store import WeightStore

pytestmark = pytest.mark.unit


class DiskFullAfter(LocalBackend):
    """A local backend whose disk fills up after `budget` chunk writes."""

    def __init__(self, root, budget: int):
        super().__init__(root)
        self.budget = budget

    def put_chunk(self, digest, data):
        if self.budget == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget -= 1
        super().put_chunk(digest, data)


async def test_disk_full_is_an_error_and_no_version_appears(tmp_path):
    import torch

    store = WeightStore(DiskFullAfter(tmp_path, budget=1), cache_bytes=0)
    manifest, chunks = build_manifest(
        "m", state_dict_to_raw({"a": torch.ones(10), "b": torch.zeros(10)})
    )
    first, second = list(chunks)
    await store.put_chunk(first, bytes(chunks[first]))
    with pytest.raises(BackendError, match="No space left on device"):
        await store.put_chunk(second, bytes(chunks[second]))
    with pytest.raises(Exception, match="lacks"):
        await store.commit(manifest)
    assert await store.versions("m") == []


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
