"""Many LoRA adapters on one base model: the trainer trains several at once (one per Tinker
training client), rollout samples from several in one batch.

`inject(model, targets)` replaces each targeted `nn.Linear` by a `LoRALinear` that keeps the
base layer (frozen, shared) and a dict of adapters. An adapter on a layer is
`y = W x + (alpha / r) B A x` with `A` [r, in] (Kaiming-uniform, seeded) and `B` [out, r]
(zeros), so a new adapter starts as the base model exactly.

Which adapter a forward pass uses is set with `using(...)` around the call (a context
variable, so it follows the thread the forward runs in):

    with lora.using("run-a"):              every row through adapter run-a
    with lora.using(["a", None, "b"]):     row i of the batch through names[i] (None: base)

Rows through different adapters cost one low-rank product per adapter present, on that
adapter's rows only; the base product is shared by the whole batch.

An adapter's tensors are named `<module path>.lora_A` / `.lora_B` (`adapter_state`), which is
what the weight-store publishes and checkpoints hold: megabytes where the model is gigabytes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Attention projections (HF Llama/Qwen/Mistral names)."""
MLP = ("gate_proj", "up_proj", "down_proj")
"""MLP projections."""
UNEMBED = ("lm_head",)
"""The output head (its LoRA leaves a tied input embedding alone)."""

Selection = str | Sequence[str | None] | None
_ACTIVE: contextvars.ContextVar[str | _Rows | None] = contextvars.ContextVar(
    "lora_active", default=None
)


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float = 32.0
    targets: tuple[str, ...] = ATTENTION + MLP + UNEMBED
    """Module names (the last path component) that get this adapter."""
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def to_metadata(
    config: AdapterConfig, base_model: str, base_version: int | None = None
) -> dict[str, str]:
    """What a weight-store version of an adapter records about it (manifest metadata);
    `base_version`: the full-weight version of the same model it applies to (a run's)."""
    out = {
        "lora_rank": str(config.rank),
        "lora_alpha": str(config.alpha),
        "lora_targets": ",".join(config.targets),
        "base_model": base_model,
    }
    if base_version is not None:
        out["lora_base_version"] = str(base_version)
    return out


def is_adapter(metadata: dict[str, str]) -> bool:
    """Whether a weight-store version's metadata says it holds a LoRA adapter."""
    return "lora_rank" in metadata


@torch.no_grad()
def merge(
    state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], config: AdapterConfig
) -> dict[str, torch.Tensor]:
    """Full weights with the adapter folded in: W + (alpha / r) B A for every adapted layer
    (an HF directory of them serves the adapter's policy with no LoRA code)."""
    out = dict(state)
    for name, a in adapter.items():
        if not name.endswith(".lora_A"):
            continue
        path = name.removesuffix(".lora_A")
        weight = f"{path}.weight"
        if weight not in out:
            raise ValueError(f"adapter layer {path} has no {weight} in the full weights")
        b = adapter[f"{path}.lora_B"]
        base = out[weight]
        out[weight] = (base.float() + config.scale * (b.float() @ a.float())).to(base.dtype)
    return out


def from_metadata(metadata: dict[str, str]) -> AdapterConfig:
    """The adapter config a version's metadata records (`to_metadata`); ValueError if none."""
    if "lora_rank" not in metadata:
        raise ValueError("the version is not a LoRA adapter (no lora_rank in its metadata)")
    return AdapterConfig(
        rank=int(metadata["lora_rank"]),
        alpha=float(metadata["lora_alpha"]),
        targets=tuple(metadata["lora_targets"].split(",")),
    )


def targets_for(attn: bool, mlp: bool, unembed: bool) -> tuple[str, ...]:
    """The module names of the Tinker SDK's `train_attn` / `train_mlp` / `train_unembed`."""
    return (ATTENTION if attn else ()) + (MLP if mlp else ()) + (UNEMBED if unembed else ())


class Adapter(nn.Module):
    def __init__(self, in_features: int, out_features: int, config: AdapterConfig, gen):
        super().__init__()
        a = torch.empty(config.rank, in_features)
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform(a=sqrt(5)) as nn.Linear / PEFT
        a.uniform_(-bound, bound, generator=gen)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(out_features, config.rank))
        self.scale = config.scale

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lora_A.T.to(x.dtype)) @ self.lora_B.T.to(x.dtype) * self.scale


class LoRALinear(nn.Linear):
    """An `nn.Linear` (the same weight and bias Parameters, so a tied head stays tied and the
    state dict keeps its names) plus named adapters; `using(...)` picks which apply. The
    adapters are not submodules: the model's `state_dict()` and `parameters()` stay the base
    model's (weight swaps, checkpoints), and each adapter's owner holds its parameters."""

    def __init__(self, base: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.adapters: dict[str, Adapter] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        active = _ACTIVE.get()
        if active is None or not self.adapters:
            return y
        if isinstance(active, str):
            adapter = self.adapters.get(active)
            return y if adapter is None else y + adapter.delta(x)
        if active.rows != x.shape[0]:
            raise ValueError(f"{active.rows} adapter names for a batch of {x.shape[0]} rows")
        if active.blocks is not None:  # each adapter's rows side by side: slices, one cat
            parts = [
                y[a:b] if name not in self.adapters else y[a:b] + self.adapters[name].delta(x[a:b])
                for name, a, b in active.blocks
            ]
            return torch.cat(parts)
        out = y.clone()
        for name, rows in active.indices.items():
            if name in self.adapters:
                rows = rows.to(x.device)
                out[rows] = y[rows] + self.adapters[name].delta(x[rows])
        return out


class _Rows:
    """A per-row selection, worked out once for every layer of the forward: contiguous
    blocks of one name each (slices) when the rows come grouped, else row indices by name."""

    def __init__(self, names: Sequence[str | None]):
        self.rows = len(names)
        blocks: list[tuple[str | None, int, int]] = []
        for i, name in enumerate(names):
            if blocks and blocks[-1][0] == name:
                blocks[-1] = (name, blocks[-1][1], i + 1)
            else:
                blocks.append((name, i, i + 1))
        grouped = len(blocks) == len(set(names))
        self.blocks = blocks if grouped else None
        self.indices = {} if grouped else {
            name: torch.tensor([i for i, n in enumerate(names) if n == name])
            for name in set(names)
            if name is not None
        }  # fmt: skip


@contextlib.contextmanager
def using(selection: Selection) -> Iterator[None]:
    """Forward passes inside go through `selection` (an adapter name, one per batch row, or
    None for the base model)."""
    active = selection if selection is None or isinstance(selection, str) else _Rows(selection)
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def inject(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Wrap every `nn.Linear` whose name ends in one of `targets` (once; idempotent) and
    return the wrapped modules' paths. The model's parameters and state dict are unchanged."""
    wrapped = []
    for path, module in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if isinstance(module, LoRALinear):
            wrapped.append(path)
        elif isinstance(module, nn.Linear) and leaf in targets:
            parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
            setattr(parent, leaf, LoRALinear(module))
            wrapped.append(path)
    return wrapped


def layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}


def add_adapter(model: nn.Module, name: str, config: AdapterConfig) -> list[nn.Parameter]:
    """Give every targeted layer a fresh adapter `name`; its trainable parameters."""
    gen = torch.Generator().manual_seed(config.seed)
    params: list[nn.Parameter] = []
    for path, layer in layers(model).items():
        if path.rsplit(".", 1)[-1] not in config.targets:
            continue
        if name in layer.adapters:
            raise ValueError(f"adapter {name!r} already exists")
        adapter = Adapter(layer.in_features, layer.out_features, config, gen)
        layer.adapters[name] = adapter.to(layer.weight.device)
        params += [adapter.lora_A, adapter.lora_B]
    if not params:
        raise ValueError(f"no layer of the model matches the adapter's targets {config.targets}")
    return params


def remove_adapter(model: nn.Module, name: str) -> None:
    for layer in layers(model).values():
        if name in layer.adapters:
            del layer.adapters[name]


def adapter_state(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name`'s tensors on the CPU, keyed `<module path>.lora_A|lora_B`."""
    out = {}
    for path, layer in layers(model).items():
        if name in layer.adapters:
            adapter = layer.adapters[name]
            out[f"{path}.lora_A"] = adapter.lora_A.detach().to("cpu").clone()
            out[f"{path}.lora_B"] = adapter.lora_B.detach().to("cpu").clone()
    return out


def load_adapter(
    model: nn.Module, name: str, state: dict[str, torch.Tensor], config: AdapterConfig
) -> list[nn.Parameter]:
    """Create (or replace) adapter `name` from `adapter_state` tensors; its parameters."""
    remove_adapter(model, name)
    params = add_adapter(model, name, config)
    expected = adapter_state(model, name)
    if set(expected) != set(state):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise ValueError(
            f"adapter tensors do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    with torch.no_grad():
        for path, layer in layers(model).items():
            if name in layer.adapters:
                adapter = layer.adapters[name]
                for part in ("lora_A", "lora_B"):
                    want = getattr(adapter, part)
                    got = state[f"{path}.{part}"]
                    if tuple(got.shape) != tuple(want.shape):
                        raise ValueError(
                            f"{path}.{part}: shape {tuple(got.shape)}, "
                            f"the model needs {tuple(want.shape)}"
                        )
                    want.copy_(got)
    return params
