"""HF <-> megatron-core weight mapping (pure torch): a round trip through every rank's part
of a TP x PP grid gives back identical tensors, and the parts have megatron-core's shapes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from treadle_trainer.backends.megatron.weights import Layout, Shard, to_hf, to_megatron

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(**COMMON, tie_word_embeddings=True)
    else:
        config = Qwen2Config(**COMMON, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    return config, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_gives_identical_tensors(kind, tp, pp):
    config, hf = tiny(kind)
    layout = Layout.of(config)
    back: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        ranks = [to_megatron(hf, layout, Shard(r, tp, pp_rank, pp)) for r in range(tp)]
        back |= to_hf(ranks, layout, pp_rank, pp)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_parts_have_megatron_core_shapes_and_layout():
    config, hf = tiny("qwen2")
    layout = Layout.of(config)
    assert layout.qkv_bias and not layout.tied and layout.num_kv_heads == 2
    rank1 = to_megatron(hf, layout, Shard(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2))
    # stage 1 of 2 holds layers 2 and 3 as its local layers 0 and 1, the last norm and head
    assert "embedding.word_embeddings.weight" not in rank1
    qkv = rank1["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((4 + 2 * 2) * 16 // 2, 64)
    # tp rank 1 holds query group 1: its 2 query heads, then its key, then its value
    q, k, v = (hf[f"model.layers.2.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(qkv, torch.cat([q[32:64], k[16:32], v[16:32]]))
    fc1 = rank1["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = (hf[f"model.layers.3.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(fc1, torch.cat([gate[48:], up[48:]]))  # this rank's gate, then up
    assert rank1["output_layer.weight"].shape == (48, 64)
    assert rank1["decoder.layers.1.mlp.linear_fc2.weight"].shape == (64, 48)


def test_unmapped_models_and_uneven_splits_are_refused():
    config, hf = tiny("llama")
    with pytest.raises(ValueError, match="2 query groups do not split over 4 ranks"):
        to_megatron(hf, Layout.of(config), Shard(tp_rank=0, tp_size=4))  # 2 query groups
    with pytest.raises(ValueError, match="4 layers do not split into 3"):
        to_megatron(hf, Layout.of(config), Shard(pp_size=3))
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="'gpt2' models are not mapped"):
        Layout.of(config)
