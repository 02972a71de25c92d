"""One optimizer step's worth of training on a batch: the code every training path shares
(a run's step, `treadle bench step`'s in-process loop)."""

from __future__ import annotations

from typing import Any

from treadle_common.config.recipe import TrainerConfig
from treadle_trainer import consistency, off_policy
from treadle_trainer.backends import AdamParams, TorchBackend
from treadle_trainer.batches import Datum, pack, split_minibatches
from treadle_trainer.losses import NEEDS_PROXIMAL, LossParams
from treadle_trainer.profiling import phase


def warmup_lr(lr: float, warmup_steps: int, step: int) -> float:
    """The learning rate of `step` (1-based): linear from lr / warmup_steps up to lr."""
    return lr * min(1.0, step / warmup_steps) if warmup_steps else lr


def train_batch(
    backend: TorchBackend,
    data: list[Datum],
    t: TrainerConfig,
    loss: LossParams,
    adam: AdamParams,
    step: int,
) -> dict[str, Any]:
    """`t.minibatches` optimizer steps over `data` (whole groups each), micro-batched by token
    budget; per-token statistics weighted by tokens, losses and norms averaged, the drift's
    figures joined (`consistency.merge`)."""
    if not data:
        return {"loss": 0.0, "grad_norm": 0.0}
    chunks = split_minibatches(data, t.minibatches)
    if (
        t.loss in NEEDS_PROXIMAL or off_policy.corrects(t.off_policy, t.loss)
    ) and t.minibatches > 1:
        # pi_prox = the weights this batch starts from; every batch, even one that makes a
        # single minibatch, or it would meet the snapshot of an earlier batch
        backend.snapshot_proximal()
    outs = []
    adam = adam.model_copy(update={"learning_rate": warmup_lr(t.lr, t.lr_warmup_steps, step)})
    for chunk in chunks:
        with phase("treadle.pack"):  # named ranges in a profiled step (`profiling.py`)
            mbs = pack(chunk, t.micro_batch_tokens, t.loss_aggregation, backend.pad_id)
        with phase("treadle.forward_backward"):
            out = backend.forward_backward(mbs, t.loss, loss)
        with phase("treadle.optim_step"):
            out.update(backend.optim_step(adam))
        outs.append(out)
    tokens = sum(o["num_tokens"] for o in outs) or 1.0
    drift = consistency.merge(outs)
    modes = list(dict.fromkeys(str(o.pop("off_policy", "none")) for o in outs))
    merged = {
        k: sum(o[k] * o["num_tokens"] for o in outs) / tokens
        if k not in ("loss", "grad_norm")
        else sum(o[k] for o in outs) / len(outs)
        for k in outs[0]
        if k not in drift and not k.startswith("_")
    }
    merged["num_tokens"] = tokens
    return {**merged, **drift, "off_policy": ",".join(modes)}
