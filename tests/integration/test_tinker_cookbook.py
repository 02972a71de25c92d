"""The Tinker Cookbook's RL training loop (`tinker_cookbook.rl.train`, tinker-cookbook 0.5.8
pinned in scripts/setup_cookbook.sh) runs unchanged against a Treadle stack on a tiny
arithmetic task (`tests/support/cookbook_rl_loop.py`), and its reward rises.

The cookbook pins transformers below what Treadle runs, so it lives in its own virtualenv
(.venv-cookbook, built by `make test`), a client of the stack this test starts, as a
researcher's script is. The tiny random model starts near 0 reward (digits are rare among
its tokens); the loop's LoRA (rank 8) importance-sampling updates raise it. Measured over 6
runs of these settings (learning rate 2e-3): the mean reward of the first 10 iterations
0.011-0.033, of the last 10 0.089-0.225. At 5e-3 a run could collapse to 0 reward for a
dozen iterations after its first gains, and one of 3 ended below its start.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

import pytest

from tests.support.services import TOKENS
from tests.support.tinker_stack import tinker_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-cookbook" / "bin" / "python"
ITERATIONS = 40


@pytest.mark.skipif(not PYTHON.exists(), reason="no .venv-cookbook (scripts/setup_cookbook.sh)")
def test_the_cookbook_rl_loop_raises_the_reward(infra, tmp_path, tiny_model):
    # the Tinker name of the base model is its directory: the cookbook loads the tokenizer
    # by model name (`get_tokenizer`), which finds a local directory without a hub
    model = str(tiny_model)
    with tinker_stack(
        infra, tmp_path, tiny_model, max_clients=None, name=model, rollout_name=None
    ) as (trainer, _, _):
        env = {
            **os.environ,
            "TINKER_API_KEY": "tml-" + TOKENS["trainer"],
            "TINKER_TELEMETRY": "0",
            "PYTHONPATH": "",
        }
        run = subprocess.run(
            [
                str(PYTHON),
                str(ROOT / "tests" / "support" / "cookbook_rl_loop.py"),
                *("--base-url", trainer.http, "--model", model),
                *("--log-path", str(tmp_path / "cookbook"), "--iterations", str(ITERATIONS)),
                *("--seed", "0"),  # every sample seeded: the same run every time
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "cookbook" / "metrics.jsonl").open()]
    rewards = [row["env/all/reward/total"] for row in rows if "env/all/reward/total" in row]
    assert len(rewards) == ITERATIONS
    print("rewards", json.dumps(rewards))
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last >= first + 0.04 and last >= 2 * first, rewards
    # the loop's final checkpoint: state and sampler weights, as tinker:// paths
    saved = [json.loads(line) for line in (tmp_path / "cookbook" / "checkpoints.jsonl").open()]
    assert saved and saved[-1]["name"] == "final"
    assert saved[-1]["state_path"].startswith("tinker://")
    assert saved[-1]["sampler_path"].startswith("tinker://")
