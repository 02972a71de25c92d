"""Torch adapters for the weight-store format: state dicts <-> raw chunks, applied in place.

Kept apart from `weights.py` so services without torch (weight-store, reward, env-gateway)
never import it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from treadle_common.clients.weights import CHUNK_BYTES, FetchResult, RawTensor, chunk_positions

DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is contiguous on CPU."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat.cpu().numpy().data.cast("B")


def state_dict_to_raw(state_dict: Mapping[str, torch.Tensor]) -> dict[str, RawTensor]:
    return {
        name: RawTensor(DTYPE_NAMES[t.dtype], tuple(t.shape), byte_view(t))
        for name, t in state_dict.items()
    }


class ChunkCache:
    """What a replica holds: the chunk layout of the version its tensors currently contain."""

    def __init__(self, positions: dict[str, list[str]] | None = None):
        self.positions = positions or {}

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor]) -> ChunkCache:
        from treadle_common.clients.weights import build_manifest

        manifest, _ = build_manifest("local", state_dict_to_raw(state_dict))
        return cls(chunk_positions(manifest))

    def have(self) -> set[str]:
        return {h for hashes in self.positions.values() for h in hashes}


@torch.no_grad()
def apply_fetch(
    result: FetchResult, state_dict: Mapping[str, torch.Tensor], cache: ChunkCache
) -> int:
    """Write changed chunks of `result` into `state_dict` in place; return tensors touched.

    A chunk the caller already held (possibly at another position) is copied from there;
    such copies are gathered before any write so nothing is read after being overwritten.
    """
    held_at: dict[str, tuple[str, int]] = {}
    for name, hashes in cache.positions.items():
        for i, h in enumerate(hashes):
            held_at.setdefault(h, (name, i))
    views = {name: byte_view_inplace(t) for name, t in state_dict.items()}
    writes: list[tuple[str, int, bytes]] = []
    for tensor in result.manifest.tensors:
        if tensor.name not in views:
            raise KeyError(f"weight-store tensor {tensor.name!r} is not in the model")
        old = cache.positions.get(tensor.name, [])
        for i, ref in enumerate(tensor.chunks):
            if i < len(old) and old[i] == ref.hash:
                continue
            if ref.hash in result.chunks:
                writes.append((tensor.name, i, result.chunks[ref.hash]))
            else:
                src_name, src_i = held_at[ref.hash]
                start = src_i * CHUNK_BYTES
                writes.append((tensor.name, i, bytes(views[src_name][start : start + ref.size])))
    for name, i, data in writes:
        start = i * CHUNK_BYTES
        views[name][start : start + len(data)] = data
    cache.positions = chunk_positions(result.manifest)
    return len({name for name, _, _ in writes})


def byte_view_inplace(tensor: torch.Tensor) -> memoryview:
    if not (tensor.is_contiguous() and tensor.device.type == "cpu"):
        raise ValueError("in-place weight updates need contiguous CPU tensors")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B")
