"""Torch side of the weight-store format: state dicts <-> raw chunks, updated in place.

    client = TorchWeightClient("127.0.0.1:50051")
    version = await client.publish(model.state_dict(), "tiny", step=3)
    await client.fetch("tiny", version, into=replica.state_dict())   # only changed chunks travel

Kept apart from `weights.py` so services without torch (weight-store, reward, env-gateway)
never import it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from treadle_common.clients.weights import (
    CHUNK_BYTES,
    LATEST,
    FetchResult,
    RawTensor,
    WeightStoreClient,
    build_manifest,
    chunk_positions,
)
from treadle_common.proto.treadle.v1 import weights_pb2 as pb

DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is contiguous on CPU."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat.cpu().numpy().data.cast("B")


def byte_view_inplace(tensor: torch.Tensor) -> memoryview:
    if not (tensor.is_contiguous() and tensor.device.type == "cpu"):
        raise ValueError("in-place weight updates need contiguous CPU tensors")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B")


def state_dict_to_raw(state_dict: Mapping[str, torch.Tensor]) -> dict[str, RawTensor]:
    return {
        name: RawTensor(DTYPE_NAMES[t.dtype], tuple(t.shape), byte_view(t))
        for name, t in state_dict.items()
    }


def model_assets(model_dir: Path) -> dict[str, bytes]:
    """The non-weight files of an HF model directory (config, tokenizer, templates)."""
    return {
        p.name: p.read_bytes()
        for p in sorted(Path(model_dir).iterdir())
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)
    }


class ChunkCache:
    """What a replica holds: the chunk layout of the version its tensors currently contain."""

    def __init__(self, positions: dict[str, list[str]] | None = None):
        self.positions = positions or {}

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor]) -> ChunkCache:
        manifest, _ = build_manifest("local", state_dict_to_raw(state_dict))
        return cls(chunk_positions(manifest))

    def have(self) -> set[str]:
        return {h for hashes in self.positions.values() for h in hashes}


def check_target(manifest: pb.WeightManifest, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Every tensor of the version must exist in `state_dict` with the same dtype and shape."""
    for entry in manifest.tensors:
        tensor = state_dict.get(entry.name)
        if tensor is None:
            raise ValueError(
                f"{manifest.model}@{manifest.version}: tensor {entry.name!r} is not in the target"
            )
        dtype = DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
        if dtype != entry.dtype or tuple(tensor.shape) != tuple(entry.shape):
            raise ValueError(
                f"{manifest.model}@{manifest.version}: tensor {entry.name!r} is "
                f"{entry.dtype}{list(entry.shape)}, the target is {dtype}{list(tensor.shape)}"
            )


@dataclass
class _Plan:
    """Where incoming chunks go, and chunks the replica already holds at other positions."""

    targets: dict[str, list[tuple[str, int]]]
    relocations: list[tuple[str, int, bytes]]


def _plan(
    manifest: pb.WeightManifest, views: dict[str, memoryview], cache: ChunkCache, have: set[str]
) -> _Plan:
    held_at: dict[str, tuple[str, int]] = {}
    for name, hashes in cache.positions.items():
        for i, h in enumerate(hashes):
            held_at.setdefault(h, (name, i))
    targets: dict[str, list[tuple[str, int]]] = defaultdict(list)
    relocations = []
    for tensor in manifest.tensors:
        old = cache.positions.get(tensor.name, [])
        for i, ref in enumerate(tensor.chunks):
            if i < len(old) and old[i] == ref.hash:
                continue
            if ref.hash in have and ref.hash in held_at:  # copied now, before anything is written
                src, j = held_at[ref.hash]
                relocations.append(
                    (
                        tensor.name,
                        i,
                        bytes(views[src][j * CHUNK_BYTES : j * CHUNK_BYTES + ref.size]),
                    )
                )
            else:
                targets[ref.hash].append((tensor.name, i))
    return _Plan(targets, relocations)


def _write(views: dict[str, memoryview], name: str, index: int, data: bytes | memoryview) -> None:
    start = index * CHUNK_BYTES
    views[name][start : start + len(data)] = data


@torch.no_grad()
def apply_fetch(
    result: FetchResult, state_dict: Mapping[str, torch.Tensor], cache: ChunkCache
) -> int:
    """Write a fetched version into `state_dict` in place; return the number of chunks written."""
    check_target(result.manifest, state_dict)
    views = {name: byte_view_inplace(t) for name, t in state_dict.items()}
    plan = _plan(result.manifest, views, cache, cache.have())
    written = 0
    for digest, positions in plan.targets.items():
        for name, i in positions:
            _write(views, name, i, result.chunks[digest])
            written += 1
    for name, i, data in plan.relocations:
        _write(views, name, i, data)
    cache.positions = chunk_positions(result.manifest)
    return written + len(plan.relocations)


def tensors_of(result: FetchResult) -> dict[str, torch.Tensor]:
    """A whole fetched version (every chunk fetched) as new CPU tensors."""
    dtypes = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    state = {
        t.name: torch.empty(tuple(t.shape), dtype=dtypes[t.dtype]) for t in result.manifest.tensors
    }
    apply_fetch(result, state, ChunkCache())
    return state


async def fetch_state_dict(
    client: WeightStoreClient, model: str, version: int
) -> tuple[pb.WeightManifest, dict[str, torch.Tensor]]:
    """A whole version as new CPU tensors (small versions: a LoRA adapter)."""
    result = await client.fetch(model, version, skip_assets=True)
    return result.manifest, tensors_of(result)


@torch.no_grad()
async def fetch_into(
    client: WeightStoreClient,
    model: str,
    version: int,
    state_dict: Mapping[str, torch.Tensor],
    cache: ChunkCache,
) -> tuple[pb.WeightManifest, int]:
    """Stream a version into `state_dict` (no staging copy); return it and bytes received."""
    have = cache.have()
    stream: AsyncIterator = client.fetch_stream(model, version, have, skip_assets=True)
    manifest = await anext(stream)
    check_target(manifest, state_dict)
    views = {name: byte_view_inplace(t) for name, t in state_dict.items()}
    plan = _plan(manifest, views, cache, have)
    received = 0
    async for chunk in stream:  # ChunkView: bytes viewed in the received buffer, no copy
        received += len(chunk.data)
        for name, i in plan.targets.pop(chunk.hash, []):
            _write(views, name, i, chunk.data)
    if plan.targets:
        raise RuntimeError(f"{model}@{manifest.version}: {len(plan.targets)} chunks never arrived")
    for name, i, data in plan.relocations:
        _write(views, name, i, data)
    cache.positions = chunk_positions(manifest)
    return manifest, received


class TorchWeightClient:
    """publish / fetch(into=) / latest / watch for torch state dicts."""

    def __init__(self, address: str):
        self.store = WeightStoreClient(address)
        self.caches: dict[int, ChunkCache] = {}

    async def close(self) -> None:
        await self.store.close()

    async def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        model: str,
        step: int,
        assets: Mapping[str, bytes] | None = None,
        **fields,
    ) -> int:
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        response = await self.store.publish(
            model, state_dict_to_raw(cpu), trainer_step=step, assets=assets, **fields
        )
        return response.version

    async def fetch(
        self, model: str, version: int = LATEST, *, into: Mapping[str, torch.Tensor]
    ) -> int:
        """Update `into` in place to `version`, fetching only chunks it does not hold."""
        key = id(into)
        if key not in self.caches:
            self.caches[key] = ChunkCache.from_state_dict(into)
        manifest, _ = await fetch_into(self.store, model, version, into, self.caches[key])
        return manifest.version

    async def latest(self, model: str) -> int | None:
        return await self.store.latest(model)

    async def watch(self, nc, model: str) -> AsyncIterator[pb.WeightAnnouncement]:
        """Announcements of `model`: the latest one first, then each new one."""
        from nats.js.api import DeliverPolicy

        from treadle_common import names
        from treadle_common.clients.weights import ensure_weights_stream

        js = nc.jetstream()
        await ensure_weights_stream(js)
        sub = await js.subscribe(
            names.weights_subject(model), deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
        )
        try:
            async for msg in sub.messages:
                await msg.ack()
                yield pb.WeightAnnouncement.FromString(msg.data)
        finally:
            await sub.unsubscribe()
