"""`treadle sim`: deterministic per seed, and driving Treadle's own admission code (its Lua
script, in an in-process Redis): sync mode never starts a step's groups before the replica
holds the step's weights, async never generates what the staleness bound forbids, and
replacing the script changes what the simulation does."""

from __future__ import annotations

import pytest

from tests.support.services import ROOT
from treadle_common.fleet import admission
from treadle_sim import engine
from treadle_sim.scenario import load

pytestmark = pytest.mark.unit


@pytest.fixture
def scenario():
    small = load(ROOT / "sim/scenarios/small.yaml")
    return small.model_copy(update={"run": small.run.model_copy(update={"steps": 4})})


def test_the_same_seed_simulates_the_same_run_and_another_seed_another(scenario):
    a, b = engine.compare(scenario, seed=0), engine.compare(scenario, seed=0)
    assert a == b
    assert engine.compare(scenario, seed=1)["async"] != a["async"]


def test_sync_trains_only_fresh_groups_because_admission_holds_replicas_back(scenario):
    out = engine.Simulation(scenario, "sync").run().summary()
    trained = scenario.run.steps * scenario.run.tasks_per_step * scenario.run.group_size
    assert out["staleness_histogram"] == [trained]  # every trajectory at staleness 0
    assert out["dropped"] == {}
    assert out["admission_refused"] > 0  # replicas asked before they held the weights


def test_async_stays_within_its_staleness_bound_and_overlaps(scenario):
    result = engine.compare(scenario)
    histogram = result["async"]["staleness_histogram"]
    assert len(histogram) - 1 <= scenario.run.max_staleness and histogram[-1] > 0
    assert result["speedup"] > 1.0  # generation went on while the trainer trained
    assert result["async"]["rollout_utilisation"] > result["sync"]["rollout_utilisation"]


def test_keeping_stale_trajectories_trains_what_admission_let_start(scenario):
    """The trainer's own `stale_trajectories`: with a heavier length tail, `drop` drops
    long responses that finish past the bound; `keep` trains all of them (the bound held
    only when they started), some of them past it."""
    tail = scenario.lengths.model_copy(update={"response_sigma": 1.0})

    def run(stale: str) -> dict:
        run_spec = scenario.run.model_copy(update={"stale_trajectories": stale})
        varied = scenario.model_copy(update={"run": run_spec, "lengths": tail})
        return engine.Simulation(varied, "async").run().summary()

    dropped, kept = run("drop"), run("keep")
    assert dropped["dropped"].get("stale", 0) > 0
    assert len(dropped["staleness_histogram"]) - 1 <= scenario.run.max_staleness
    assert kept["dropped"] == {}
    assert len(kept["staleness_histogram"]) - 1 > scenario.run.max_staleness


def test_the_simulation_runs_the_real_admission_script(scenario, monkeypatch):
    """An admission that lets every group start: sync replicas then generate with the
    weights before the step's, and the trainer's own staleness check drops them."""
    monkeypatch.setattr(admission, "_ADMIT", "redis.call('HINCRBY', KEYS[1], 'x', 1) "
                        "return {1, 0}")  # fmt: skip
    out = engine.Simulation(scenario, "sync").run().summary()
    assert out["dropped"].get("stale", 0) > 0 and out["admission_refused"] == 0


def test_a_colocated_baseline_gives_the_sync_run_every_gpu_in_both_roles(scenario):
    scenario = scenario.model_copy(update={"baseline": "colocated", "colocated_resync_s": 2.0})
    both = scenario.colocated()
    assert both.rollout.replicas == scenario.gpus and both.trainer.gpus == scenario.gpus
    result = engine.compare(scenario)
    assert result["baseline"] == "colocated"
    assert result["sync"]["weight_sync_s_mean"] == pytest.approx(2.0)  # in place, as given
    # twice the replicas and trainer GPUs: the colocated sync run is faster than the pools'
    assert result["sync"]["wall_s"] < engine.compare(scenario.model_copy(
        update={"baseline": "disaggregated"}))["sync"]["wall_s"]  # fmt: skip


def test_publishing_every_k_steps_syncs_weights_a_kth_as_often(scenario):
    run = scenario.run.model_copy(update={"publish_every": 2, "max_staleness": 2})
    every_2 = scenario.model_copy(update={"run": run})
    out = engine.Simulation(every_2, "async").run()
    every_1 = engine.Simulation(scenario, "async").run()
    # the run ends with its last step, before the last publish reaches the replicas
    assert len(every_1.weight_sync_s) == scenario.run.steps - 1
    assert len(out.weight_sync_s) == scenario.run.steps // 2 - 1
    with pytest.raises(ValueError, match="sync mode publishes every step"):
        engine.Simulation(every_2, "sync")


def test_a_decode_step_reads_the_running_contexts(scenario):
    """With a KV read per context token, the same run decodes more slowly."""
    rollout = scenario.rollout.model_copy(update={"decode_s_per_context_token": 1e-5})
    reading = scenario.model_copy(update={"rollout": rollout})
    plain = engine.Simulation(scenario, "sync").run()
    slower = engine.Simulation(reading, "sync").run()
    assert slower.wall_s > plain.wall_s


@pytest.mark.parametrize("path", sorted((ROOT / "sim/scenarios").glob("*.yaml")), ids=str)
def test_every_scenario_in_the_repo_loads(path):
    scenario = load(path)
    assert scenario.name == path.stem
