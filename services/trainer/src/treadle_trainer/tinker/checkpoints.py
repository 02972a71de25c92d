"""A Tinker training client's checkpoints: `adapter.safetensors`, `optimizer.pt` (Adam state
keyed by adapter tensor name, so it loads into any process) and `meta.json` (base model,
LoRA config, step, tenant), written to a temporary directory, fsynced, then renamed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from treadle_common.model import lora
from treadle_common.runtime import durable
from treadle_trainer.errors import InvalidInput
from treadle_trainer.tinker.adapters import LoraClient


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())


def save(client: LoraClient, path: Path, optimizer: bool = True) -> None:
    """`adapter.safetensors` (+ `optimizer.pt`) and `meta.json`, written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(client.adapter_state(), str(tmp / "adapter.safetensors"))
    if optimizer:
        assert client.optimizer is not None
        torch.save(_optimizer_by_name(client), tmp / "optimizer.pt")
    (tmp / "meta.json").write_text(json.dumps(client.meta()))
    durable.fsync_tree(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    durable.fsync(path.parent)


def load(client: LoraClient, path: Path, optimizer: bool) -> None:
    """The adapter (and with `optimizer` its Adam state) of a saved checkpoint, into
    `client`."""
    state = load_file(str(path / "adapter.safetensors"))
    try:
        client.params = lora.load_adapter(client.base.model, client.model_id, state, client.config)
    except ValueError as exc:
        raise InvalidInput(f"checkpoint {path.name}: {exc}") from exc
    for p in client.params:
        p.requires_grad_(True)
    client.optimizer = torch.optim.AdamW(client.params, lr=1e-4)
    client.steps = int(json.loads((path / "meta.json").read_text()).get("step", 0))
    if optimizer:
        if not (path / "optimizer.pt").exists():
            raise InvalidInput(f"checkpoint {path.name} holds no optimizer state")
        saved = torch.load(path / "optimizer.pt", weights_only=True)
        client.optimizer.load_state_dict(_optimizer_from_names(client, saved))


def _optimizer_by_name(client: LoraClient) -> dict[str, Any]:
    """The optimizer's state keyed by adapter tensor name (stable across processes)."""
    assert client.optimizer is not None
    sd = client.optimizer.state_dict()
    names = list(client.adapter_state())  # the same order as `params` (A, B per layer)
    return {
        "state": {names[i]: s for i, s in sd["state"].items()},
        "steps": client.steps,
    }


def _optimizer_from_names(client: LoraClient, saved: dict[str, Any]) -> dict[str, Any]:
    assert client.optimizer is not None
    names = list(client.adapter_state())
    missing = sorted(set(names) - set(saved["state"]))
    if missing:
        raise InvalidInput(f"optimizer state does not fit the adapter: missing {missing[:3]}")
    sd = client.optimizer.state_dict()
    sd["state"] = {i: saved["state"][name] for i, name in enumerate(names)}
    return sd
