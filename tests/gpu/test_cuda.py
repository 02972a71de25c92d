"""What only a GPU can check: the trainer's bf16 autocast, FSDP2 and megatron-core on NCCL,
and the hf rollout engine on CUDA. Skipped where torch sees no CUDA device (CI, the dev VM).

Run on a GPU machine: `pytest -m gpu tests/gpu` (self-contained: `--noconftest` works too).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
WORKER = Path(__file__).resolve().parents[1] / "support" / "fsdp_worker.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from treadle_cli.tiny_model import init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny")


def worker(model_dir: Path, out: Path, *options: str, ranks: int = 0) -> dict:
    """The fixed batch of `fsdp_worker.py` through one backend; its numbers."""
    cmd = [sys.executable, str(WORKER), str(model_dir), str(out), *options]
    if ranks:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd = [*torchrun, "--nproc-per-node", str(ranks), *cmd[1:]]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def test_trainer_on_cuda_fp32_matches_cpu_and_bf16_stays_close(model_dir, tmp_path):
    cpu = worker(model_dir, tmp_path / "cpu.json", "--device", "cpu")
    fp32 = worker(model_dir, tmp_path / "fp32.json", "--device", "cuda", "--fp32")
    bf16 = worker(model_dir, tmp_path / "bf16.json", "--device", "cuda")
    assert cpu["device"] == "cpu" and fp32["device"].startswith("cuda")
    for key in ("first", "second", "third"):
        assert fp32[key]["loss"] == pytest.approx(cpu[key]["loss"], rel=1e-4, abs=1e-6)
        assert bf16[key]["num_tokens"] == cpu[key]["num_tokens"] > 0
        # bf16 autocast: the same batch to 2-3 significant digits (H100: 1e-3), not bit-equal
        assert bf16[key]["loss"] == pytest.approx(cpu[key]["loss"], rel=1e-2)
    assert bf16["first"]["loss"] != fp32["first"]["loss"]
    assert fp32["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-4)
    assert bf16["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-2)
    # master weights and what is published / checkpointed stay fp32
    assert bf16["dtypes"] == fp32["dtypes"] == ["torch.float32"]
    # handed to the publisher in pinned host memory from CUDA, as a copy (restored equal)
    assert fp32["snapshot_pinned"] and bf16["snapshot_pinned"] and not cpu["snapshot_pinned"]
    assert fp32["restored_identical"] and bf16["restored_identical"]
    assert fp32["checksum"] == pytest.approx(cpu["checksum"], rel=1e-6)
    assert bf16["checksum"] == pytest.approx(cpu["checksum"], rel=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp2_on_nccl_matches_the_single_process_backend(model_dir, tmp_path, precision):
    """FSDP2 over NCCL on every GPU there is (one rank per GPU; NCCL refuses two ranks on one
    device) against the single-process backend: equal in fp32, close under bf16 mixed
    precision (FSDP casts parameters to bf16; the single process autocasts)."""
    options = ["--fp32"] if precision == "fp32" else []
    ranks = torch.cuda.device_count()
    single = worker(model_dir, tmp_path / "single.json", "--device", "cuda", *options)
    fsdp = worker(model_dir, tmp_path / "fsdp.json", "--fsdp", *options, ranks=ranks)
    assert fsdp["device"].startswith("cuda")
    rel = 1e-5 if precision == "fp32" else 1e-2
    for key in ("first", "second", "third"):
        assert fsdp[key]["num_tokens"] == single[key]["num_tokens"] > 0
        assert fsdp[key]["loss"] == pytest.approx(single[key]["loss"], rel=rel)
    assert fsdp["grad_norm"] == pytest.approx(single["grad_norm"], rel=rel)
    assert fsdp["checksum"] == pytest.approx(single["checksum"], rel=rel / 10)
    assert fsdp["meta_step"] == 1 and fsdp["dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_megatron_on_cuda_matches_the_single_process_backend(model_dir, tmp_path, precision):
    """megatron-core on CUDA (NCCL, tensor parallel over up to 2 GPUs: the tiny model has 2
    query groups) against the single-process backend on the same GPU batch."""
    options = ["--fp32"] if precision == "fp32" else []
    tp = min(torch.cuda.device_count(), 2)
    single = worker(model_dir, tmp_path / "single.json", "--device", "cuda", *options)
    mc = worker(model_dir, tmp_path / "mc.json", "--megatron", str(tp), *options, ranks=tp)
    assert mc["device"].startswith("cuda")
    rel = 1e-4 if precision == "fp32" else 1e-2
    for key in ("first", "second", "third"):
        assert mc[key]["num_tokens"] == single[key]["num_tokens"] > 0
        assert mc[key]["loss"] == pytest.approx(single[key]["loss"], rel=rel)
    assert mc["grad_norm"] == pytest.approx(single["grad_norm"], rel=rel)
    assert mc["restored_identical"] and mc["dtypes"] == ["torch.float32"]


def test_hf_engine_on_cuda_batches_with_exact_logprobs(model_dir):
    from treadle_rollout.engines.base import Sampling
    from treadle_rollout.engines.hf import HFEngine

    async def scenario():
        engine = HFEngine(model_dir, "tiny", device="cuda")
        tok = engine.tokenizer
        prompts = [tok(f"{i}+{i * 7}= what " * (1 + i % 3))["input_ids"] for i in range(6)]

        async def one(i: int):
            await asyncio.sleep(0.02 * i)  # later requests join a batch mid-decode
            return await engine.generate(prompts[i], Sampling(0.7, 1.0, 12 + i, seed=i))

        gens = await asyncio.gather(*(one(i) for i in range(6)))
        follow_up = prompts[0] + gens[0].tokens + prompts[1]  # a next turn: cached prefix
        again = await engine.generate(follow_up, Sampling(0.7, 1.0, 8, seed=9))
        await engine.close()
        return engine, prompts + [follow_up], gens + [again]

    engine, prompts, gens = asyncio.run(scenario())
    assert next(engine.model.parameters()).device.type == "cuda"
    assert engine.stats()["prefix_cache_hit_fraction"] > 0
    for prompt, gen in zip(prompts, gens, strict=True):
        assert len(gen.tokens) == len(gen.logprobs) > 0
        ids = torch.tensor([prompt + gen.tokens], device="cuda")
        with torch.no_grad():
            logits = engine.model(ids).logits[0].float()
        logprobs = torch.log_softmax(logits / 0.7, dim=-1)
        reference = [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(gen.tokens)]
        assert gen.logprobs == pytest.approx(reference, abs=1e-3)
