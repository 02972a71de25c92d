"""Per-token log-probabilities of a micro-batch under a model (`token_logprobs`), and how
an RL batch's shared prompts are computed once (`SharedPrefix`)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from treadle_trainer.batches import MicroBatch
from treadle_trainer.profiling import phase


def token_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: str,
    entropy: bool = False,
    temperature: float = 1.0,
    loss_columns: bool = False,
    share_prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(target) per token [B, T] under softmax(logits / temperature) (the distribution
    rollout sampled from) and, optionally, that policy's entropy per token.

    `loss_columns`: only positions some row's loss mask covers are wanted (the others come
    back 0), which lets an HF model skip most of an RL batch's work (`SharedPrefix`): the
    columns before the first such position (the prompt) run once per distinct prompt, not
    once per sample of its group, and the output head and the softmax run on the wanted
    columns alone.
    """
    # Right padding under causal attention: real tokens never see the pads after them, so
    # no attention mask is needed (and the fused causal attention path stays available).
    with phase("treadle.logprobs"):  # a named range in a profiled step
        ids = mb.input_ids_B_T.to(device)
        targets = mb.targets_B_T.to(device)
        plan = SharedPrefix.of(model, mb, share_prefix) if loss_columns else None
        if plan is None:
            logits_B_T_V = model(input_ids=ids).logits.float()
        else:
            logits_B_T_V = plan.logits(model, ids).float()
            targets = targets.index_select(1, plan.cols.to(device))
        if temperature != 1.0:
            logits_B_T_V = logits_B_T_V / temperature
        logp_B_T_V = torch.log_softmax(logits_B_T_V, dim=-1)
        chosen = logp_B_T_V.gather(2, targets[..., None]).squeeze(-1)
        ent = None
        if entropy:
            with torch.no_grad():
                ent = -(logp_B_T_V.exp() * logp_B_T_V).sum(-1)
        if plan is not None:  # back to [B, T]: zeros where no loss looks
            cols, full = plan.cols.to(device), chosen.new_zeros(ids.shape)
            chosen = full.index_copy(1, cols, chosen)
            ent = None if ent is None else full.detach().index_copy(1, cols, ent)
    return chosen, ent


@dataclass
class SharedPrefix:
    """How to compute a micro-batch's logits at its loss columns (`cols`) only.

    The columns before the first loss column are prompt in every row: GRPO's group is one
    prompt sampled several times, so they run once per distinct prefix (`unique`, `rows`:
    each row's prefix); the rows then go on from that prefix's KV cache, expanded to them.
    Gradients reach the shared prefix through the cache (its backward sums over the rows),
    so values and gradients are those of the whole rows
    (`tests/unit/trainer/test_shared_prefix.py`).
    """

    cols: torch.Tensor
    start: int
    """The first loss column: the prefix is columns [0, start)."""
    unique: torch.Tensor | None
    rows: torch.Tensor | None
    cache_arg: str = "cache"
    """What the model's forward calls its KV cache (`past_key_values` before transformers 5)."""

    @staticmethod
    def of(model: torch.nn.Module, mb: MicroBatch, share: bool = True) -> SharedPrefix | None:
        """A plan for an HF causal LM (`logits_to_keep`, `past_key_values`), else None;
        `share` False: the loss columns only, every row's prompt run on its own."""
        inner: torch.nn.Module = getattr(model, "wrapped_model", model)
        params = _forward_params(type(inner))
        if "logits_to_keep" not in params:
            return None
        cols = mb.mask_B_T.any(0).nonzero().squeeze(1)
        if len(cols) == 0:
            return None
        start = int(cols[0])
        unique = rows = None
        cache_arg = next((a for a in ("cache", "past_key_values") if a in params), None)
        if share and start > 0 and cache_arg is not None:
            unique, rows = torch.unique(mb.input_ids_B_T[:, :start], dim=0, return_inverse=True)
            if len(unique) == len(rows):  # nothing shared
                unique = rows = None
        if unique is None and len(cols) == mb.mask_B_T.shape[1]:
            return None
        return SharedPrefix(cols, start, unique, rows, cache_arg or "cache")

    def logits(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """[B, len(cols), V]."""
        if self.unique is None or self.rows is None:
            return model(input_ids=ids, logits_to_keep=self.cols.to(ids.device)).logits
        prefix = model(input_ids=self.unique.to(ids.device), use_cache=True, logits_to_keep=1)
        cache = getattr(prefix, self.cache_arg)
        cache.batch_select_indices(self.rows.to(ids.device))  # each row's prefix
        keep = (self.cols - self.start).to(ids.device)
        rest = model(input_ids=ids[:, self.start :], use_cache=True, logits_to_keep=keep,
                     **{self.cache_arg: cache})  # fmt: skip
        return rest.logits


_FORWARD_PARAMS: dict[type, frozenset[str]] = {}


def _forward_params(cls: type[torch.nn.Module]) -> frozenset[str]:
    """The keyword arguments a model class's forward takes (asked once per class, not on
    every forward)."""
    if cls not in _FORWARD_PARAMS:
        _FORWARD_PARAMS[cls] = frozenset(inspect.signature(cls.forward).parameters)
    return _FORWARD_PARAMS[cls]
