"""`treadle sim ...`: added to the `treadle` command through the `treadle.commands` entry-point
group (see `treadle_cli.cli.add_plugins`).

treadle sim run SCENARIO [--seed N] [--json]
    one scenario in sync and in async mode: wall time, bubbles, utilisation, staleness,
    weight-sync share, the async-over-sync speedup (and the source's, when it reports one)
treadle sim calibrate step|e2e BENCH_JSON [--json]
    a `treadle bench step --json` or `treadle bench e2e --json` result: the simulator's sync
    and async times from that run's measured component costs, against what it measured
treadle sim scale [SCENARIO] [--gpus 1000,3000] [--steps 8] [--fanout F] [--infra F] [--plot DIR]
        [--json]
    the scenario grown to each fleet size (every pool in proportion, one weight store, one
    Redis, the trainer's one ingest): each shared component's utilisation, the first to
    saturate and at how many GPUs, weight sync by fan-out; `--plot` draws them (PNG)
treadle sim share [SCENARIO] [--policy fair,fifo] [--seed N] [--json]
    many runs on one fleet of rollout replicas, each replica's task slots given out by
    rollout's own FairShare under each policy: every run's share of the slot-seconds against
    its weight's, Jain's index per priority, the fleet's utilisation
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from treadle_sim.scenario import Infra

app = typer.Typer(
    no_args_is_help=True, help="Simulate a fleet in simulated time, with Treadle's own scheduling."
)


@app.command("run")
def sim_run(
    scenario: Annotated[Path, typer.Argument(help="A scenario file (sim/scenarios/*.yaml)")],
    seed: Annotated[int, typer.Option(help="Seed of the lengths and latencies drawn")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """One scenario in sync and in async mode, and the async-over-sync speedup."""
    from treadle_sim import engine
    from treadle_sim.scenario import load

    result = engine.compare(load(scenario), seed)
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("calibrate")
def sim_calibrate(
    bench: Annotated[str, typer.Argument(help="Which bench: step or e2e")],
    result: Annotated[Path, typer.Argument(help="Its --json output (the last JSON line is read)")],
    cores: Annotated[float, typer.Option(help="The cores the bench ran on (default: these)")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Predicted vs measured: the simulator against a bench run on this machine."""
    from treadle_sim import calibrate

    if bench not in ("step", "e2e"):
        raise typer.BadParameter(f"no calibration for bench {bench!r}; known: step, e2e")
    lines = [line for line in result.read_text().splitlines() if line.startswith("{")]
    if not lines:
        raise typer.BadParameter(f"{result} holds no JSON line")
    predict = calibrate.step if bench == "step" else calibrate.e2e
    out = predict(json.loads(lines[-1]), cores=cores or None)
    print(json.dumps(out, indent=None if as_json else 2))


def measured_infra(path: Path) -> Infra:
    """The control plane's costs from a `treadle bench capacity --json` output (its last
    JSON line, or a file of its `infra` part)."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip().startswith("{")]
        data = json.loads(lines[-1]) if lines else json.loads(path.read_text())
        return Infra.model_validate(data.get("infra", data))
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise typer.BadParameter(f"--infra {path}: {exc}") from None


SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
"""`sim/scenarios/` of this checkout (the package is installed from it, editable)."""


@app.command("scale")
def sim_scale(
    scenario: Annotated[
        Path, typer.Argument(help="A scenario file (default: sim/scenarios/verl-fully-async-128)")
    ] = SCENARIOS / "verl-fully-async-128.yaml",
    gpus: Annotated[str, typer.Option(help="Comma-separated fleet sizes, in GPUs")] = "1000,3000",
    steps: Annotated[int, typer.Option(help="Steps at each size (0: the scenario's)")] = 8,
    fanout: Annotated[
        str, typer.Option(help="store, relay or broadcast (default: the scenario's)")
    ] = "",
    seed: Annotated[int, typer.Option(help="Seed of the lengths and latencies drawn")] = 0,
    infra: Annotated[
        Path | None,
        typer.Option(
            help="`treadle bench capacity --json` output: the control plane's costs measured "
            "on another machine (default: the scenario's)"
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write the sweep's figures (utilisation.png, weight_sync.png) here"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """The scenario grown to each size: utilisation per shared component, the first to
    saturate, and the weight sync of a 7B and a 235B model under each fan-out."""
    from treadle_sim import scale
    from treadle_sim.scenario import load

    try:
        sizes = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise typer.BadParameter(f"--gpus takes comma-separated integers, not {gpus!r}") from None
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter("--gpus needs at least one size of 1 or more")
    if fanout and fanout not in scale.FANOUTS:
        raise typer.BadParameter(f"--fanout is one of {', '.join(scale.FANOUTS)}, not {fanout!r}")
    if not scenario.is_file():
        raise typer.BadParameter(f"no scenario file at {scenario}")
    sc = load(scenario)
    if fanout:
        sc = sc.model_copy(update={"weights": sc.weights.model_copy(update={"fanout": fanout})})
    if infra is not None:
        sc = sc.model_copy(update={"infra": measured_infra(infra)})
    result = scale.sweep(sc, sizes, steps or None, seed)
    if plot is not None:
        from treadle_sim import plots

        result["plots"] = [str(path) for path in plots.write(result, plot)]
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("share")
def sim_share(
    scenario: Annotated[
        Path,
        typer.Argument(help="A shared-fleet scenario (default: sim/scenarios/shared/fleet-1000)"),
    ] = SCENARIOS / "shared" / "fleet-1000.yaml",
    policy: Annotated[
        str, typer.Option(help="Comma-separated scheduling policies, each run on the scenario")
    ] = "fair,fifo",
    seed: Annotated[int, typer.Option(help="Seed of the task seconds drawn")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Many runs on one fleet: each run's share of the rollout slots under rollout's own
    scheduling, against its weight's share."""
    from pydantic import ValidationError

    from treadle_common.fleet import scheduling
    from treadle_sim import share

    policies = [p.strip() for p in policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in scheduling.POLICIES]
    if not policies or unknown:
        known = ", ".join(sorted(scheduling.POLICIES))
        raise typer.BadParameter(f"--policy takes some of {known}, not {policy!r}")
    if not scenario.is_file():
        raise typer.BadParameter(f"no scenario file at {scenario}")
    try:
        fleet = share.load(scenario)
    except (ValidationError, ValueError) as exc:
        raise typer.BadParameter(f"{scenario}: {exc}") from None
    print(json.dumps(share.compare(fleet, policies, seed), indent=None if as_json else 2))
