import pytest
import torch

from treadle_common.clients import weights
from treadle_common.clients.torch_weights import ChunkCache, apply_fetch, state_dict_to_raw
from treadle_common.clients.weights import FetchResult, build_manifest

pytestmark = pytest.mark.unit


def test_manifest_chunks_cover_every_byte(monkeypatch):
    monkeypatch.setattr(weights, "CHUNK_BYTES", 64)
    t = torch.arange(100, dtype=torch.float32)  # 400 bytes -> 7 chunks of <= 64
    manifest, chunks = build_manifest("m", state_dict_to_raw({"w": t}))
    (entry,) = manifest.tensors
    assert entry.dtype == "F32" and list(entry.shape) == [100]
    assert sum(c.size for c in entry.chunks) == 400
    assert b"".join(bytes(chunks[c.hash]) for c in entry.chunks) == t.numpy().tobytes()


def fetch_between(old: dict, new: dict) -> tuple[FetchResult, ChunkCache]:
    cache = ChunkCache.from_state_dict(old)
    manifest, chunks = build_manifest("m", state_dict_to_raw(new))
    have = cache.have()
    sent = {h: bytes(v) for h, v in chunks.items() if h not in have}
    return FetchResult(manifest, sent, sum(len(v) for v in sent.values())), cache


def test_apply_fetch_updates_in_place_and_only_changed_chunks_travel():
    old = {"a": torch.zeros(1000), "b": torch.ones(1000)}
    new = {"a": torch.zeros(1000), "b": torch.full((1000,), 2.0)}
    result, cache = fetch_between(old, new)
    assert result.bytes_received == 4000  # only tensor b
    target = {k: v.clone() for k, v in old.items()}
    storage = target["b"].data_ptr()
    apply_fetch(result, target, cache)
    assert torch.equal(target["b"], new["b"]) and torch.equal(target["a"], new["a"])
    assert target["b"].data_ptr() == storage
    assert cache.have() == ChunkCache.from_state_dict(new).have()


def test_chunk_held_at_another_position_is_copied_not_fetched():
    old = {"a": torch.zeros(10), "b": torch.ones(10)}
    new = {"a": torch.ones(10), "b": torch.zeros(10)}  # swapped contents
    result, cache = fetch_between(old, new)
    assert result.bytes_received == 0
    target = {k: v.clone() for k, v in old.items()}
    apply_fetch(result, target, cache)
    assert torch.equal(target["a"], new["a"]) and torch.equal(target["b"], new["b"])
