"""A stack whose rollout runs on the `vllm` engine trains the real model by RL: rollout under
the vLLM venv's Python (`TREADLE_ROLLOUT_PYTHON`, `TREADLE_ROLLOUT_ENGINE=vllm`), the other
services in `.venv`, two steps of `recipes/smollm2.yaml` on SmolLM2-135M-Instruct imported
from GGUF: each step's LoRA adapter published to the weight store and served by vLLM.

`make test-vllm` runs it after it has built `.venv-vllm` (the main suite deselects `vllm`)."""

from __future__ import annotations

import pytest

from tests.support.cli import TWO_STEPS, import_model, run_recipe, run_rows
from tests.support.services import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.timeout(1500)
def test_rl_on_the_real_model_with_rollout_on_vllm(smollm2_gguf, cli_env, tmp_path):
    assert VLLM_PYTHON.exists(), "scripts/setup_vllm.sh builds .venv-vllm (make test-vllm)"
    out = tmp_path / "models" / "smollm2"
    import_model(smollm2_gguf, "smollm2", out, cli_env, tmp_path)
    env = {
        **cli_env,
        "TREADLE_ROLLOUT_PYTHON": str(VLLM_PYTHON),
        "TREADLE_ROLLOUT_ENGINE": "vllm",
        "TREADLE_ROLLOUT_VLLM_DTYPE": "float32",
        "TREADLE_ROLLOUT_VLLM_MAX_LORA_RANK": "16",  # the recipe's adapters
        "TREADLE_ROLLOUT_MAX_CONTEXT": "512",
    }
    overrides = {
        **TWO_STEPS,
        "model.path": str(out),
        "eval.num_tasks": "8",
        "eval.every": "0",
    }
    result = run_recipe(ROOT / "recipes/smollm2.yaml", overrides, env, tmp_path, 1400)
    logs = tmp_path / ".treadle" / "logs"
    rollout_log = "".join(p.read_text(errors="replace") for p in logs.glob("rollout*"))
    assert result.returncode == 0, (
        result.stdout[-3000:] + result.stderr[-3000:] + rollout_log[-4000:]
    )
    # rollout served with vLLM (its engine core's own log lines), from the vLLM venv
    assert "vllm" in rollout_log.lower() and "EngineCore" in rollout_log, rollout_log[-2000:]
    summary, rows = run_rows(tmp_path)
    assert summary["exactly_once"] and summary["steps"] == 2, summary
    steps = [r for r in rows if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["num_trajectories"] == 4 for s in steps), steps
    # vLLM swapped in the trained adapters: the last evaluation ran on a later version
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [e["phase"] for e in evals] == ["start", "end"], evals
    assert min(evals[1]["policy_versions"]) > max(evals[0]["policy_versions"]), evals
