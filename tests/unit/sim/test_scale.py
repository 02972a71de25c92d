"""`treadle sim scale`: a scenario grown in proportion, with one weight store: the store's
egress is what saturates first when every replica fetches from it, and a relay or a
broadcast fan-out keeps a version's sync time flat as the fleet grows."""

from __future__ import annotations

import json

import pytest

from tests.support.services import ROOT
from treadle_sim import scale
from treadle_sim.scenario import load

pytestmark = pytest.mark.unit


@pytest.fixture
def small():
    return load(ROOT / "sim/scenarios/small.yaml")


def test_every_pool_and_the_step_grow_in_proportion(small):
    big = scale.scaled(small, 64, steps=5)
    assert big.gpus == 64 and big.rollout.replicas == 32 and big.trainer.gpus == 32
    assert big.run.tasks_per_step == 128 and big.reward.replicas == 16
    assert big.run.steps == 5 and big.weights == small.weights  # the one store, unchanged
    k4 = small.model_copy(update={"run": small.run.model_copy(update={"publish_every": 2})})
    assert scale.scaled(k4, 16, steps=5).run.steps == 4  # whole publishing periods


def test_the_store_saturates_first_when_every_replica_fetches_from_it(small):
    narrow = small.model_copy(
        update={"weights": small.weights.model_copy(update={"store_egress_gbps": 5})}
    )
    out = scale.sweep(narrow, [8, 128], steps=4)["sizes"]
    assert out[0]["first_saturating"] is None, out[0]["utilisation"]
    assert out[1]["first_saturating"] == "store_egress", out[1]["utilisation"]
    assert out[1]["tokens_per_gpu_vs_first"] < 0.9  # the fleet stalls on its weights
    relayed = narrow.model_copy(
        update={"weights": narrow.weights.model_copy(update={"fanout": "relay"})}
    )
    fine = scale.at(relayed, 128, steps=4)
    assert fine["first_saturating"] is None, fine["utilisation"]
    assert fine["trained_tokens_per_s"] > out[1]["trained_tokens_per_s"]


def test_relay_and_broadcast_keep_a_versions_sync_flat_as_the_store_alone_grows(small):
    few, many = scale.weight_sync(small, 4), scale.weight_sync(small, 400)
    for model in ("7b", "235b"):
        assert many[model]["store"]["sync_s"] > 50 * few[model]["store"]["sync_s"]
        for fanout in ("relay", "broadcast"):
            assert many[model][fanout]["sync_s"] < 2 * few[model][fanout]["sync_s"]
            assert many[model][fanout]["store_egress_s"] == few[model][fanout]["store_egress_s"]
    assert few["235b"]["relay"]["sync_s"] > 30 * few["7b"]["relay"]["sync_s"]


def test_the_command_refuses_sizes_it_cannot_read():
    from typer.testing import CliRunner

    from treadle_sim.cli import app

    small = str(ROOT / "sim/scenarios/small.yaml")
    for bad in ("1000,many", "0", ""):  # and below, a fan-out it does not know
        result = CliRunner().invoke(app, ["scale", small, "--gpus", bad])
        assert result.exit_code == 2 and "--gpus" in result.output, result.output
    result = CliRunner().invoke(app, ["scale", small, "--fanout", "carrier-pigeon"])
    assert result.exit_code == 2 and "--fanout" in result.output, result.output


def test_the_command_runs_with_its_default_scenario_and_the_fanout_asked_for():
    """As the issue's acceptance runs it (no scenario), and with a fan-out that overrides
    the scenario's: the output says which one the runs used."""
    from typer.testing import CliRunner

    from treadle_sim.cli import SCENARIOS, app

    assert (SCENARIOS / "verl-fully-async-128.yaml").is_file()
    small_file = str(ROOT / "sim/scenarios/small.yaml")
    result = CliRunner().invoke(
        app, ["scale", small_file, "--gpus", "8", "--steps", "2", "--fanout", "relay", "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["fanout"] == "relay" and out["sizes"][0]["gpus"] == 8
    sync = out["sizes"][0]["weight_sync_s"]["7b"]["relay"]
    assert sync["sync_s_per_step"] == sync["sync_s"]  # small publishes every step


def test_the_control_planes_load_is_the_runs_traffic_at_the_measured_costs(small):
    """Redis, NATS and the trainer's ingest: the groups, trajectories and bytes a run moved,
    at `Infra`'s per-unit costs, over its wall; their load grows with the fleet."""
    from treadle_sim.engine import Simulation
    from treadle_sim.scenario import Costs

    only_ingest = small.infra.model_copy(
        update={
            "ingest": Costs(s_per_task=0.0, s_per_trajectory=0.01, s_per_kib=0.0),
            "redis": Costs(s_per_task=0.002, s_per_trajectory=0.0, s_per_kib=0.0),
        }
    )
    sc = small.model_copy(update={"infra": only_ingest})
    out = Simulation(sc, "async", 0).run()
    summary = out.summary()
    assert out.groups >= sc.run.tasks_per_step * sc.run.steps
    assert out.trajectories == out.groups * sc.run.group_size
    assert summary["ingest_utilisation"] == round(out.trajectories * 0.01 / out.wall_s, 4)
    assert summary["redis_utilisation"] == round(out.groups * 0.002 / out.wall_s, 4)
    assert out.generated_tokens > out.trajectories * sc.lengths.response_max / 100
    two = sc.infra.model_copy(update={"ingest_processes": 2})
    halved = Simulation(sc.model_copy(update={"infra": two}), "async", 0).run().summary()
    assert halved["ingest_utilisation"] == pytest.approx(summary["ingest_utilisation"] / 2, 1e-3)
    sweep = scale.sweep(sc, [8, 32], steps=4)
    small_u, big_u = (row["utilisation"]["ingest"] for row in sweep["sizes"])
    assert 3 < big_u / small_u < 5  # four times the fleet, four times the traffic
    assert sweep["first_saturating"] == "ingest"
    assert sweep["saturates_at_gpus"]["ingest"] < sweep["saturates_at_gpus"]["redis"]


def test_a_component_saturates_where_the_line_through_two_sizes_crosses_0_9():
    rows = [
        {
            "gpus": 100,
            "utilisation": {"store_egress": 0.3, "redis": 0.01, "nats": 0.0, "ingest": 0.2},
        },
        {
            "gpus": 200,
            "utilisation": {"store_egress": 0.3, "redis": 0.02, "nats": 0.0, "ingest": 1.2},
        },
    ]
    got = scale.saturation(rows)
    assert got["ingest"] == 170  # reached at 200: between 100 (0.2) and 200 (1.2)
    assert got["redis"] == 9000  # not reached: carried on along 100 -> 200
    assert got["store_egress"] is None and got["nats"] is None  # does not grow / idle
    assert list(got)[:2] == ["ingest", "redis"]  # soonest first
    assert scale.saturation(rows[:1])["store_egress"] == 300  # one size: in proportion


def test_the_command_takes_the_control_planes_costs_from_a_capacity_bench(tmp_path):
    from typer.testing import CliRunner

    from treadle_sim.cli import app

    small_file = str(ROOT / "sim/scenarios/small.yaml")
    costs = {"s_per_task": 0.0, "s_per_trajectory": 0.02, "s_per_kib": 0.0}
    bench = {"bench": "capacity", "infra": {"ingest": costs}}
    measured = tmp_path / "capacity.json"
    measured.write_text("a log line\n" + json.dumps(bench) + "\n")
    args = ["scale", small_file, "--gpus", "8", "--steps", "2", "--json"]
    result = CliRunner().invoke(app, [*args, "--infra", str(measured)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["first_saturating"] == "ingest"
    measured.write_text(json.dumps({"infra": {"ingest": {"s_per_task": -1}}}))
    result = CliRunner().invoke(app, [*args, "--infra", str(measured)])
    assert result.exit_code == 2 and "--infra" in result.output, result.output


def test_plot_writes_the_sweeps_figures_as_png_files(tmp_path):
    """`--plot DIR`: the utilisation and weight-sync figures of the sweep, as PNG files that
    a page can show, named in the output."""
    from PIL import Image
    from typer.testing import CliRunner

    from treadle_sim.cli import app

    small_file = str(ROOT / "sim/scenarios/small.yaml")
    args = ["scale", small_file, "--gpus", "4,8,40", "--steps", "2", "--plot", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert sorted(out["plots"]) == sorted(
        str(tmp_path / name) for name in ("utilisation.png", "weight_sync.png")
    )
    for path in out["plots"]:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] >= 300
