"""Hugging Face <-> megatron-core weights for Llama- and Qwen2-style decoders (pure torch).

Megatron-Bridge does this upstream but does not import without Transformer Engine, so the
mapping is ours. One rank of a TP x PP grid holds `Shard`'s part of each megatron tensor:

    HF                                            megatron-core (this rank's part)
    model.embed_tokens.weight        [V, H]       embedding.word_embeddings.weight [V/tp, H]
    model.layers.i.input_layernorm   [H]          decoder.layers.j.input_layernorm.weight
    self_attn.{q,k,v}_proj.weight    [n*d, H]     self_attention.linear_qkv.weight, per query
      (and .bias, Qwen2)                            group g: [q_g (n/g heads); k_g; v_g], the
                                                    groups split over tp ranks [(n+2g)d/tp, H]
    self_attn.o_proj.weight          [H, n*d]     self_attention.linear_proj.weight [H, nd/tp]
    post_attention_layernorm         [H]          pre_mlp_layernorm.weight
    mlp.{gate,up}_proj.weight        [F, H]       mlp.linear_fc1.weight: per tp rank its gate
                                                    rows then its up rows [2F/tp, H]
    mlp.down_proj.weight             [H, F]       mlp.linear_fc2.weight [H, F/tp]
    model.norm.weight                [H]          decoder.final_layernorm.weight (last stage)
    lm_head.weight                   [V, H]       output_layer.weight [V/tp, H] (last stage;
                                                    tied: the embedding is the output layer)

Layer i lives on pipeline stage i // (L/pp) as its local layer j = i % (L/pp). Optimizer
moments have the shapes of their parameters and map the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """What the mapping needs to know about the model (read from its HF config)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def of(cls, config: Any) -> Layout:
        if config.model_type not in ("llama", "qwen2"):
            raise ValueError(f"megatron backend: {config.model_type!r} models are not mapped")
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            tied=bool(config.tie_word_embeddings),
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        )


@dataclass(frozen=True)
class Shard:
    """One rank's place in the tensor x pipeline grid."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def layers(self, layout: Layout) -> range:
        """The global indices of this stage's layers."""
        if layout.num_layers % self.pp_size:
            raise ValueError(
                f"{layout.num_layers} layers do not split into {self.pp_size} pipeline stages"
            )
        per = layout.num_layers // self.pp_size
        return range(self.pp_rank * per, (self.pp_rank + 1) * per)

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _qkv(layout: Layout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    g, d = layout.num_kv_heads, layout.head_dim
    rest = q.shape[1:]
    per_group = [q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def _split_qkv(layout: Layout, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    g, d = layout.num_kv_heads, layout.head_dim
    rest = qkv.shape[1:]
    q_rows = layout.num_heads // g * d
    grouped = qkv.reshape(g, q_rows + 2 * d, *rest)
    q, k, v = grouped.split([q_rows, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _chunk(t: torch.Tensor, shard: Shard, dim: int) -> torch.Tensor:
    if t.shape[dim] % shard.tp_size:
        raise ValueError(f"a dimension of {t.shape[dim]} does not split over {shard.tp_size} ranks")
    return t.chunk(shard.tp_size, dim=dim)[shard.tp_rank].contiguous()


@dataclass(frozen=True)
class _Rule:
    """One megatron tensor: the HF tensors it is made of, how to make it (full, before the
    TP split), how to take them back, and the dimension TP splits (None: replicated)."""

    hf: tuple[str, ...]
    fuse: Callable[..., torch.Tensor]
    unfuse: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    tp_dim: int | None
    per_rank_fuse: bool = False  # fc1: gate/up are concatenated per tp rank, not globally


def _one(t: torch.Tensor) -> torch.Tensor:
    return t


def _rules(layout: Layout, shard: Shard) -> dict[str, _Rule]:
    if layout.num_kv_heads % shard.tp_size:
        raise ValueError(
            f"{layout.num_kv_heads} query groups do not split over {shard.tp_size} ranks"
        )
    rules: dict[str, _Rule] = {}

    def plain(mc: str, hf: str, tp_dim: int | None) -> None:
        rules[mc] = _Rule((hf,), _one, lambda t: (t,), tp_dim)

    if shard.first or (layout.tied and shard.last):
        plain("embedding.word_embeddings.weight", "model.embed_tokens.weight", 0)
    for j, i in enumerate(shard.layers(layout)):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{j}."
        attn = hf + "self_attn."
        plain(mc + "input_layernorm.weight", hf + "input_layernorm.weight", None)
        kinds = ("weight", "bias") if layout.qkv_bias else ("weight",)
        for kind in kinds:
            rules[mc + f"self_attention.linear_qkv.{kind}"] = _Rule(
                tuple(f"{attn}{p}_proj.{kind}" for p in "qkv"),
                lambda q, k, v: _qkv(layout, q, k, v),
                lambda t: _split_qkv(layout, t),
                0,
            )
        plain(mc + "self_attention.linear_proj.weight", attn + "o_proj.weight", 1)
        plain(mc + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight", None)
        rules[mc + "mlp.linear_fc1.weight"] = _Rule(
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
            lambda gate, up: torch.cat([gate, up]),
            lambda t: tuple(t.chunk(2)),
            0,
            per_rank_fuse=True,
        )
        plain(mc + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight", 1)
    if shard.last:
        plain("decoder.final_layernorm.weight", "model.norm.weight", None)
        if not layout.tied:
            plain("output_layer.weight", "lm_head.weight", 0)
    return rules


def to_megatron(hf: Tensors, layout: Layout, shard: Shard) -> Tensors:
    """This rank's megatron tensors from a full HF state dict."""
    out: Tensors = {}
    for name, rule in _rules(layout, shard).items():
        parts = [hf[n] for n in rule.hf]
        if rule.tp_dim is None:
            out[name] = rule.fuse(*parts).clone()
        elif rule.per_rank_fuse:
            out[name] = rule.fuse(*(_chunk(p, shard, rule.tp_dim) for p in parts))
        else:
            out[name] = _chunk(rule.fuse(*parts), shard, rule.tp_dim)
    return out


def to_hf(ranks: list[Tensors], layout: Layout, pp_rank: int = 0, pp_size: int = 1) -> Tensors:
    """The HF tensors of one pipeline stage from every tp rank's megatron tensors (in tp-rank
    order). A tied model's `lm_head.weight` is the embedding, as `model.state_dict()` has it."""
    shard = Shard(tp_size=len(ranks), pp_rank=pp_rank, pp_size=pp_size)
    out: Tensors = {}
    for name, rule in _rules(layout, shard).items():
        pieces = [r[name] for r in ranks]
        if rule.tp_dim is None:
            parts = rule.unfuse(pieces[0])
        elif rule.per_rank_fuse:
            per_rank = [rule.unfuse(p) for p in pieces]
            parts = tuple(torch.cat(ps, dim=rule.tp_dim) for ps in zip(*per_rank, strict=True))
        else:
            parts = rule.unfuse(torch.cat(pieces, dim=rule.tp_dim))
        for hf_name, t in zip(rule.hf, parts, strict=True):
            out[hf_name] = t.contiguous()
    if layout.tied and "model.embed_tokens.weight" in out and shard.first:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def tp_dims(layout: Layout, shard: Shard) -> dict[str, int | None]:
    """Each megatron tensor's TP split dimension (None: replicated over tp ranks)."""
    return {name: rule.tp_dim for name, rule in _rules(layout, shard).items()}
