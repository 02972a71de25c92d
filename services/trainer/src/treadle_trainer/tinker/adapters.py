"""LoRA training clients sharing one frozen base model per base-model name.

    BaseModel    an HF causal LM loaded once, frozen, every targetable Linear wrapped by
                 `treadle_common.model.lora.LoRALinear`; holds the adapters of all its clients
    LoraClient   one Tinker training client: an adapter on a base model, its own AdamW over
                 the adapter's parameters only, its step count

Every call runs on the trainer's one torch thread (`on_torch_thread`), so two clients on one
base never interleave a forward and a backward: a client's gradients land on its own
adapter's parameters only (the base is frozen and other adapters are not selected).

Losses are Tinker's, summed over tokens (no normalisation), from the datum's
`loss_fn_inputs`: `cross_entropy` (target_tokens, weights), `importance_sampling`, `ppo`,
`cispo` (target_tokens, logprobs, advantages; ppo/cispo ratio bounds from `loss_fn_config`
`clip_low_threshold` / `clip_high_threshold`, default 0.8 / 1.2). They are the trainer's own
losses (`losses.py`) with Tinker's aggregation (`sum`). The losses that read the sampling
`logprobs` also report the train-inference drift of their tokens (`consistency.py`) in the
metrics: `log_ratio_mean:mean`, `log_ratio_abs_mean:mean`, `log_ratio_p99:max`,
`log_ratio_max:max`, `behaviour_kl:mean`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle_common.api.training import AdamParams, LossParams
from treadle_common.model import lora
from treadle_trainer.backends.logprobs import token_logprobs
from treadle_trainer.batches import MicroBatch
from treadle_trainer.consistency import Drift
from treadle_trainer.errors import InvalidInput
from treadle_trainer.losses import TokenInputs, total_loss

TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
DRIFT_METRICS = {
    "log_ratio_mean": "mean",
    "log_ratio_abs_mean": "mean",
    "log_ratio_p99": "max",
    "log_ratio_max": "max",
    "behaviour_kl": "mean",
}
"""The drift figures in a forward_backward's metrics, by Tinker's `name:reduction` keys."""
MICRO_BATCH_TOKENS = 8192
"""Padded tokens per forward pass."""


@dataclass
class TinkerDatum:
    """One Tinker datum: input tokens (int64) and its `loss_fn_inputs` as flat arrays."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]

    @classmethod
    def of(cls, tokens: list[int], **inputs: list[float] | list[int]) -> TinkerDatum:
        return cls(
            np.asarray(tokens, dtype=np.int64), {k: np.asarray(v) for k, v in inputs.items()}
        )


class BaseModel:
    def __init__(self, name: str, path: str, seed: int = 0):
        torch.manual_seed(seed)
        self.name, self.path = name, path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.eval()  # no dropout: the same input gives the same logprobs
        self.vocab_size = int(self.model.config.vocab_size)
        self.arch = type(self.model).__name__
        self.model.requires_grad_(False)  # frozen: only adapters train
        lora.inject(self.model, lora.ATTENTION + lora.MLP + lora.UNEMBED)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)


@dataclass
class LoraClient:
    model_id: str
    base: BaseModel
    config: lora.AdapterConfig
    params: list[torch.nn.Parameter] = field(default_factory=list)
    optimizer: torch.optim.AdamW | None = None
    steps: int = 0
    tenant: str | None = None
    """Its session's tenant (written into its checkpoints' meta, stamped on its weights)."""
    owner: str | None = None
    """Its session's owner (`auth.Identity.owner`: a Tinker key's own), in checkpoints' meta."""

    @classmethod
    def create(
        cls,
        model_id: str,
        base: BaseModel,
        config: lora.AdapterConfig,
        tenant: str | None = None,
        owner: str | None = None,
    ) -> LoraClient:
        client = cls(model_id, base, config, tenant=tenant, owner=owner or tenant)
        client.params = lora.add_adapter(base.model, model_id, config)
        for p in client.params:
            p.requires_grad_(True)
        client.optimizer = torch.optim.AdamW(client.params, lr=1e-4)
        return client

    def close(self) -> None:
        lora.remove_adapter(self.base.model, self.model_id)

    # --- forward / backward ---------------------------------------------------------------
    def _checked(self, data: list[TinkerDatum], loss_fn: str) -> None:
        """Refuse data this loss cannot be computed on, naming the datum and the field."""
        needed = {"target_tokens"} | (
            {"weights"} if loss_fn == "cross_entropy" else {"logprobs", "advantages"}
        )
        top = self.base.vocab_size - 1
        for i, d in enumerate(data):
            n = len(d.tokens)
            if n == 0:
                raise InvalidInput(f"data[{i}]: model_input is empty")
            if d.tokens.min() < 0 or d.tokens.max() > top:
                raise InvalidInput(f"data[{i}]: token ids must be in 0..{top}")
            missing = sorted(needed - set(d.inputs))
            if missing:
                raise InvalidInput(f"data[{i}]: loss {loss_fn} needs loss_fn_inputs {missing}")
            for key, values in d.inputs.items():
                if len(values) != n:
                    raise InvalidInput(
                        f"data[{i}]: loss_fn_inputs[{key!r}] has {len(values)} values for "
                        f"{n} input tokens"
                    )
                if not np.isfinite(values).all():
                    raise InvalidInput(f"data[{i}]: loss_fn_inputs[{key!r}] is not finite")
            targets = d.inputs["target_tokens"]
            if targets.min() < 0 or targets.max() > top:
                raise InvalidInput(f"data[{i}]: target_tokens must be in 0..{top}")

    def _collate(self, chunk: list[TinkerDatum]) -> MicroBatch:
        """Right-padded tensors (padding carries weight 0); Tinker sums, so every coef is 1."""
        shape = (len(chunk), max(len(d.tokens) for d in chunk))
        ids = np.full(shape, self.base.pad_id, dtype=np.int64)
        targets = np.full(shape, self.base.pad_id, dtype=np.int64)
        floats = {
            k: np.zeros(shape, dtype=np.float32) for k in ("weights", "advantages", "logprobs")
        }
        for b, d in enumerate(chunk):
            n = len(d.tokens)
            ids[b, :n] = d.tokens
            targets[b, :n] = d.inputs["target_tokens"]
            for key, array in floats.items():
                array[b, :n] = d.inputs[key] if key in d.inputs else float(key == "weights")
        return MicroBatch(
            torch.from_numpy(ids),
            torch.from_numpy(targets),
            torch.from_numpy(floats["weights"]),
            torch.from_numpy(floats["advantages"]),
            torch.from_numpy(floats["logprobs"]),
            torch.ones(len(chunk)),
            torch.zeros(len(chunk), dtype=torch.long),
        )

    def forward_backward(
        self,
        data: list[TinkerDatum],
        loss_fn: str,
        config: Mapping[str, float],
        forward_only: bool,
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-datum `logprobs` and `elementwise_loss`, and the metrics (`loss:sum`)."""
        if loss_fn not in TINKER_LOSSES:
            raise InvalidInput(
                f"loss_fn {loss_fn!r} is not served; served: {', '.join(TINKER_LOSSES)}"
            )
        unknown = sorted(set(config) - {"clip_low_threshold", "clip_high_threshold"})
        if unknown:
            raise InvalidInput(f"loss_fn_config keys {unknown} are not understood by {loss_fn}")
        low = float(config.get("clip_low_threshold", 0.8))
        high = float(config.get("clip_high_threshold", 1.2))
        if not 0 <= low <= 1 <= high:
            raise InvalidInput(
                "loss_fn_config needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold"
            )
        params = LossParams(clip_low=1 - low, clip_high=high - 1)
        self._checked(data, loss_fn)
        outputs: list[dict[str, np.ndarray]] = []
        loss_sum = 0.0
        drift = Drift()
        for chunk in _chunks(data):
            mb = self._collate(chunk)
            value, logprobs_B_T, per_token_B_T = self._step(mb, loss_fn, params, forward_only)
            loss_sum += value
            if loss_fn != "cross_entropy":  # the others read the sampling logprobs
                drift.add(logprobs_B_T, mb.logprobs_B_T, (mb.mask_B_T > 0).float())
            logprobs_np, per_token_np = logprobs_B_T.numpy(), per_token_B_T.numpy()
            for b, d in enumerate(chunk):
                n = len(d.tokens)
                outputs.append(
                    {"logprobs": logprobs_np[b, :n], "elementwise_loss": per_token_np[b, :n]}
                )
        figures = drift.summary(lambda x: x, lambda x: x)
        metrics = {f"{k}:{r}": float(figures[k]) for k, r in DRIFT_METRICS.items() if figures}
        return outputs, {"loss:sum": loss_sum, **metrics}

    def _step(
        self, mb: MicroBatch, loss_fn: str, params: LossParams, forward_only: bool
    ) -> tuple[float, torch.Tensor, torch.Tensor]:
        model = self.base.model
        grad = torch.enable_grad() if not forward_only else torch.no_grad()
        with lora.using(self.model_id), grad:
            logprobs, _ = token_logprobs(model, mb, "cpu")
            inputs = TokenInputs(
                logprobs=logprobs,
                advantages=mb.advantages_B_T,
                behaviour_logprobs=mb.logprobs_B_T,
            )
            value, _ = total_loss(loss_fn, params, inputs, mb.mask_B_T, mb.coef_B)
            if not forward_only:
                value.backward()
        with torch.no_grad():
            per_token, _ = total_loss_per_token(loss_fn, params, inputs, mb.mask_B_T)
        return float(value.detach()), logprobs.detach(), per_token

    def optim_step(self, adam: AdamParams, grad_clip_norm: float) -> dict[str, float]:
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )
        if grad_clip_norm > 0 and norm > grad_clip_norm:
            for g in grads:
                g.mul_(grad_clip_norm / (norm + 1e-6))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": norm, "step": float(self.steps)}

    # --- state ----------------------------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        return lora.adapter_state(self.base.model, self.model_id)

    def meta(self) -> dict[str, Any]:
        return {
            "base_model": self.base.name,
            "lora": {
                "rank": self.config.rank,
                "alpha": self.config.alpha,
                "targets": list(self.config.targets),
            },
            "step": self.steps,
            "tenant": self.tenant,
            "owner": self.owner,
        }


def _chunks(datums: list[TinkerDatum]) -> list[list[TinkerDatum]]:
    """Consecutive datums, at most `MICRO_BATCH_TOKENS` padded tokens per chunk."""
    chunks: list[list[TinkerDatum]] = []
    current: list[TinkerDatum] = []
    longest = 0
    for d in datums:
        longest_if = max(longest, len(d.tokens))
        if current and longest_if * (len(current) + 1) > MICRO_BATCH_TOKENS:
            chunks.append(current)
            current, longest_if = [], len(d.tokens)
        current.append(d)
        longest = longest_if
    if current:
        chunks.append(current)
    return chunks


def total_loss_per_token(
    loss_fn: str, params: LossParams, inputs: TokenInputs, mask_B_T: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss (weighted by the mask), what Tinker returns as `elementwise_loss`."""
    from treadle_trainer.losses import LOSSES

    per_token, stats = LOSSES[loss_fn](inputs, params)
    return per_token * mask_B_T, stats
