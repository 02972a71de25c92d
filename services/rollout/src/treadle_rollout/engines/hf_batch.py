"""The hf engine's running batch and the model's forward passes over it.

`Seq` is one request as the engine runs it; `Batch` the running rows, row i of the KV slab
(`kv_slab.py`) being `seqs[i]`'s. `Forwards` runs the model: a prefill over what each
joining prompt does not find in the prefix cache (one forward per distinct prompt), the rows
that join straight from the cache, and one batched decode step.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from transformers import DynamicCache

from treadle_common.model import lora
from treadle_rollout import metrics
from treadle_rollout.engines import prefix_cache
from treadle_rollout.engines.base import Generation, Sampling, TopLogprobs
from treadle_rollout.engines.grammar import Constraint
from treadle_rollout.engines.kv_slab import KVSlab


@dataclass(eq=False)
class Seq:
    """One request: its prompt, sampling and what has been generated for it so far."""

    prompt: list[int]
    sampling: Sampling
    future: asyncio.Future[Generation]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[TopLogprobs] = field(default_factory=list)
    finish: str | None = None
    hit: prefix_cache.Hit | None = None
    kv_version: int = -1
    """The policy version that computed this row's KV (at its prefill)."""
    progress: asyncio.Event | None = None
    """Streamed requests: set on the event loop after each step that added tokens."""
    ready: int = 0
    """Streamed requests: tokens complete as of the last `progress` (the worker thread
    may be appending past it)."""
    reported_at: float = 0.0
    shown: bool = False
    """Streamed requests: the reported tokens form some text (`HFEngine._hand_over`)."""
    on_piece: Callable[[Generation], None] | None = None
    """`HFEngine.submit`'s callback: the tokens added since its last call."""
    on_finish: Callable[[Generation], None] | None = None
    """`HFEngine.submit`'s callback: the finished generation, in the call that delivers it."""
    sent: int = 0
    """Tokens passed to `on_piece` so far."""
    constraint: Constraint | None = None
    """`Sampling.grammar`'s matcher (`grammar.py`): masks each step, takes each token."""

    @property
    def streamed(self) -> bool:
        return self.progress is not None or self.on_piece is not None

    def restart(self) -> None:
        self.tokens, self.logprobs, self.versions, self.top = [], [], [], []
        if self.constraint is not None:
            self.constraint.reset()


class Batch:
    """The running sequences; row i of the KV slab belongs to `seqs[i]`."""

    def __init__(self, slab: KVSlab) -> None:
        self.seqs: list[Seq] = []
        self.slab = slab

    def add(self, seqs: list[Seq], cache: DynamicCache, mask_B_T: torch.Tensor) -> None:
        """Append prefilled sequences (their cache right-aligned, as `mask_B_T` says)."""
        self.slab.add(
            [layer.keys for layer in layers(cache)],
            [layer.values for layer in layers(cache)],
            mask_B_T,
        )
        self.seqs += seqs

    def drop(self, rows: list[int]) -> None:
        """Remove `rows`; the last rows move into the gaps, as in the slab."""
        self.slab.remove(rows)
        for row in sorted(rows, reverse=True):
            last = self.seqs.pop()
            if row < len(self.seqs):
                self.seqs[row] = last

    def clear(self) -> None:
        self.seqs = []
        self.slab.clear()


class KV(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


def layers(cache: DynamicCache) -> list[KV]:
    """The cache's per-layer keys and values (full-attention layers: both always set)."""
    return cast(list[KV], cache.layers)


def right_align(cache: DynamicCache, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Move every row's cached columns to the right end, in order, dropping the padding
    between a reused prefix and the prefilled rest; return the new mask."""
    length = int(mask_B_T.sum(1).max())
    # a stable sort puts each row's padding columns first and keeps its tokens in order
    index_B_T = torch.sort(mask_B_T, dim=1, stable=True).indices[:, -length:]
    for layer in layers(cache):
        index = index_B_T[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
    return mask_B_T.gather(1, index_B_T)


AdaptersOf = Callable[[list[Seq]], list[str | None] | None]
"""Each row's adapter for `lora.using` (None: the plain model for every row)."""


class Forwards:
    def __init__(self, model, device: str, pad_id: int):
        self.model, self.device, self.pad_id = model, device, pad_id
        # transformers 5.2x renamed the forward's `past_key_values` to `cache` (the old name
        # warns on every call and goes in 5.40); older releases know only the old one
        self.cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def cached_rows(self, seqs: list[Seq]) -> tuple[DynamicCache, torch.Tensor]:
        """Rows whose prompt the prefix cache holds but for its last token: their cached KV,
        right-aligned, and its mask (the last token is fed by the decode step)."""
        reused = [len(s.prompt) - 1 for s in seqs]
        past = max(reused)
        cache = DynamicCache(config=self.model.config)
        self._load_prefixes(cache, seqs, reused, past)
        mask_B_T = torch.zeros((len(seqs), past), dtype=torch.long, device=self.device)
        for i, r in enumerate(reused):
            mask_B_T[i, past - r :] = 1
        metrics.PREFILL_TOKENS.inc(len(seqs))
        metrics.PREFIX_CACHE_HIT_TOKENS.inc(sum(reused))
        return cache, mask_B_T

    def prefill(
        self, seqs: list[Seq], adapters: AdaptersOf
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """One forward over what each distinct prompt does not find in the prefix cache
        (`HFEngine._match`): the episodes of a group share their prompt, so it is computed once and
        its KV and logits copied to each of them (each still samples on its own)."""
        first: dict[tuple, int] = {}
        rows = [
            first.setdefault(
                (
                    tuple(s.prompt),
                    id(s.hit.entry) if s.hit else 0,
                    s.hit.length if s.hit else 0,
                    s.sampling.adapter,
                ),
                len(first),
            )
            for s in seqs
        ]
        if len(first) == len(seqs):
            return self._prefill_rows(seqs, adapters)
        distinct = list({row: seq for row, seq in zip(rows, seqs, strict=True)}.values())
        cache, mask_B_T, logits_B_V = self._prefill_rows(distinct, adapters)
        index = torch.tensor(rows, device=self.device)
        for layer in layers(cache):
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        metrics.PREFIX_CACHE_HIT_TOKENS.inc(
            sum(len(s.prompt) for s in seqs) - sum(len(s.prompt) for s in distinct)
        )
        return cache, mask_B_T.index_select(0, index), logits_B_V.index_select(0, index)

    def _prefill_rows(
        self, seqs: list[Seq], adapters: AdaptersOf
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        reused = [s.hit.length if s.hit else 0 for s in seqs]
        past = max(reused)
        length = max(len(s.prompt) - r for s, r in zip(seqs, reused, strict=True))
        ids_B_T = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(seqs), past + length), dtype=torch.long)
        positions_B_T = torch.zeros((len(seqs), length), dtype=torch.long)
        cache = DynamicCache(config=self.model.config)
        for i, (seq, r) in enumerate(zip(seqs, reused, strict=True)):
            rest = seq.prompt[r:]
            ids_B_T[i, length - len(rest) :] = torch.tensor(rest)
            positions_B_T[i, length - len(rest) :] = torch.arange(r, len(seq.prompt))
            mask_B_T[i, past - r : past] = 1
            mask_B_T[i, past + length - len(rest) :] = 1
        if past:
            self._load_prefixes(cache, seqs, reused, past)
        metrics.PREFILL_TOKENS.inc(sum(len(s.prompt) for s in seqs) - sum(reused))
        metrics.PREFIX_CACHE_HIT_TOKENS.inc(sum(reused))
        ids_B_T, mask_B_T = ids_B_T.to(self.device), mask_B_T.to(self.device)
        with lora.using(adapters(seqs)):
            out = self.model(
                input_ids=ids_B_T,
                attention_mask=mask_B_T,
                position_ids=positions_B_T.to(self.device),
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_arg: cache},
            )
        cache = getattr(out, self.cache_arg)
        if past:
            mask_B_T = right_align(cache, mask_B_T)
        return cache, mask_B_T, out.logits[:, -1, :]

    def _load_prefixes(
        self, cache: DynamicCache, seqs: list[Seq], reused: list[int], past: int
    ) -> None:
        """Fill `cache` with each row's reused prefix, right-aligned to `past` columns."""
        first = next(s.hit.entry for s in seqs if s.hit)
        for layer_idx, like in enumerate(first.keys):
            heads, _, dim = like.shape
            keys = like.new_zeros((len(seqs), heads, past, dim), device=self.device)
            values = torch.zeros_like(keys)
            for i, (seq, r) in enumerate(zip(seqs, reused, strict=True)):
                if seq.hit:
                    keys[i, :, past - r :] = seq.hit.entry.keys[layer_idx][:, :r]
                    values[i, :, past - r :] = seq.hit.entry.values[layer_idx][:, :r]
            cache.update(keys, values, layer_idx)

    def decode(self, batch: Batch, adapters: AdaptersOf) -> torch.Tensor:
        slab = batch.slab
        # a row that joined this step from the prefix cache feeds its prompt's last token
        last_B_1 = torch.tensor(
            [[s.tokens[-1] if s.tokens else s.prompt[-1]] for s in batch.seqs],
            device=self.device,
        )
        cache, mask_B_T, positions_B_1 = slab.begin_step()
        with lora.using(adapters(batch.seqs)):
            out = self.model(
                input_ids=last_B_1,
                attention_mask=mask_B_T,
                position_ids=positions_B_1,
                use_cache=True,
                **{self.cache_arg: cache},
            )
        slab.end_step()
        return out.logits[:, -1, :]
