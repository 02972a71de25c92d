"""The `treadle` command.

treadle infra up|down|status     embedded redis / nats (/ S3) only
treadle up [--detach]            infra + the five services, supervised
treadle status [--json]          health of everything `up` started
treadle down                     stop everything `up` started
treadle run RECIPE [--set a=b]   run a recipe on the stack (starting one if none runs)
treadle model init-tiny DIR      build the tiny local HF model
treadle weights list|export       inspect / export weight-store versions as HF directories
treadle bench weights|env|reward|rollout|trainer|e2e|learn|step [--json]
                                 our path vs a baseline, or learning per seed, as JSON
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from treadle_common import stack
from treadle_common.config import RecipeError, load_recipe
from treadle_common.infra import Infra, InfraError, states_json
from treadle_common.settings import get_settings

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Treadle: service-oriented RL post-training."
)
infra_app = typer.Typer(no_args_is_help=True, help="Embedded infrastructure (redis, nats, S3).")
model_app = typer.Typer(no_args_is_help=True, help="Model utilities.")
app.add_typer(infra_app, name="infra")
app.add_typer(model_app, name="model")
console = Console()
err = Console(stderr=True)


def fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


# -- infra -----------------------------------------------------------------------------------
@infra_app.command("up")
def infra_up(
    s3: Annotated[bool, typer.Option(help="Also start an S3 server (weed mini)")] = False,
) -> None:
    """Start redis-server and nats-server (JetStream), reusing any that already answer."""
    try:
        states = Infra(get_settings()).up(("redis", "nats", "s3") if s3 else ("redis", "nats"))
    except InfraError as exc:
        fail(str(exc))
    for s in states:
        console.print(f"{s.name:6} {s.url:28} {s.detail}")


@infra_app.command("down")
def infra_down() -> None:
    """Stop the servers `treadle infra up` started."""
    console.print("stopped: " + (", ".join(Infra(get_settings()).down()) or "nothing"))


@infra_app.command("status")
def infra_status(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    states = Infra(get_settings()).status()
    if as_json:
        print(json.dumps(states_json(states), indent=2))
        return
    for s in states:
        console.print(f"{s.name:6} {s.url:28} {'healthy' if s.healthy else 'DOWN'}  {s.detail}")


# -- stack -----------------------------------------------------------------------------------
def status_table(current: dict) -> Table:
    table = Table(title="treadle stack")
    for column in ("component", "kind", "healthy", "pid", "restarts", "detail"):
        table.add_column(column)
    for name, i in current.get("infra", {}).items():
        table.add_row(
            name, "infra", _mark(i["healthy"]), "", "", i["url"] if i["healthy"] else i["detail"]
        )
    for name, s in current.get("services", {}).items():
        bad = {k: v for k, v in s["checks"].items() if v != "ok"}
        detail = ", ".join(f"{k}: {v}" for k, v in bad.items()) or f"ports {s['ports']}"
        stalls = [
            f"[red]STALLED {stage}[/red] ({p['pending']} pending, idle {p['idle_s']}s)"
            for stage, p in s.get("progress", {}).items()
            if p["stalled"]
        ]
        if stalls:
            detail = "; ".join(stalls + [f"{k}: {v}" for k, v in bad.items()])
        table.add_row(
            name, "service", _mark(s["healthy"]), str(s["pid"]), str(s["restarts"]), detail[:80]
        )
    return table


def _mark(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]no[/red]"


@app.command()
def up(
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Return once healthy; keep running")
    ] = False,
    model: Annotated[
        Path | None, typer.Option(help="HF model dir for rollout (default: tiny)")
    ] = None,
    model_name: Annotated[str | None, typer.Option(help="Weight-store name of the model")] = None,
    base_port: Annotated[int | None, typer.Option(help="Assign service ports from here")] = None,
    s3: Annotated[bool, typer.Option(help="Also start an S3 server")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for health")] = 90.0,
) -> None:
    """Start infrastructure and the five services as supervised local processes."""
    settings = get_settings()
    try:
        spec = stack.prepare(settings, model, model_name, base_port, with_s3=s3)
    except (stack.StackError, InfraError) as exc:
        fail(str(exc))
    if detach:
        stack.launch_detached(spec)
        current = stack.wait_healthy(settings.state_dir.resolve(), timeout)
        console.print(status_table(current))
        if not current["healthy"]:
            fail(
                f"not healthy after {timeout:.0f}s; logs in {spec.state_dir}/logs "
                "(treadle down stops it)"
            )
        return
    supervisor = stack.Supervisor(spec)
    supervisor.start_all()
    try:
        with Live(
            status_table(stack.status(Path(spec.state_dir))), console=console, refresh_per_second=1
        ) as live:
            while True:
                supervisor.poll()
                live.update(status_table(stack.status(Path(spec.state_dir))))
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        console.print("stopping...")
        supervisor.stop_all()


@app.command()
def down() -> None:
    """Stop every process `treadle up` started (services, then infrastructure it started)."""
    stopped = stack.down(get_settings())
    console.print("stopped: " + (", ".join(stopped) or "nothing was running"))


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Health of the stack: every service's /readyz and every infra server."""
    current = stack.status(get_settings().state_dir.resolve(), detail=True)
    if as_json:
        print(json.dumps(current, indent=2))
    elif not current["running"]:
        console.print("no stack is running (treadle up starts one)")
    else:
        console.print(status_table(current))
        if current.get("time"):
            console.print(time_table(current["time"]))
    raise typer.Exit(0 if current["healthy"] else 1)


def time_table(breakdown: dict) -> Table:
    table = Table(title="where time goes")
    table.add_column("component")
    table.add_column("numbers")
    for name, values in breakdown.items():
        table.add_row(name, ", ".join(f"{k} {v}" for k, v in values.items()))
    return table


# -- model ---------------------------------------------------------------------------------
@model_app.command("init-tiny")
def model_init_tiny(
    out_dir: Path,
    seed: Annotated[int, typer.Option(help="Random init and tokenizer seed")] = 0,
    hidden_size: Annotated[int, typer.Option(help="Hidden size (a multiple of 64)")] = 128,
    layers: Annotated[int, typer.Option(help="Decoder layers")] = 2,
) -> None:
    """Build a tiny random HF causal LM (Llama, head_dim 64) with a locally trained tokenizer."""
    from treadle_common.tiny_model import init_tiny

    if (out_dir / "config.json").exists():
        console.print(f"{out_dir} already holds a model; left as it is")
        return
    out = init_tiny(
        out_dir, hidden_size=hidden_size, num_layers=layers, num_heads=hidden_size // 64, seed=seed
    )
    console.print(f"wrote {out}")


# -- run -----------------------------------------------------------------------------------
@app.command()
def run(
    recipe: Path,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a.b=c")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the stack's health")] = 120.0,
) -> None:
    """Run a recipe: tasks -> rollout -> env-gateway -> reward -> trainer -> weight-store."""
    try:
        config = load_recipe(recipe, overrides)
    except RecipeError as exc:
        fail(str(exc), code=2)
    from treadle_common.run_client import RunClient

    code = RunClient(config, get_settings(), console).execute(timeout)
    raise typer.Exit(code)


# -- weights ---------------------------------------------------------------------------------
weights_app = typer.Typer(no_args_is_help=True, help="Inspect and export weight-store versions.")
app.add_typer(weights_app, name="weights")
StoreOption = Annotated[str | None, typer.Option("--store", help="weight-store gRPC address")]


def _store(address: str | None):
    from treadle_common.clients.weights import WeightStoreClient

    return WeightStoreClient(address or get_settings().weight_store_addr)


@weights_app.command("list")
def weights_list(model: str, store: StoreOption = None) -> None:
    """Versions of MODEL: version, step, size, pinned, not yet on disk/S3 (written behind)."""

    async def go():
        client = _store(store)
        try:
            return await client.list_versions(model)
        finally:
            await client.close()

    for v in asyncio.run(go()):
        flags = ("  pinned" if v.pinned else "") + ("" if v.durable else "  writing")
        console.print(
            f"{v.version:6d}  step {v.trainer_step:6d}  {v.num_bytes / 2**20:9.2f} MiB{flags}"
        )


@weights_app.command("export")
def weights_export(model: str, version: int, out_dir: Path, store: StoreOption = None) -> None:
    """Write MODEL@VERSION (-1 = latest) as an HF directory (config, tokenizer, safetensors)."""
    import grpc

    from treadle_common.weights_export import export_hf

    async def go():
        client = _store(store)
        try:
            return await export_hf(client, model, version, out_dir)
        finally:
            await client.close()

    try:
        console.print(f"wrote {asyncio.run(go())}")
    except grpc.aio.AioRpcError as exc:
        fail(f"{exc.code().name}: {exc.details()}")


# -- bench ---------------------------------------------------------------------------------
bench_app = typer.Typer(
    no_args_is_help=True, help="Benchmarks: our path vs a raw baseline, as JSON."
)
app.add_typer(bench_app, name="bench")


@bench_app.command("weights")
def bench_weights(
    size_mb: Annotated[int, typer.Option(help="State dict size")] = 512,
    num_tensors: Annotated[int, typer.Option(help="Tensors in the state dict")] = 64,
    changed: Annotated[float, typer.Option(help="Fraction of tensors a step changes")] = 0.03,
    replicas: Annotated[int, typer.Option(help="Concurrent fetchers in the fan-out")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Weight sync: publish/fetch via the weight-store vs a plain gRPC stream, delta, fan-out."""
    from benchmarks import weights  # installed with the `treadle` meta-distribution

    result = weights.run(size_mb, num_tensors, changed, replicas)
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("env")
def bench_env(
    sessions: Annotated[int, typer.Option(help="Concurrent sessions")] = 256,
    seconds: Annotated[float, typer.Option(help="Measurement time per side")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Env-gateway episodes (arith) vs a plain gRPC echo at the same concurrency."""
    from benchmarks import env

    print(json.dumps(env.run(sessions, seconds), indent=None if as_json else 2))


@bench_app.command("reward")
def bench_reward(
    requests: Annotated[int, typer.Option(help="Scoring requests per measurement")] = 200,
    concurrency: Annotated[int, typer.Option(help="Requests in flight")] = 32,
    rounds: Annotated[int, typer.Option(help="CPU work per score (sha256 rounds)")] = 100_000,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """CPU-bound scoring with 1 then 2 reward replicas (separate processes) over NATS."""
    from benchmarks import reward

    print(json.dumps(reward.run(requests, concurrency, rounds), indent=None if as_json else 2))


@bench_app.command("rollout")
def bench_rollout(
    prompts: Annotated[int, typer.Option(help="Concurrent requests per round")] = 32,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per request")] = 32,
    rounds: Annotated[int, typer.Option(help="Measured rounds per side")] = 3,
    swaps: Annotated[int, typer.Option(help="Weight versions published under load")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Generation through the rollout service (hf engine) vs the same engine in-process."""
    from benchmarks import rollout

    result = rollout.run(prompts, max_new_tokens, rounds, swaps)
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("trainer")
def bench_trainer(
    steps: Annotated[int, typer.Option(help="Training steps (the first 2 warm up)")] = 16,
    groups: Annotated[int, typer.Option(help="Groups (tasks) per step")] = 16,
    group_size: Annotated[int, typer.Option(help="Trajectories per group")] = 4,
    completion_len: Annotated[int, typer.Option(help="Generated tokens per trajectory")] = 224,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Full trainer steps (Redis -> loss -> AdamW -> publish) vs a plain torch loop."""
    from benchmarks import trainer

    result = trainer.run(steps, groups, group_size, completion_len=completion_len)
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("e2e")
def bench_e2e(
    recipe: Annotated[Path, typer.Option(help="Workload recipe")] = Path("recipes/agentic.yaml"),
    steps: Annotated[int, typer.Option(help="Trainer steps per mode")] = 12,
    max_concurrent_tasks: Annotated[
        int,
        typer.Option(help="Rollout task groups in flight (TREADLE_ROLLOUT_MAX_CONCURRENT_TASKS)"),
    ] = 64,
    quality_recipe: Annotated[
        Path, typer.Option(help="A learnable recipe: held-out accuracy of sync vs async")
    ] = Path("recipes/arith_latency.yaml"),
    quality: Annotated[
        bool, typer.Option("--quality/--no-quality", help="Run the learning half")
    ] = True,
    quality_overrides: Annotated[
        list[str] | None, typer.Option("--quality-set", help="Override a.b=c in quality_recipe")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """The same recipe in sync and in async mode, for the same number of steps; then a
    learnable one in both modes from the same warm-up: speed, and what each learned."""
    from benchmarks import e2e

    result = e2e.run(
        recipe, steps, max_concurrent_tasks, quality_recipe if quality else None, quality_overrides
    )
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("learn")
def bench_learn(
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds, one run each")] = "0,1,2",
    recipe: Annotated[Path, typer.Option(help="Learning recipe")] = Path("recipes/demo.yaml"),
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a.b=c")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """The demo recipe once per seed: held-out accuracy at the start, after the warm-up and
    at the end; `min_rl_lift` is what RL alone gained on the worst seed."""
    from benchmarks import learn

    result = learn.run([int(s) for s in seeds.split(",")], recipe, overrides)
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("step")
def bench_step(
    steps: Annotated[int, typer.Option(help="Trainer steps per way")] = 100,
    recipe: Annotated[Path, typer.Option(help="Workload recipe")] = Path("recipes/step.yaml"),
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a.b=c")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """A short, compute-bound step three ways: an in-process loop with the same engine and
    trainer code, Treadle sync, Treadle async; seconds per step, where they go, publishes."""
    from benchmarks import step

    result = step.run(steps, recipe, overrides)
    print(json.dumps(result, indent=None if as_json else 2))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
