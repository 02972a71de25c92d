"""`treadle bench weights`: weight sync through the weight-store vs a raw safetensors baseline.

Our path: the trainer publishes a state dict to a real weight-store gRPC server (only missing
chunks travel), a replica fetches into its tensors in place (only chunks it lacks travel).
Baseline: the same state dict written with `safetensors.torch.save_file` and read back with
`load_file` (what syncing through a shared checkpoint directory costs).
Measured twice: a full sync (fresh store, empty replica) and a delta sync after a step that
changed `changed_fraction` of the tensors.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import grpc
import torch
from safetensors.torch import load_file, save_file

from treadle_common.clients.torch_weights import ChunkCache, apply_fetch, state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.logs import configure_logging
from treadle_common.proto.treadle.v1 import weights_pb2_grpc
from treadle_weight_store.grpc_service import WeightStoreServicer
from treadle_weight_store.store import LocalStore


def make_state(size_mb: int, num_tensors: int) -> dict[str, torch.Tensor]:
    numel = size_mb * 2**20 // 4 // num_tensors
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(num_tensors)}


async def _serve(root: Path) -> tuple[grpc.aio.Server, str]:
    async def no_announce(_manifest) -> None:
        return None

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 2**20)])
    weights_pb2_grpc.add_WeightStoreServicer_to_server(
        WeightStoreServicer(LocalStore(root), no_announce), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _ours(state: dict, stepped: dict, root: Path) -> dict[str, float]:
    server, addr = await _serve(root)
    client = WeightStoreClient(addr)
    replica = {k: torch.empty_like(v) for k, v in state.items()}
    cache = ChunkCache({})
    out: dict[str, float] = {}
    for label, source in (("full", state), ("delta", stepped)):
        start = time.perf_counter()
        published = await client.publish("bench", state_dict_to_raw(source))
        mid = time.perf_counter()
        fetched = await client.fetch("bench", published.version, have=cache.have())
        apply_fetch(fetched, replica, cache)
        end = time.perf_counter()
        out[f"ours_{label}_publish_s"] = mid - start
        out[f"ours_{label}_fetch_s"] = end - mid
        out[f"ours_{label}_sync_s"] = end - start
        out[f"ours_{label}_bytes_sent"] = published.bytes_received
        out[f"ours_{label}_bytes_fetched"] = fetched.bytes_received
    assert all(torch.equal(replica[k], stepped[k]) for k in stepped), "replica differs after sync"
    await client.close()
    await server.stop(None)
    return out


def _baseline(state: dict, root: Path) -> float:
    start = time.perf_counter()
    save_file(state, str(root / "model.safetensors"))
    loaded = load_file(str(root / "model.safetensors"))
    elapsed = time.perf_counter() - start
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    return elapsed


def run(size_mb: int = 64, num_tensors: int = 32, changed_fraction: float = 0.05) -> dict:
    configure_logging("bench", level="WARNING")
    state = make_state(size_mb, num_tensors)
    stepped = dict(state)
    for name in list(state)[: max(1, int(num_tensors * changed_fraction))]:
        stepped[name] = state[name] + 1e-3
    with tempfile.TemporaryDirectory() as tmp:
        ours = asyncio.run(_ours(state, stepped, Path(tmp) / "store"))
        baseline_s = _baseline(stepped, Path(tmp))
    return {
        "bench": "weights",
        "size_mb": size_mb,
        "num_tensors": num_tensors,
        "changed_fraction": changed_fraction,
        **{k: round(v, 5) if isinstance(v, float) else v for k, v in ours.items()},
        "baseline_safetensors_sync_s": round(baseline_s, 5),
        "ratio_full": round(baseline_s / ours["ours_full_sync_s"], 3),
        "ratio_delta": round(baseline_s / ours["ours_delta_sync_s"], 3),
    }
