"""`treadle weights export MODEL VERSION DIR`: a weight-store version as an HF directory.

Writes the version's assets (config.json, tokenizer files, ...) and its tensors as
`model.safetensors`, so `AutoModelForCausalLM.from_pretrained(DIR)` loads identical tensors.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from treadle_common import names
from treadle_common.clients.weights import FetchResult, WeightStoreClient

TORCH_DTYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


async def export_hf(client: WeightStoreClient, model: str, version: int, out_dir: Path) -> Path:
    """A LoRA run's adapter version exports merged into the full-weight version it applies to
    (`lora_base_version` of `lora_base_model`, or of `model` itself when no base model is
    named): the directory serves the adapter's policy without LoRA code."""
    fetched = await client.fetch(model, version)
    metadata = dict(fetched.manifest.metadata)
    if "lora_rank" not in metadata:
        return await asyncio.to_thread(write_hf, fetched, out_dir)
    base_version = int(metadata.get("lora_base_version", "0"))
    if base_version < 1:
        raise ValueError(f"{model}@{version} is a LoRA adapter with no base version in the store")
    base = await client.fetch(metadata.get("lora_base_model", model), base_version)
    return await asyncio.to_thread(write_hf, base, out_dir, fetched)


def write_hf(fetched: FetchResult, out_dir: Path, adapter: FetchResult | None = None) -> Path:
    from safetensors.torch import save_file

    manifest = fetched.manifest
    out_dir.mkdir(parents=True, exist_ok=True)
    for asset in manifest.assets:  # a store of another origin may hold any name: refuse it
        if not names.valid_file_name(asset.name):
            raise ValueError(f"version holds an asset named {asset.name!r}: not a file name")
    for asset in manifest.assets:
        (out_dir / asset.name).write_bytes(b"".join(fetched.chunks[c.hash] for c in asset.chunks))
    tensors = _tensors(fetched)
    version = manifest.version
    if adapter is not None:
        from treadle_common.model import lora

        config = lora.from_metadata(dict(adapter.manifest.metadata))
        tensors = lora.merge(tensors, _tensors(adapter), config)
        version = adapter.manifest.version
    metadata = {
        "format": "pt",
        "treadle_model": manifest.model,
        "treadle_version": str(version),
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
    return out_dir


def _tensors(fetched: FetchResult) -> dict:
    import torch

    tensors = {}
    for entry in fetched.manifest.tensors:
        data = bytearray(b"".join(fetched.chunks[c.hash] for c in entry.chunks))
        dtype = getattr(torch, TORCH_DTYPES[entry.dtype])
        tensors[entry.name] = torch.frombuffer(data, dtype=dtype).reshape(tuple(entry.shape))
    return tensors
