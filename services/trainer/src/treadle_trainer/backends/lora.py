"""`LoraBackend`: the single-process backend training a LoRA adapter (`trainer.lora`).

The base model is loaded once and frozen; the policy is the adapter `policy` on it
(`treadle_common.model.lora`), the frozen reference for the KL penalty is the same base model with
no adapter (no second copy), and decoupled PPO's proximal policy is a second adapter,
`proximal`, copied from the policy. AdamW sees the adapter's parameters only.

Many runs, one base: LoRA backends of the same model directory in one trainer process share
one frozen copy of it (`_SharedBases`, reference-counted), each training its own adapters
(`policy-N`, `proximal-N`) on it. They never run at once: every backend works on the process's
one torch thread, and each forward selects its own adapter (`lora.using`).

What leaves the backend is the adapter: `state_dict_cpu` / `snapshot_cpu` are its tensors
(`<layer>.lora_A` / `.lora_B`), which is what a run publishes and checkpoints; the full
weights it applies to are `base_state_cpu`. Checkpoints record layout `lora`.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

from treadle_common.model import lora
from treadle_trainer.backends.single import TorchBackend
from treadle_trainer.backends.spec import BackendSpec

POLICY = "policy"
PROXIMAL = "proximal"
_IDS = itertools.count(1)


class _SharedBases:
    """Frozen base models by (model directory, device), each with the backends using it.
    `lock`: held while a backend loads, wraps or leaves a base (runs build on torch lanes
    side by side, `set_torch_lanes`)."""

    def __init__(self) -> None:
        self.models: dict[tuple[str, str], tuple[torch.nn.Module, set[int]]] = {}
        self.lock = threading.RLock()

    def take(self, key: tuple[str, str], user: int, load: Any) -> torch.nn.Module:
        if key not in self.models:
            self.models[key] = (load(), set())
        model, users = self.models[key]
        users.add(user)
        return model

    def release(self, key: tuple[str, str], user: int) -> None:
        model, users = self.models.get(key, (None, set()))
        users.discard(user)
        if model is not None and not users:
            del self.models[key]

    def users(self, key: tuple[str, str]) -> int:
        return len(self.models[key][1]) if key in self.models else 0


SHARED_BASES = _SharedBases()


class _Selected(torch.nn.Module):
    """The shared model, called through one adapter (None: the base model)."""

    def __init__(self, model: torch.nn.Module, adapter: str | None):
        super().__init__()
        self.inner = [model]  # a list: not a submodule (no second registration)
        self.adapter = adapter

    @property
    def wrapped_model(self) -> torch.nn.Module:
        return self.inner[0]

    def forward(self, **kwargs: Any) -> Any:
        with lora.using(self.adapter):
            return self.inner[0](**kwargs)


class LoraBackend(TorchBackend):
    checkpoint_layout = "lora"

    def __init__(self, spec: BackendSpec):
        assert spec.lora is not None
        with SHARED_BASES.lock:
            self._build(spec)

    def _build(self, spec: BackendSpec) -> None:
        assert spec.lora is not None
        self._id = next(_IDS)
        self._policy, self._proximal = f"{POLICY}-{self._id}", f"{PROXIMAL}-{self._id}"
        super().__init__(spec.model_copy(update={"reference": False}))
        self.spec = spec
        self.adapter = lora.AdapterConfig(
            rank=spec.lora["rank"],
            alpha=spec.lora["alpha"],
            targets=tuple(spec.lora["targets"]),
            seed=spec.seed,
        )
        base = self.model
        if "lm_head" in self.adapter.targets and getattr(
            self.hf_config, "tie_word_embeddings", False
        ):
            raise ValueError(
                "trainer.lora targets lm_head, but this model ties it to its input "
                "embedding (a merged export would lose it): leave lm_head out"
            )
        base.requires_grad_(False)
        lora.inject(base, self.adapter.targets)
        self.params = lora.add_adapter(base, self._policy, self.adapter)
        for p in self.params:
            p.requires_grad_(True)
        self.base = base
        self.model = _Selected(base, self._policy)
        self.reference = _Selected(base, None).eval() if spec.reference else None
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        self.signature = self._signature()

    def _load_model(self) -> torch.nn.Module:
        """The frozen base: shared with every LoRA backend of the same model directory."""
        self._key = (str(self.spec.model_dir), self.device)
        return SHARED_BASES.take(self._key, self._id, super()._load_model)

    def close(self) -> None:
        with SHARED_BASES.lock:
            lora.remove_adapter(self.base, self._policy)
            lora.remove_adapter(self.base, self._proximal)
            SHARED_BASES.release(self._key, self._id)
        super().close()

    def layout_info(self) -> dict[str, Any]:
        trainable = sum(p.numel() for p in self.params)
        shared = SHARED_BASES.users(self._key)
        return {
            **super().layout_info(),
            "lora_rank": self.adapter.rank,
            "trainable": trainable,
            "base_shared_by": shared,
        }

    def _signature(self) -> dict[str, list[int]]:
        if not hasattr(self, "params"):  # TorchBackend.__init__ asks before the adapter exists
            return super()._signature()
        return {k: list(v.shape) for k, v in self.state_dict_cpu().items()}

    def snapshot_proximal(self) -> None:
        lora.load_adapter(self.base, self._proximal, self.state_dict_cpu(), self.adapter)
        self.proximal = _Selected(self.base, self._proximal).eval()

    def _clip_grads(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    # --- what leaves the backend: the adapter ---------------------------------------------
    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        return lora.adapter_state(self.base, self._policy)

    def snapshot_cpu(self) -> dict[str, torch.Tensor]:
        return self.state_dict_cpu()  # adapter_state copies

    def base_state_cpu(self) -> dict[str, torch.Tensor]:
        """The frozen full weights the adapter applies to."""
        return {k: v.detach().to("cpu") for k, v in self.base.state_dict().items()}

    def publish_metadata(self, base_version: int) -> dict[str, str]:
        return lora.to_metadata(self.adapter, self.spec.model_dir, base_version)

    def _optimizer_state_cpu(self) -> dict[str, Any]:
        names = list(self.state_dict_cpu())  # the order of `params`: A, B per layer
        state = self.optimizer.state_dict()
        return {
            "state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": state["param_groups"],
        }

    def _restore(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        self.params = lora.load_adapter(self.base, self._policy, model_sd, self.adapter)
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        names = list(self.state_dict_cpu())
        restored = self.optimizer.state_dict()
        restored["state"] = {
            i: optim_sd["state"][name] for i, name in enumerate(names) if name in optim_sd["state"]
        }
        restored["param_groups"][0].update(
            {k: v for k, v in optim_sd["param_groups"][0].items() if k != "params"}
        )
        self.optimizer.load_state_dict(restored)
