"""`LoraBackend`: the single-process backend training a LoRA adapter (`trainer.lora`).

The base model is loaded once and frozen; the policy is the adapter `policy` on it
(`treadle_common.lora`), the frozen reference for the KL penalty is the same base model with
no adapter (no second copy), and decoupled PPO's proximal policy is a second adapter,
`proximal`, copied from the policy. AdamW sees the adapter's parameters only.

What leaves the backend is the adapter: `state_dict_cpu` / `snapshot_cpu` are its tensors
(`<layer>.lora_A` / `.lora_B`), which is what a run publishes and checkpoints; the full
weights it applies to are `base_state_cpu`. Checkpoints record layout `lora`.
"""

from __future__ import annotations

from typing import Any

import torch

from treadle_common import lora
from treadle_trainer.backends.single import BackendSpec, TorchBackend

POLICY = "policy"
PROXIMAL = "proximal"


class _Selected(torch.nn.Module):
    """The shared model, called through one adapter (None: the base model)."""

    def __init__(self, model: torch.nn.Module, adapter: str | None):
        super().__init__()
        self.inner = [model]  # a list: not a submodule (no second registration)
        self.adapter = adapter

    def forward(self, **kwargs: Any) -> Any:
        with lora.using(self.adapter):
            return self.inner[0](**kwargs)


class LoraBackend(TorchBackend):
    checkpoint_layout = "lora"

    def __init__(self, spec: BackendSpec):
        assert spec.lora is not None
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
        self.params = lora.add_adapter(base, POLICY, self.adapter)
        for p in self.params:
            p.requires_grad_(True)
        self.base = base
        self.model = _Selected(base, POLICY)
        self.reference = _Selected(base, None).eval() if spec.reference else None
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4)
        self.signature = self._signature()

    def layout_info(self) -> dict[str, Any]:
        trainable = sum(p.numel() for p in self.params)
        return {**super().layout_info(), "lora_rank": self.adapter.rank, "trainable": trainable}

    def _signature(self) -> dict[str, list[int]]:
        if not hasattr(self, "params"):  # TorchBackend.__init__ asks before the adapter exists
            return super()._signature()
        return {k: list(v.shape) for k, v in self.state_dict_cpu().items()}

    def snapshot_proximal(self) -> None:
        lora.load_adapter(self.base, PROXIMAL, self.state_dict_cpu(), self.adapter)
        self.proximal = _Selected(self.base, PROXIMAL).eval()

    def _clip_grads(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    # --- what leaves the backend: the adapter ---------------------------------------------
    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        return lora.adapter_state(self.base, POLICY)

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
        self.params = lora.load_adapter(self.base, POLICY, model_sd, self.adapter)
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
