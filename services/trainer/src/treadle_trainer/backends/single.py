"""Single-process torch backend: the policy model, its optimizer, a frozen reference and
checkpoints. `FSDPBackend` reuses everything here and only overrides how the model is wrapped,
which micro-batches a rank runs and how results are reduced.

Checkpoint directory (written to `DIR.tmp`, every file and the directory fsynced, then
renamed, then the parent fsynced: a checkpoint is on disk before anyone points to it):
    model.safetensors   full model state dict
    optimizer.pt        full optimizer state dict (read back with `weights_only=True`)
    rng.safetensors     torch CPU (and CUDA) RNG state
    meta.json           model signature (names, shapes), each file's size and xxh3-128, and
                        the caller's run state
`verify_checkpoint` (`checkpoint_files.py`) checks a directory against its meta.json before
anything is loaded.
"""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from treadle_common.api.training import AdamParams  # the API's shape, re-exported here
from treadle_common.runtime import durable
from treadle_trainer import off_policy
from treadle_trainer.backends import host_copy
from treadle_trainer.backends.call_sums import CallSums
from treadle_trainer.backends.checkpoint_files import CHECKPOINT_FILES
from treadle_trainer.backends.logprobs import token_logprobs
from treadle_trainer.backends.spec import BackendSpec
from treadle_trainer.batches import MicroBatch
from treadle_trainer.errors import IncompatibleCheckpoint
from treadle_trainer.losses import NEEDS_PROXIMAL, LossParams, TokenInputs, total_loss


class TorchBackend:
    world_size = 1
    rank = 0
    share_prefix = True
    """A group's shared prompt runs once per micro-batch (`logprobs.SharedPrefix`)."""

    def __init__(self, spec: BackendSpec):
        self.spec = spec
        torch.manual_seed(spec.seed)
        self.device = spec.device or ("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id
        self.hf_config = AutoConfig.from_pretrained(spec.model_dir)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.model = self._load_model()
        self.reference = self._load_model().eval().requires_grad_(False) if spec.reference else None
        self.proximal: torch.nn.Module | None = None  # decoupled PPO with several minibatches
        self._wrap()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.signature = self._signature()

    def layout_info(self) -> dict[str, Any]:
        """Which backend trains and over how many ranks (logged when a run starts)."""
        return {"backend": type(self).__name__, "ranks": self.world_size, "device": self.device}

    def _signature(self) -> dict[str, list[int]]:
        """The HF tensors' names and shapes (checkpoints record it and are checked against it)."""
        return {k: list(v.shape) for k, v in self.model.state_dict().items()}

    def _logprobs(
        self, model: torch.nn.Module, mb: MicroBatch, entropy: bool, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs(
            model,
            mb,
            self.device,
            entropy=entropy,
            temperature=temperature,
            loss_columns=True,
            share_prefix=self.share_prefix,
        )

    def _load_model(self) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(self.spec.model_dir, dtype=torch.float32)
        return model.to(self.device)  # type: ignore[arg-type]  # transformers types `to` oddly

    def _wrap(self) -> None:
        """Distribute the model (FSDP); nothing to do in one process."""

    def _wrap_frozen(self, module: torch.nn.Module) -> None:
        """Distribute a frozen copy exactly like the model (FSDP); nothing in one process."""

    def snapshot_proximal(self) -> None:
        """Freeze the current weights as decoupled PPO's proximal policy for this batch: its
        minibatch updates then move away from it and the clipped ratio bites."""
        if self.proximal is None:
            self.proximal = self._load_model().eval().requires_grad_(False)
            self._wrap_frozen(self.proximal)
        with torch.no_grad():
            pairs = zip(self.proximal.parameters(), self.model.parameters(), strict=True)
            for frozen, live in pairs:
                frozen.copy_(live)  # under FSDP: local shards of the same placement

    def _autocast(self):
        if self.device.startswith("cuda") and self.spec.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    # --- distribution hooks (overridden by FSDP) ---------------------------------------------
    def _assign(self, mbs: list[MicroBatch]) -> list[tuple[MicroBatch, bool]]:
        """The micro-batches this rank runs; False marks a zero-weight filler."""
        return [(mb, True) for mb in mbs]

    def _sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def _max(self, values: torch.Tensor) -> torch.Tensor:
        return values

    @property
    def _grad_scale(self) -> float:
        return 1.0

    # --- training ------------------------------------------------------------------------------
    def forward_backward(
        self, mbs: list[MicroBatch], loss: str, params: LossParams
    ) -> dict[str, Any]:
        """Accumulate gradients of the aggregated loss over the micro-batches; the loss, the
        per-token statistics, the batch's train-inference drift (`consistency.Drift`) and the
        off-policy correction applied (`off_policy.py`)."""
        self.model.train()
        runs = self._assign(mbs)
        frozen = [self._frozen(mb, loss, params) for mb, _ in runs]
        live = [(p, mb) for (mb, active), (p, _) in zip(runs, frozen, strict=True) if active]
        measured = (
            (p, mb.logprobs_B_T.to(self.device), mb.mask_B_T) for p, mb in live if p is not None
        )
        correction = off_policy.choose(params, loss, measured, self._sum, self._max)
        sums = CallSums()
        for (mb, active), (proximal, ref) in zip(runs, frozen, strict=True):
            mask = mb.mask_B_T.to(self.device)
            coef = mb.coef_B.to(self.device) * (1.0 if active else 0.0)
            behaviour = mb.logprobs_B_T.to(self.device)
            weight_B_T, centre = None, behaviour
            if correction.active:
                assert proximal is not None
                weight_B_T, centre = correction.weights(proximal, behaviour, mask), proximal
            with self._autocast():
                logprobs, entropy = self._logprobs(self.model, mb, True, params.temperature)
            inputs = TokenInputs(
                logprobs=logprobs,
                advantages=mb.advantages_B_T.to(self.device),
                behaviour_logprobs=centre,  # corrected: pi_prox, and the weight carries rho
                proximal_logprobs=proximal,
            )
            value, stats = total_loss(loss, params, inputs, mask, coef, ref, weight_B_T)
            (value * self._grad_scale).backward()
            if active:
                assert entropy is not None
                stats["entropy"] = entropy
                sums.add(value, mask, stats, weight_B_T)
                sums.drift.add(logprobs, behaviour, (mask > 0).float(), mb.staleness_B)
        return sums.result(self._sum, self._max, correction)

    def _frozen(
        self, mb: MicroBatch, loss: str, params: LossParams
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The micro-batch's logprobs under pi_prox (when the loss or a correction reads them:
        the proximal snapshot, else the weights the call starts from) and the reference."""
        proximal = ref = None
        with torch.no_grad(), self._autocast():
            if loss in NEEDS_PROXIMAL or off_policy.corrects(params.off_policy, loss):
                pi_prox = self.proximal if self.proximal is not None else self.model
                proximal, _ = self._logprobs(pi_prox, mb, False, params.temperature)
            if self.reference is not None and params.kl_coef > 0:
                ref, _ = self._logprobs(self.reference, mb, False, params.temperature)
        return proximal, ref

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        norm = self._clip_grads(adam.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm}

    def _clip_grads(self, max_norm: float) -> float:
        """Clip the gradients to a global norm; the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
            norm = norm.full_tensor()
        return float(norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # --- state --------------------------------------------------------------------------------
    def _options(self, load: bool = False) -> StateDictOptions:
        return StateDictOptions(
            full_state_dict=True,
            cpu_offload=not load,
            broadcast_from_rank0=load and self.world_size > 1,
        )

    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        """The full model state dict on the CPU (complete on rank 0)."""
        sd = cast(
            dict[str, torch.Tensor], get_model_state_dict(self.model, options=self._options())
        )
        return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}

    def snapshot_cpu(self) -> dict[str, torch.Tensor]:
        """The weights on the CPU as a copy that later optimizer steps leave alone (to publish
        while training goes on); from CUDA into pinned memory (`host_copy.py`)."""
        full = StateDictOptions(full_state_dict=True)
        state = get_model_state_dict(self.model, options=full)
        return host_copy.snapshot(cast(dict[str, torch.Tensor], state))

    checkpoint_layout = "torch"
    """How optimizer.pt is laid out (meta.json records it; a backend loads only its own)."""

    def _optimizer_state_cpu(self) -> dict[str, Any]:
        """The full optimizer state, complete on rank 0."""
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._options())

    def _restore(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        """Load full state dicts (given on rank 0; empty on the other ranks)."""
        set_model_state_dict(self.model, model_sd, options=self._options(load=True))
        set_optimizer_state_dict(
            self.model, self.optimizer, optim_state_dict=optim_sd, options=self._options(load=True)
        )

    def save(self, path: Path, meta: dict[str, Any]) -> None:
        """Write a checkpoint atomically: `path.tmp` first, renamed to `path` when complete."""
        model_sd = {k: v.clone() for k, v in self.state_dict_cpu().items()}  # tied weights
        optim_sd = self._optimizer_state_cpu()
        if self.rank != 0:
            return
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(model_sd, str(tmp / "model.safetensors"))
        torch.save(optim_sd, tmp / "optimizer.pt")
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        save_file(rng, str(tmp / "rng.safetensors"))
        files = {
            name: {"size": (tmp / name).stat().st_size, "xxh3": durable.digest(tmp / name)}
            for name in CHECKPOINT_FILES
        }
        record = {"signature": self.signature, "layout": self.checkpoint_layout, "files": files}
        (tmp / "meta.json").write_text(json.dumps({**record, **meta}))
        durable.fsync_tree(tmp)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        durable.fsync(path.parent)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model, optimizer and RNG; refuse a checkpoint of another model."""
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("signature") != self.signature:
            theirs, ours = meta.get("signature") or {}, self.signature
            diff = sorted(set(theirs) ^ set(ours)) or [k for k in ours if theirs.get(k) != ours[k]]
            raise IncompatibleCheckpoint(
                f"checkpoint {path} was written for a different model "
                f"({len(theirs)} vs {len(ours)} tensors; first difference: {diff[:3]})"
            )
        layout = meta.get("layout", "torch")
        if layout != self.checkpoint_layout:
            raise IncompatibleCheckpoint(
                f"checkpoint {path} holds {layout} optimizer state; this backend reads "
                f"{self.checkpoint_layout} (its model.safetensors loads as an HF model)"
            )
        primary = self.rank == 0
        model_sd: dict[str, Any] = load_file(str(path / "model.safetensors")) if primary else {}
        optim_sd = torch.load(path / "optimizer.pt", weights_only=True) if primary else {}
        self._restore(model_sd, optim_sd)
        rng = load_file(str(path / "rng.safetensors"))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        return meta

    def close(self) -> None:
        """Release resources (followers are told to stop under FSDP)."""
