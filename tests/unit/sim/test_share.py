"""`treadle sim share`: runs sharing one fleet's rollout slots under rollout's own FairShare,
in simulated time: weights divide the slot-seconds, a slow run pays for its time, a higher
priority goes first, the same seed gives the same run, and the simulation is driving the
service's scheduling code (a change to it changes the result)."""

from __future__ import annotations

import json

import pytest

from tests.support.services import ROOT
from treadle_common.fleet import scheduling
from treadle_sim import share

pytestmark = pytest.mark.unit


def fleet(
    *runs: dict, replicas: int = 4, slots: int = 4, horizon_s: float = 1200
) -> share.SharedFleet:
    return share.SharedFleet(
        name="test", replicas=replicas, slots=slots, horizon_s=horizon_s, runs=list(runs)
    )


def level_shares(result: dict, policy: str) -> dict[str, float]:
    return {k: v["level_share"] for k, v in result["policies"][policy]["runs"].items()}


def test_weights_divide_the_slot_seconds_under_fair_share_and_not_under_fifo():
    two_to_one = fleet(
        {"name": "a", "weight": 2, "task_s": 10, "task_sigma": 0.3},
        {"name": "b", "weight": 1, "task_s": 10, "task_sigma": 0.3},
    )
    result = share.compare(two_to_one, ["fair", "fifo"])
    fair, fifo = level_shares(result, "fair"), level_shares(result, "fifo")
    assert fair["a"] == pytest.approx(2 / 3, abs=0.03) and fair["b"] == pytest.approx(
        1 / 3, abs=0.03
    )
    assert fifo["a"] == pytest.approx(1 / 2, abs=0.03)  # first come, first served: by count
    assert result["policies"]["fair"]["jain"]["0"] > 0.99 > result["policies"]["fifo"]["jain"]["0"]
    for policy in ("fair", "fifo"):  # both runs always have work: no slot idles
        assert result["policies"][policy]["utilisation"] > 0.99


def test_a_run_with_slow_tasks_pays_for_their_time_not_their_count():
    slow_tools = fleet(
        {"name": "fast", "task_s": 10},
        {"name": "slow", "task_s": 40},
        horizon_s=3000,
    )
    result = share.compare(slow_tools, ["fair", "fifo"])
    fair, fifo = level_shares(result, "fair"), level_shares(result, "fifo")
    assert fair["slow"] == pytest.approx(1 / 2, abs=0.05)
    assert fifo["slow"] > 0.7  # about as many tasks as the other, each four times as long
    runs = result["policies"]["fair"]["runs"]
    assert runs["fast"]["tasks"] == pytest.approx(4 * runs["slow"]["tasks"], rel=0.15)


def test_a_higher_priority_sync_run_plays_its_steps_first():
    with_eval = fleet(
        {"name": "train", "task_s": 30},
        {"name": "eval", "priority": 1, "task_s": 10, "tasks_per_step": 12, "train_s": 20},
    )
    result = share.compare(with_eval, ["fair", "fifo"])
    fair = result["policies"]["fair"]["runs"]["eval"]
    fifo = result["policies"]["fifo"]["runs"]["eval"]
    # no task is preempted: a step's tasks wait for slots to free either way, but under
    # strict priority each slot that frees is theirs; first come, first served they queue
    # behind the other run's ready 30 s tasks
    assert fair["play_s_mean"] < 0.75 * fifo["play_s_mean"]
    assert fair["steps"] > fifo["steps"]


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    tails = fleet(
        {"name": "a", "task_s": 10, "task_sigma": 1.0},
        {"name": "b", "weight": 3, "task_s": 20, "task_sigma": 1.0},
    )
    first, again = share.compare(tails, ["fair"], seed=1), share.compare(tails, ["fair"], seed=1)
    assert first == again
    assert share.compare(tails, ["fair"], seed=2) != first


def test_it_runs_rollouts_own_scheduling(monkeypatch):
    """The slots go where `treadle_rollout`'s FairShare and the policy it asks say: a
    policy that no longer charges what it grants (every pick the least run id, as if no
    run were ever served) changes what the simulation gives each run."""
    two_to_one = fleet(
        {"name": "a", "weight": 2, "task_s": 10},
        {"name": "b", "weight": 1, "task_s": 10},
    )
    assert level_shares(share.compare(two_to_one, ["fair"]), "fair")["a"] == pytest.approx(
        2 / 3, abs=0.03
    )
    monkeypatch.setattr(scheduling.WeightedFairShare, "charge", lambda self, claim, cost: None)
    assert level_shares(share.compare(two_to_one, ["fair"]), "fair")["a"] > 0.95


def test_a_scenario_with_two_runs_of_one_name_is_refused():
    with pytest.raises(ValueError, match="distinct"):
        fleet({"name": "a", "task_s": 1}, {"name": "a", "task_s": 2})


def test_the_command_runs_its_default_scenario_and_refuses_an_unknown_policy(tmp_path):
    from typer.testing import CliRunner

    from treadle_sim.cli import SCENARIOS, app

    assert share.load(SCENARIOS / "shared" / "fleet-1000.yaml").replicas * 4 == 1000
    small = tmp_path / "small.yaml"
    small.write_text(
        "name: small\nreplicas: 2\nslots: 2\nhorizon_s: 100\n"
        "runs: [{name: a, task_s: 5}, {name: b, weight: 3, task_s: 5}]\n"
    )
    result = CliRunner().invoke(app, ["share", str(small), "--policy", "fair", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert list(out["policies"]) == ["fair"] and out["slots"] == 4
    assert out["policies"]["fair"]["runs"]["b"]["entitled"] == 0.75
    result = CliRunner().invoke(app, ["share", str(small), "--policy", "lottery"])
    assert result.exit_code == 2 and "--policy" in result.output, result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nreplicas: 0\nhorizon_s: 1\nruns: []\n")
    result = CliRunner().invoke(app, ["share", str(bad)])
    assert result.exit_code == 2 and "replicas" in result.output, result.output


@pytest.mark.parametrize("path", sorted((ROOT / "sim/scenarios/shared").glob("*.yaml")), ids=str)
def test_every_shared_fleet_scenario_in_the_repo_loads(path):
    assert share.load(path).name == path.stem
