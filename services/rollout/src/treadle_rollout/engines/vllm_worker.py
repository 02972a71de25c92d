"""Runs inside vLLM's worker process (`worker_extension_cls`): pulls a version from the
weight-store and loads it into the running model.

Only names and numbers cross vLLM's RPC boundary (address, model, version); the worker
fetches the chunks itself over gRPC. It keeps a CPU copy of the HF-named weights (the
model directory's safetensors at start) so that a delta fetch — only the chunks that
changed — updates that copy in place while generation goes on (`treadle_fetch`); at the
pause point `treadle_load` hands the tensors that changed to the model's `load_weights`,
which maps HF names onto vLLM's fused layout.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from treadle_common.clients.torch_weights import ChunkCache, fetch_into
from treadle_common.clients.weights import WeightStoreClient


def _hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model directory's weights by HF name, as the trainer's state dict names them
    (a tied output embedding is saved once but appears under both names)."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(path))
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return {k: v.contiguous() for k, v in state.items()}


class TreadleWorkerExtension:
    """Mixed into vLLM's worker class; methods are called by name through `collective_rpc`."""

    def treadle_init(self, model_dir: str) -> int:
        self._treadle_state = _hf_state(Path(model_dir))
        self._treadle_cache = ChunkCache.from_state_dict(self._treadle_state)
        return len(self._treadle_state)

    def treadle_held_chunks(self) -> list[str]:
        return sorted(self._treadle_cache.have())

    def treadle_fetch(self, address: str, model: str, version: int) -> dict:
        """Fetch `version` into the CPU copy (delta only); generation is not disturbed."""
        before = dict(self._treadle_cache.positions)
        start = time.perf_counter()

        async def fetch() -> tuple[int, int]:
            client = WeightStoreClient(address)
            try:
                manifest, received = await fetch_into(
                    client, model, version, self._treadle_state, self._treadle_cache
                )
            finally:
                await client.close()
            return manifest.version, received

        fetched_version, received = asyncio.run(fetch())
        self._treadle_pending = [
            name
            for name, hashes in self._treadle_cache.positions.items()
            if before.get(name) != hashes
        ]
        return {
            "version": fetched_version,
            "bytes_fetched": received,
            "tensors_changed": len(self._treadle_pending),
            "fetch_s": time.perf_counter() - start,
            "held": sorted(self._treadle_cache.have()),
        }

    def treadle_load(self) -> int:
        """Load the tensors the last fetch changed into the model (at the pause point)."""
        pending, self._treadle_pending = getattr(self, "_treadle_pending", []), []
        model = self.model_runner.model  # type: ignore[attr-defined]
        model.load_weights((name, self._treadle_state[name]) for name in pending)
        return len(pending)
