"""The `vllm` engine on a real pretrained model: SmolLM2-135M-Instruct imported from its GGUF
file (49k vocabulary, its own chat template), as `recipes/smollm2.yaml` serves it. Its
greedy answers to the recipe's chat-templated questions are transformers' greedy answers,
with transformers' logprobs; a LoRA run's versions (the base, then rank-16 adapters on the
attention and MLP projections, as the recipe trains) come from a real weight-store and give
the logprobs the `treadle_common.model.lora` layers give.

The import runs in `.venv` (`treadle model import`: the GGUF reader is in its lock, not in
vLLM's venv); `make test` builds both venvs before this runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tests.support.reference import teacher_forced_logprobs  # noqa: E402
from tests.support.services import ROOT  # noqa: E402
from tests.support.weight_store import (  # noqa: E402
    start_weight_store,
    stop_weight_store,
    swap_in_adapter,
)
from treadle_common.model import lora  # noqa: E402
from treadle_rollout.engines.base import Sampling  # noqa: E402
from treadle_rollout.engines.vllm import VLLMEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

QUESTION = "Calculate {a}+{b}. Give only the final number, nothing else."  # the recipe's
PROBLEMS = [(3, 4), (12, 9), (25, 17), (8, 21)]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """The imported model's directory (the checkout's `.cache`: the import is reused when the
    same GGUF file is imported into it again)."""
    cli = ROOT / ".venv" / "bin" / "treadle"
    assert cli.exists(), "the import needs .venv (make setup): its lock holds the GGUF reader"
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from get_smollm2 import get
    finally:
        sys.path.pop(0)
    gguf = get(ROOT / ".cache" / "models")
    out = ROOT / ".cache" / "models" / "smollm2-imported"
    env = {**os.environ, "TREADLE_STATE_DIR": str(tmp_path_factory.mktemp("state"))}
    done = subprocess.run(
        [str(cli), "model", "import", str(gguf), "smollm2", "--out", str(out), "--no-publish"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def chat_prompt(tokenizer, a: int, b: int) -> list[int]:
    messages = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def test_vllm_serves_the_imported_model_and_its_lora_versions(smollm2, tmp_path):
    server, client = await start_weight_store(tmp_path / "ws")
    engine = VLLMEngine(
        smollm2,
        "smollm2",
        max_context=512,
        kv_cache_gb=1,
        dtype="float32",
        max_lora_rank=16,
        adapter_dir=tmp_path / "adapters",
    )
    try:
        await engine.start()
        tokenizer = AutoTokenizer.from_pretrained(smollm2)
        assert tokenizer.chat_template and tokenizer.vocab_size == 49152
        hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
        prompts = [chat_prompt(tokenizer, a, b) for a, b in PROBLEMS]
        greedy = Sampling(0.0, 1.0, 12)
        answers = [await engine.generate(p, greedy) for p in prompts]
        for prompt, answer in zip(prompts, answers, strict=True):
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[
                    0, len(prompt) :
                ].tolist()
            # the same greedy answer (up to an end token transformers appends after EOS)
            assert answer.tokens == want[: len(answer.tokens)]
            assert answer.logprobs == pytest.approx(
                teacher_forced_logprobs(hf, prompt, answer.tokens), abs=2e-2
            )
        assert any(tokenizer.decode(a.tokens).strip() for a in answers)

        # a LoRA run: the base published once, then adapter versions on it
        base_state = {k: v.clone() for k, v in hf.state_dict().items()}
        base_version = await client.publish(base_state, "smollm2", step=0)
        lora.inject(hf, lora.ATTENTION + lora.MLP)
        config = lora.AdapterConfig(rank=16, alpha=32.0, targets=lora.ATTENTION + lora.MLP)
        params = lora.add_adapter(hf, "policy", config)
        with torch.no_grad():
            for p in params:
                p.normal_(0, 0.02)
        tensors = lora.adapter_state(hf, "policy")
        adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        model_bytes = sum(t.numel() * t.element_size() for t in base_state.values())
        assert adapter_bytes < model_bytes / 10  # a version moves the adapter, not the model
        version = await swap_in_adapter(
            engine, client, "smollm2", tensors, config, (str(smollm2), base_version)
        )
        sampled = Sampling(1.0, 1.0, 12, seed=0)
        for prompt in prompts[:2]:
            got = await engine.generate(prompt, sampled)
            assert set(got.versions) == {version}
            with lora.using("policy"):
                want = teacher_forced_logprobs(hf, prompt, got.tokens)
            base = teacher_forced_logprobs(hf, prompt, got.tokens)
            assert got.logprobs == pytest.approx(want, abs=2e-2)
            # the adapter, not the base, scored them
            assert max(abs(a - b) for a, b in zip(want, base, strict=True)) > 0.05
    finally:
        await engine.close()
        await stop_weight_store(server, client)
