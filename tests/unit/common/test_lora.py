"""`treadle_common.model.lora`: many adapters on one base model, chosen per call or per batch
row."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from treadle_common.model import lora


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from treadle_cli.tiny_model import init_tiny

    path = init_tiny(tmp_path_factory.mktemp("lora") / "tiny")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logits(model, ids, selection=None):
    with torch.no_grad(), lora.using(selection):
        return model(input_ids=ids).logits


def test_injection_keeps_the_state_dict_and_a_new_adapter_is_the_base(model):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    before_keys = list(model.state_dict())
    base = logits(model, ids)
    paths = lora.inject(model, lora.ATTENTION + lora.MLP + lora.UNEMBED)
    assert paths and list(model.state_dict()) == before_keys  # weight swaps still apply
    assert model.lm_head.weight is model.get_input_embeddings().weight or not (
        model.config.tie_word_embeddings
    )
    lora.add_adapter(model, "a", lora.AdapterConfig(rank=4, seed=1))
    assert torch.equal(logits(model, ids, "a"), base)  # B = 0
    assert lora.inject(model, lora.ATTENTION) == paths  # idempotent


def test_per_row_selection_equals_each_adapter_alone(model):
    lora.inject(model, lora.ATTENTION + lora.MLP + lora.UNEMBED)
    for name, seed in (("r1", 1), ("r2", 2)):
        params = lora.add_adapter(model, name, lora.AdapterConfig(rank=4, seed=seed))
        with torch.no_grad():
            for p in params:
                p.normal_(0, 0.05)  # a trained adapter
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    mixed = logits(model, ids, ["r1", None, "r2"])
    assert torch.allclose(mixed[0], logits(model, ids[:1], "r1")[0], atol=1e-5)
    assert torch.allclose(mixed[1], logits(model, ids[1:2])[0], atol=1e-5)
    assert torch.allclose(mixed[2], logits(model, ids[2:], "r2")[0], atol=1e-5)
    assert not torch.allclose(mixed[0], logits(model, ids[:1])[0], atol=1e-3)

    # export and load into another name: the same function
    state = lora.adapter_state(model, "r1")
    assert state and all(k.endswith((".lora_A", ".lora_B")) for k in state)
    lora.load_adapter(model, "copy", state, lora.AdapterConfig(rank=4))
    assert torch.equal(logits(model, ids, "copy"), logits(model, ids, "r1"))
    with pytest.raises(ValueError, match="shape"):
        lora.load_adapter(model, "bad", state, lora.AdapterConfig(rank=2))
    lora.remove_adapter(model, "copy")
    assert torch.equal(logits(model, ids, "copy"), logits(model, ids))  # unknown name: base


def test_gradients_reach_only_the_selected_adapter(model):
    lora.inject(model, lora.ATTENTION + lora.MLP + lora.UNEMBED)
    model.requires_grad_(False)
    a = lora.add_adapter(model, "ga", lora.AdapterConfig(rank=2, targets=lora.ATTENTION))
    b = lora.add_adapter(model, "gb", lora.AdapterConfig(rank=2, targets=lora.MLP))
    for p in (*a, *b):
        p.requires_grad_(True)
    with lora.using("ga"):
        model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in a)
    assert all(p.grad is None for p in b)
    assert all(p.grad is None for p in model.parameters())
