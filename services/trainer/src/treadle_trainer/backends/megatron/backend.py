"""`MegatronBackend`: megatron-core's `GPTModel` over the ranks of a `torchrun` job.

    ranks = tensor_parallel x pipeline_parallel x data_parallel (megatron-core's grid)

- Each rank builds its part of the model and copies its slice of the HF weights in
  (`weights.to_megatron`); every weight that leaves (publish, checkpoint) is gathered back to
  HF layout on rank 0 (`weights.to_hf`), so rollout and the weight store never know which
  backend trained, and a delta still skips tensors whose bytes did not change.
- Micro-batches are dealt over the data-parallel replicas (`RankedBackend._assign`); the
  ranks of one replica run the same micro-batch, each with its slice of every layer.
- Logprobs, entropy and so every loss come from the vocabulary-parallel logits
  (`model.vocab_parallel_logprobs`), equal to the single backend's on the same batch.
- The optimizer is torch's AdamW over this rank's parameters. Before it steps, gradients are
  summed over data-parallel replicas and clipped to the global norm: tensor-parallel slices
  add their squares over the tp group, replicated tensors (norms) count once.
- Checkpoints: model.safetensors in HF layout (loadable by any backend and by `transformers`)
  and the AdamW moments in HF layout too (`checkpoint_layout = "megatron"`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from treadle_trainer.backends.group import init_distributed
from treadle_trainer.backends.megatron.cpu import init_rng_tracker, patch_for_cpu
from treadle_trainer.backends.megatron.model import build_model, vocab_parallel_logprobs
from treadle_trainer.backends.megatron.weights import (
    Layout,
    Shard,
    Tensors,
    to_hf,
    to_megatron,
    tp_dims,
)
from treadle_trainer.backends.ranks import RankedBackend
from treadle_trainer.backends.spec import BackendSpec
from treadle_trainer.batches import MicroBatch


def init_model_parallel(tensor_parallel: int, pipeline_parallel: int) -> None:
    """megatron-core's process groups for this grid (rebuilt when the grid changes)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == tensor_parallel
            and ps.get_pipeline_model_parallel_world_size() == pipeline_parallel
        )
        if same:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
    )
    init_rng_tracker()


class MegatronBackend(RankedBackend):
    checkpoint_layout = "megatron"

    def __init__(self, spec: BackendSpec):
        from megatron.core import parallel_state as ps

        init_distributed()
        patch_for_cpu()
        if spec.pipeline_parallel > 1:
            raise ValueError(
                "backend megatron: pipeline_parallel > 1 is not supported yet "
                "(see docs/services/trainer.md)"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if torch.cuda.is_available() and spec.device is None:
            spec = spec.model_copy(update={"device": f"cuda:{torch.cuda.current_device()}"})
        init_model_parallel(spec.tensor_parallel, spec.pipeline_parallel)
        self.shard = Shard(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=spec.tensor_parallel,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=spec.pipeline_parallel,
        )
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        self._hf_shapes: dict[str, list[int]] = {}
        super().__init__(spec)

    def layout_info(self) -> dict[str, Any]:
        return {
            **super().layout_info(),
            "tensor_parallel": self.shard.tp_size,
            "pipeline_parallel": self.shard.pp_size,
            "data_parallel": self.dp_size,
        }

    # --- model -------------------------------------------------------------------------------
    def _load_model(self) -> torch.nn.Module:
        hf = AutoModelForCausalLM.from_pretrained(self.spec.model_dir, dtype=torch.float32)
        hf_sd = hf.state_dict()
        self._hf_shapes = {k: list(v.shape) for k, v in hf_sd.items()}
        self.layout = Layout.of(hf.config)
        model = build_model(hf.config, self.shard)
        self._copy_in(model, to_megatron(hf_sd, self.layout, self.shard))
        return model.to(self.device)

    @staticmethod
    def _copy_in(model: torch.nn.Module, tensors: Tensors) -> None:
        params = dict(model.named_parameters())
        if set(params) != set(tensors):
            raise RuntimeError(
                f"megatron model and mapped weights differ: {sorted(set(params) ^ set(tensors))}"
            )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(tensors[name])

    def _signature(self) -> dict[str, list[int]]:
        return dict(self._hf_shapes)

    def _logprobs(
        self, model: torch.nn.Module, mb: MicroBatch, entropy: bool, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids_B_T = mb.input_ids_B_T.to(self.device)
        t = ids_B_T.shape[1]
        positions_B_T = torch.arange(t, device=self.device).expand_as(ids_B_T)
        # causal, True = masked; given explicitly (megatron-core's default mask is made on CUDA).
        # Right padding: real tokens never attend to the pads after them.
        masked_1_1_T_T = torch.ones(t, t, dtype=torch.bool, device=self.device).triu(1)[None, None]
        logits_B_T_Vp = model(
            input_ids=ids_B_T, position_ids=positions_B_T, attention_mask=masked_1_1_T_T
        )
        logits_B_T_Vp = logits_B_T_Vp.float()
        if temperature != 1.0:
            logits_B_T_Vp = logits_B_T_Vp / temperature
        return vocab_parallel_logprobs(logits_B_T_Vp, mb.targets_B_T.to(self.device), entropy)

    # --- optimizer ---------------------------------------------------------------------------
    def _clip_grads(self, max_norm: float) -> float:
        split_dims = tp_dims(self.layout, self.shard)
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        if self.dp_size > 1:
            for grad in grads.values():
                dist.all_reduce(grad, group=self.dp_group)
        split = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, grad in grads.items():
            square = grad.detach().double().pow(2).sum()
            if split_dims[name] is not None:
                split += square
            else:
                replicated += square
        dist.all_reduce(split, group=self.tp_group)
        norm = float((split + replicated).sqrt())
        scale = min(1.0, max_norm / (norm + 1e-6))  # as torch's clip_grad_norm_
        for grad in grads.values():
            grad.mul_(scale)
        return norm

    # --- state (HF layout) -------------------------------------------------------------------
    def _gather(self, local: Tensors) -> Tensors:
        """HF tensors from every tp rank's megatron tensors (complete on every rank)."""
        size = self.shard.tp_size
        ranks: list[Tensors] = [{} for _ in range(size)]
        for name in sorted(local):
            t = local[name].detach().contiguous().to(self._comm_device)
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t, group=self.tp_group)
            for r, part in enumerate(parts):
                ranks[r][name] = part.cpu()
        return to_hf(ranks, self.layout)

    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        self._lead("state_dict", {})
        return self._gather({n: p for n, p in self.model.named_parameters()})

    def snapshot_cpu(self) -> dict[str, torch.Tensor]:
        return self.state_dict_cpu()  # gathered: already a copy

    def _optimizer_state_cpu(self) -> dict[str, Any]:
        named = list(self.model.named_parameters())
        states = [self.optimizer.state.get(p, {}) for _, p in named]
        if not all("exp_avg" in s for s in states):
            return {"step": 0.0}
        return {
            "step": float(states[0]["step"]),
            **{
                moment: self._gather(
                    {n: s[moment] for (n, _), s in zip(named, states, strict=True)}
                )
                for moment in ("exp_avg", "exp_avg_sq")
            },
        }

    def _broadcast_hf(self, full: Tensors) -> Tensors:
        """Rank 0's HF tensors on every rank, in signature order."""
        out: Tensors = {}
        for name in sorted(self.signature):
            if self.rank == 0:
                t = full[name].float().contiguous().to(self._comm_device)
            else:
                t = torch.empty(self.signature[name], device=self._comm_device)
            dist.broadcast(t, src=0)
            out[name] = t.cpu()
        return out

    def _restore(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        self._copy_in(
            self.model, to_megatron(self._broadcast_hf(model_sd), self.layout, self.shard)
        )
        step = torch.tensor([float(optim_sd.get("step", 0.0))], device=self._comm_device)
        dist.broadcast(step, src=0)
        self.optimizer.state.clear()
        if float(step) == 0.0:
            return
        moments = {
            m: to_megatron(self._broadcast_hf(optim_sd.get(m, {})), self.layout, self.shard)
            for m in ("exp_avg", "exp_avg_sq")
        }
        for name, p in self.model.named_parameters():
            self.optimizer.state[p] = {
                "step": torch.tensor(float(step)),
                **{m: moments[m][name].to(p.device) for m in moments},
            }
