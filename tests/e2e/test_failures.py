"""Rollout failure semantics on a real stack: `treadle run` of the skeleton recipe with faults
injected in the env-gateway (session option `faults`), every service its own process."""

import json

import pytest

from tests.support.cli import run_recipe, run_rows
from tests.support.services import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SKELETON = ROOT / "recipes/skeleton.yaml"
ARITH = {"max_operand": 9, "ops": ["+"]}


def _with_faults(faults: list[dict] | dict, **failures: str) -> dict[str, str]:
    options = json.dumps({**ARITH, "faults": faults})
    return {"env.options": options, **{f"rollout.failures.{k}": v for k, v in failures.items()}}


def test_failed_episodes_are_played_again_or_their_group_is_quarantined_whole(cli_env, tmp_path):
    """A tenth of the episodes fail every attempt; every other one fails its first. Each
    step still trains 4 whole groups of 4: the retried episodes rejoin their groups, and a
    group with an episode that failed 3 times never reaches the trainer (it is quarantined,
    its task dead-lettered and replaced), so no step trains a group on its survivors."""
    faults = [{"fail_first": 99, "rate": 0.1}, {"fail_first": 1}]
    done = run_recipe(SKELETON, _with_faults(faults), cli_env, tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary, rows = run_rows(tmp_path)
    steps = [r for r in rows if r["kind"] == "step"]
    assert summary["state"] == "succeeded" and len(steps) == 3
    assert [s["num_trajectories"] for s in steps] == [16, 16, 16]
    assert summary["trajectories_trained"] == 48
    quarantined_groups = summary["dead_lettered"]["episodes_failed"]
    assert quarantined_groups >= 1
    assert 1 * quarantined_groups <= summary["trajectories_quarantined"] <= 4 * quarantined_groups
    assert summary["trajectories_quarantined"] + summary["trajectories_discarded"] == (
        4 * quarantined_groups
    )
    # nothing failed reached the trainer: it dropped no member for its status or its group
    assert not {"env_error", "group_incomplete"} & set(summary["dropped"])
    assert summary["tasks_dead"] == quarantined_groups  # no other task given up on
    assert summary["tasks_fed"] == 12 + quarantined_groups  # each replaced once
    assert summary["broken_envs"] == {} and summary["exactly_once"] is True


def test_an_env_that_keeps_failing_is_circuit_broken_and_the_run_fails_with_why(cli_env, tmp_path):
    """Every episode fails every attempt: after 8 failed episodes the env's breaker opens for
    the run; the run fails at once (not at its batch timeout), saying which env and why."""
    overrides = _with_faults({"fail_first": 99}, breaker_window="8", episode_retries="1")
    overrides["trainer.batch_timeout_s"] = "240"
    done = run_recipe(SKELETON, overrides, cli_env, tmp_path, timeout=400)
    assert done.returncode != 0
    summary, _ = run_rows(tmp_path)
    assert summary["state"] == "failed" and summary["steps"] == 0
    why = summary["broken_envs"]["arith"]
    assert why.startswith("8 of its last 8 episodes failed; the last: env_error:")
    assert "injected fault" in why
    assert summary["error"].startswith("EnvCircuitOpen: env 'arith' is circuit-broken")
    assert summary["trajectories_produced"] == 0  # no failed group reached the trainer
    assert summary["trajectories_quarantined"] >= 8
    assert "circuit-broken" in done.stdout + done.stderr
