"""`treadle model import SRC NAME`: a model from outside becomes one the stack serves and
trains, published to the weight store once."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.support.cli import TWO_STEPS, import_model, run_recipe, run_rows, treadle
from tests.support.services import ROOT
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.model.importing import RECORD

pytestmark = [pytest.mark.e2e]


def versions(address: str, model: str) -> list[int]:
    async def go() -> list[int]:
        client = WeightStoreClient(address, token=os.environ["TREADLE_TOKEN"])
        try:
            return [v.version for v in await client.list_versions(model)]
        finally:
            await client.close()

    return asyncio.run(go())


def test_an_hf_directory_imports_and_publishes_once(weight_store, tiny_model, tmp_path):
    store = weight_store
    out = tmp_path / "imported"
    args = ("model", "import", str(tiny_model), "tiny-imported", "--out", str(out))
    first = treadle(*args, "--store", store.grpc_addr, env=dict(os.environ), cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "wrote" in first.stdout and "tiny-imported@1 published" in first.stdout
    record = json.loads((out / RECORD).read_text())
    assert record["kind"] == "hf" and record["architecture"] == "LlamaForCausalLM"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # again: the directory is reused and the store already holds exactly it
    again = treadle(*args, "--store", store.grpc_addr, env=dict(os.environ), cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "reused" in again.stdout and "tiny-imported@1 (already in the store)" in again.stdout
    assert versions(store.grpc_addr, "tiny-imported") == [1]
    # what is not a model, a bad name, a directory holding another import: refused, exit 2
    (tmp_path / "empty").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / RECORD).write_text(json.dumps({"source": "elsewhere", "source_digest": "0"}))
    refused = {
        "no model": ("model", "import", str(tmp_path / "empty"), "x", "--no-publish"),
        "bad name": ("model", "import", str(tiny_model), "no/slash", "--no-publish"),
        "other import": ("model", "import", str(tiny_model), "y", "--out", str(other)),
    }
    for why, command in refused.items():
        answer = treadle(*command, env=dict(os.environ), cwd=tmp_path)
        assert answer.returncode == 2, (why, answer.stdout, answer.stderr)
    assert "config.json" in treadle(*refused["no model"], env=dict(os.environ), cwd=tmp_path).stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_gguf_model_imports_exactly_and_trains_by_rl_end_to_end(smollm2_gguf, cli_env, tmp_path):
    """The real model: imported from GGUF (dequantised, the same logits as transformers'
    own GGUF load), then two RL steps of `recipes/smollm2.yaml` (LoRA) on a stack serving it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "models" / "smollm2"
    import_model(smollm2_gguf, "smollm2", out, cli_env, tmp_path)
    record = json.loads((out / RECORD).read_text())
    assert record["kind"] == "gguf" and record["architecture"] == "LlamaForCausalLM"
    assert record["parameters"] == 134_515_008 and record["vocab_size"] == 49152
    assert record["chat_template"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    question = [{"role": "user", "content": "What is 47+38? Answer with the number only."}]
    ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    gguf = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(gguf(ids).logits, model(ids).logits)
    del gguf, model
    # two RL steps on the stack, the model served and trained (a LoRA adapter) as imported
    overrides = {
        **TWO_STEPS,
        "model.path": str(out),
        "eval.num_tasks": "0",  # no evaluation: the run publishes the base itself
    }
    result = run_recipe(ROOT / "recipes/smollm2.yaml", overrides, cli_env, tmp_path, 1100)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary, rows = run_rows(tmp_path)
    assert summary["exactly_once"] and summary["steps"] == 2
    steps = [r for r in rows if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["num_trajectories"] == 4 for s in steps), steps
