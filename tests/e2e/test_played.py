"""Played envs through the real `treadle run`: a `verifiers` environment and an OpenAI-client
agent train for a few steps on every service, exactly once."""

import json

import pytest

from tests.support.cli import treadle
from tests.support.services import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def run_summary(tmp_path, recipe: str, *overrides: str, env: dict) -> tuple[dict, list[dict]]:
    args = [a for o in overrides for a in ("--set", o)]
    result = treadle("run", str(ROOT / recipe), *args, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (run_dir,) = (tmp_path / ".treadle" / "runs").glob("*/")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def assert_trained_exactly_once(summary: dict, steps: int, trajectories: int) -> None:
    assert summary["state"] == "succeeded" and summary["steps"] == steps
    assert summary["exactly_once"] is True and summary["duplicates"] == 0
    assert summary["trajectories_produced"] == summary["trajectories_consumed"] == trajectories
    assert summary["trajectories_trained"] == trajectories and summary["dropped"] == {}
    assert len(summary["versions_published"]) == steps


SHORT_RUN = (
    "sft.steps=0",  # the warm-up is the recipe's; a few RL steps show the path
    "trainer.num_steps=3",
    "trainer.tasks_per_step=4",
    "rollout.group_size=4",
    "eval.num_tasks=16",
    "eval.every=0",
)
"""A verifiers recipe cut to 3 RL steps of 4 groups of 4 (48 trajectories), one evaluation
at each end."""


def test_a_verifiers_environment_trains_through_treadle_run(cli_env, tmp_path):
    summary, records = run_summary(
        tmp_path,
        "recipes/verifiers.yaml",
        *SHORT_RUN,
        env=cli_env,
    )
    assert_trained_exactly_once(summary, steps=3, trajectories=48)
    assert summary["eval_start"] is not None and summary["eval_end"] is not None
    steps = [r for r in records if r.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3]


def test_an_openai_client_agent_trains_through_treadle_run(cli_env, tmp_path):
    summary, records = run_summary(tmp_path, "recipes/openai_agent.yaml", env=cli_env)
    assert_trained_exactly_once(summary, steps=3, trajectories=48)
    steps = [r for r in records if r.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3]


def test_a_verifiers_v1_environment_trains_through_treadle_run(cli_env, tmp_path):
    """recipes/verifiers-v1.yaml: a taskset written for verifiers 0.4, played by workers in
    .venv-verifiers, trains on every service exactly once."""
    python = ROOT / ".venv-verifiers" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-verifiers (scripts/setup_verifiers.sh)")
    summary, records = run_summary(
        tmp_path,
        "recipes/verifiers-v1.yaml",
        *SHORT_RUN,
        env={**cli_env, "TREADLE_ENV_VERIFIERS_PYTHON": str(python)},
    )
    assert_trained_exactly_once(summary, steps=3, trajectories=48)
    assert summary["eval_start"] is not None and summary["eval_end"] is not None
    steps = [r for r in records if r.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3]
