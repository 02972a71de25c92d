"""A megatron-core `GPTModel` for an HF Llama/Qwen2 checkpoint, and token logprobs and
entropy over a vocabulary split across tensor-parallel ranks.

The model uses megatron-core's local layer spec (RMSNorm, SwiGLU, RoPE, GQA) on CPU and GPU
alike; Transformer Engine's spec names its tensors differently and is not mapped yet. Logits
stay split over the vocabulary: each rank holds [B, T, V/tp], and logprobs come from
`vocab_parallel_cross_entropy` (its gradient flows back through every rank's slice); entropy
reduces the same way without gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from treadle_trainer.backends.megatron.weights import Layout, Shard


def transformer_config(hf: Any, shard: Shard) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = Layout.of(hf)
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError("megatron backend: only default RoPE is mapped")
    return TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=shard.tp_size,
        pipeline_model_parallel_size=shard.pp_size,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,  # the HF weights are copied in
        params_dtype=torch.float32,
        # megatron-core's TorchScript fusions (SwiGLU, bias-dropout-add) run on CPU and GPU
        # alike. Its fused softmax kernel needs fp16/bf16 parameters: bf16 comes from the
        # trainer's autocast instead, as in the other backends, so parameters and the
        # optimizer stay fp32 and the kernel is never picked
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        masked_softmax_fusion=True,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )


def rope_theta(hf: Any) -> float:
    rope = getattr(hf, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def build_model(hf: Any, shard: Shard) -> torch.nn.Module:
    """This rank's `GPTModel` (random init: the caller loads the weights)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if hf.vocab_size % shard.tp_size:
        raise ValueError(
            f"megatron backend: the vocabulary ({hf.vocab_size}) must split evenly over "
            f"{shard.tp_size} tensor-parallel ranks"
        )
    return GPTModel(
        config=transformer_config(hf, shard),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),  # type: ignore[arg-type]
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
        pre_process=shard.first,
        post_process=shard.last,
    )


def vocab_parallel_entropy(logits_B_T_Vp: torch.Tensor) -> torch.Tensor:
    """Entropy per token of softmax over the whole vocabulary, from this rank's slice."""
    import torch.distributed as dist
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    group = get_tensor_model_parallel_group()
    with torch.no_grad():
        peak_B_T = logits_B_T_Vp.max(dim=-1).values
        dist.all_reduce(peak_B_T, op=dist.ReduceOp.MAX, group=group)
        shifted = logits_B_T_Vp - peak_B_T[..., None]
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
        dist.all_reduce(sums, group=group)
        # H = log Z - E[shifted], Z = sum exp(shifted)
        return sums[0].log() - sums[1] / sums[0]


def vocab_parallel_logprobs(
    logits_B_T_Vp: torch.Tensor, targets_B_T: torch.Tensor, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ent = vocab_parallel_entropy(logits_B_T_Vp) if entropy else None
    # the cross entropy shifts its input in place: give it a tensor of its own
    return -vocab_parallel_cross_entropy(logits_B_T_Vp.clone(), targets_B_T), ent
