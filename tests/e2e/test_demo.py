"""`make demo`'s recipe, run for real: it must learn on problems it never trained on."""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tests.conftest import ROOT
from tests.e2e.test_cli import cli_env, treadle  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_recipe_raises_held_out_reward_and_writes_its_outputs(cli_env, tmp_path):  # noqa: F811
    result = treadle("run", str(ROOT / "recipes/demo.yaml"), env=cli_env, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (run_dir,) = (tmp_path / ".treadle" / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exactly_once"] and summary["steps"] == 40
    evals = summary["eval"]
    assert evals["start"] == 0.0  # a random model answers no sum right
    assert evals["end"] - evals["start"] >= 0.3, evals
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = [r["phase"] for r in rows if r["kind"] == "eval"]
    assert phases == ["start", "after_sft", "step 10", "step 20", "step 30", "end"]
    assert len([r for r in rows if r["kind"] == "sft"]) == 150
    steps = [r for r in rows if r["kind"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, 41))
    assert all(s["max_staleness"] == 0 for s in steps)  # sync mode
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    init_version = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["init_version"]
    assert init_version is not None and init_version < summary["versions_published"][0]
    # the exported final weights are the last published version, loadable by transformers
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final-model")
    init = AutoModelForCausalLM.from_pretrained(run_dir / f"init-v{init_version}")
    moved = [
        not torch.equal(a, b) for a, b in zip(model.parameters(), init.parameters(), strict=True)
    ]
    assert any(moved)
