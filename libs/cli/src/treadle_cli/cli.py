"""The `treadle` command.

treadle infra up|down|status     embedded redis / nats (/ S3) only
treadle up [--detach]            infra + the five services, supervised
treadle status [--json]          health of everything `up` started
treadle down                     stop everything `up` started
treadle run RECIPE [--set a=b]   run a recipe on the stack (starting one if none runs)
treadle replay RUN [--diff RUN2] re-run a run's training from its schedule, bit for bit
treadle trace RUN_ID             a run's spans as a Perfetto trace or OTLP/JSON (Jaeger)
treadle model init-tiny DIR      build the tiny local HF model
treadle model import SRC NAME    an HF dir or GGUF file as a model the stack serves, published
treadle weights list|export       inspect / export weight-store versions as HF directories
treadle bench ...                (with treadle-bench installed: see treadle_bench.cli)
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.live import Live
from rich.table import Table

from treadle_cli import signals, stack
from treadle_cli.infra import Infra, InfraError, states_json
from treadle_cli.settings import get_settings
from treadle_common import names
from treadle_common.config.recipe import RecipeError, load_recipe

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Treadle: service-oriented RL post-training."
)
infra_app = typer.Typer(no_args_is_help=True, help="Embedded infrastructure (redis, nats, S3).")
model_app = typer.Typer(no_args_is_help=True, help="Model utilities.")
app.add_typer(infra_app, name="infra")
app.add_typer(model_app, name="model")
PLUGIN_GROUP = "treadle.commands"
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
def status_table(current: stack.StackStatus) -> Table:
    table = Table(title="treadle stack")
    for column in ("component", "kind", "healthy", "pid", "restarts", "detail"):
        table.add_column(column)
    for name, i in current.infra.items():
        table.add_row(name, "infra", _mark(i.healthy), "", "", i.url if i.healthy else i.detail)
    for name, s in current.services.items():
        bad = {k: v for k, v in s.checks.items() if v != "ok"}
        detail = ", ".join(f"{k}: {v}" for k, v in bad.items()) or f"ports {s.ports}"
        stalls = [
            f"[red]STALLED {stage}[/red] ({p.pending} pending, idle {p.idle_s}s)"
            for stage, p in s.progress.items()
            if p.stalled
        ]
        if stalls:
            detail = "; ".join(stalls + [f"{k}: {v}" for k, v in bad.items()])
        table.add_row(name, "service", _mark(s.healthy), str(s.pid), str(s.restarts), detail[:80])
    for model, waiting in current.unserved.items():
        detail = f"[red]no rollout replica serves it[/red]: {waiting} tasks waiting"
        table.add_row(model, "model", _mark(False), "", "", detail)
    return table


def _served(items: list[str]) -> dict[str, Path]:
    """`up --serve NAME=DIR ...` as model name -> directory (a bad item ends the command)."""
    served = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not names.valid_name(name) or not path:
            fail(f"--serve {item!r}: not NAME=DIR with a valid model name")
        served[name] = Path(path)
    return served


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
    trainer_ranks: Annotated[
        int,
        typer.Option(
            min=1,
            help="Run the trainer as this many torchrun ranks (trainer.backend megatron: "
            "tensor_parallel x data parallel; fsdp: FSDP2 shards)",
        ),
    ] = 1,
    serve: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=DIR: also serve this model, with a rollout replica of its own (repeat "
            "for more; full-weight runs of NAME use it; a tiny model is built where DIR has "
            "none)"
        ),
    ] = None,
) -> None:
    """Start infrastructure and the five services as supervised local processes."""
    settings = get_settings()
    served = _served(serve or [])
    try:
        spec = stack.prepare(
            settings,
            model,
            model_name,
            base_port,
            with_s3=s3,
            trainer_ranks=trainer_ranks,
            serve=served,
        )
    except (stack.StackError, InfraError) as exc:
        fail(str(exc))
    if detach:
        _up_detached(spec, settings.state_dir.resolve(), timeout)
    else:
        _up_in_foreground(spec)


def _up_detached(spec: stack.StackSpec, state_dir: Path, timeout: float) -> None:
    """Launch the supervisor in the background; return once healthy (else fail, naming the
    logs)."""
    stack.launch_detached(spec)
    current = stack.wait_healthy(state_dir, timeout)
    console.print(status_table(current))
    if not current.healthy:
        fail(
            f"not healthy after {timeout:.0f}s; logs in {spec.state_dir}/logs "
            "(treadle down stops it)"
        )


def _up_in_foreground(spec: stack.StackSpec) -> None:
    """Supervise here with a live health table; Ctrl-C (or SIGTERM) stops everything."""
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
def secrets(
    output: Annotated[
        str, typer.Option("--format", help="env (compose's .env) | k8s (a Secret manifest)")
    ] = "env",
    namespace: Annotated[str | None, typer.Option(help="k8s: the Secret's namespace")] = None,
) -> None:
    """Generate a deployment's secrets: a token per role (and its SHA-256, what servers
    hold), the Redis password, a password per NATS user and the S3 keys. `--format env`
    prints the lines compose.yaml reads from `.env`; `--format k8s` prints the
    `treadle-auth` Secret the manifests read (`kubectl apply -f -`). Nothing is stored."""
    import json as json_lib
    import secrets as secrets_lib

    import yaml

    from treadle_common.auth.infra import InfraSecrets
    from treadle_common.auth.policy import TokenTable, token_hash

    table = TokenTable.generate()
    infra = InfraSecrets.generate()
    s3 = {
        "TREADLE_S3_ACCESS_KEY": secrets_lib.token_hex(10),
        "TREADLE_S3_SECRET_KEY": secrets_lib.token_urlsafe(30),
    }
    if output == "env":
        for role, token in table.items():
            print(f"TREADLE_TOKEN_{role.upper()}={token}")
            print(f"TREADLE_TOKEN_{role.upper()}_SHA256={token_hash(token)}")  # for servers
        for key, value in {**infra.env(), **s3}.items():
            print(f"{key}={value}")
    elif output == "k8s":
        metadata: dict = {"name": "treadle-auth"}
        if namespace:
            metadata["namespace"] = namespace
        # keys as k8s spells them: redis-password, nats-password-rollout, s3-access-key, ...
        keys = {k.lower().replace("_", "-").removeprefix("treadle-"): v for k, v in s3.items()}
        keys |= {k.lower().replace("_", "-"): v for k, v in infra.env().items()}
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": metadata,
            "type": "Opaque",
            # servers read tokens.json: hashes only; each pod its own role's token by key
            "stringData": {
                "tokens.json": json_lib.dumps(TokenTable.hashed(table)),
                **table,
                **keys,
            },
        }
        print(yaml.safe_dump(secret, sort_keys=False), end="")
    else:
        fail(f"--format must be env or k8s, not {output!r}", code=2)


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Health of the stack: every service's /readyz and every infra server."""
    current = stack.status(get_settings().state_dir.resolve(), detail=True)
    if as_json:
        print(current.model_dump_json(indent=2))
    elif not current.running:
        console.print("no stack is running (treadle up starts one)")
    else:
        console.print(status_table(current))
        if current.time is not None:
            console.print(time_table(current.time))
    raise typer.Exit(0 if current.healthy else 1)


def time_table(breakdown: stack.TimeBreakdown) -> Table:
    table = Table(title="where time goes")
    table.add_column("component")
    table.add_column("numbers")
    rows: list[tuple[str, BaseModel]] = []
    if breakdown.rollout is not None:
        rows.append(("rollout", breakdown.rollout))
    rows += [(f"trainer {run_id}", run) for run_id, run in breakdown.runs.items()]
    for name, values in rows:
        table.add_row(name, ", ".join(f"{k} {v}" for k, v in values.model_dump().items()))
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
    from treadle_cli.tiny_model import init_tiny

    if (out_dir / "config.json").exists():
        console.print(f"{out_dir} already holds a model; left as it is")
        return
    out = init_tiny(
        out_dir, hidden_size=hidden_size, num_layers=layers, num_heads=hidden_size // 64, seed=seed
    )
    console.print(f"wrote {out}")


@model_app.command("import")
def model_import(
    src: Path,
    name: str,
    out: Annotated[
        Path | None, typer.Option(help="Where to write it (default: STATE_DIR/models/NAME)")
    ] = None,
    publish: Annotated[bool, typer.Option(help="Publish it to the weight store")] = True,
    store: Annotated[str | None, typer.Option("--store", help="weight-store address")] = None,
) -> None:
    """An HF directory, a .safetensors file in one, or a GGUF file (dequantised) as a model
    the stack serves and trains (tokenizer and chat template included), published to the
    weight store as NAME once; `treadle up --serve NAME=DIR` serves it."""
    import grpc

    from treadle_common import names
    from treadle_common.model.importing import import_model, publish_once

    if not names.valid_name(name):
        fail(f"{name!r} is not a model name ({names.NAME_PATTERN})", code=2)
    directory = out or get_settings().state_dir / "models" / name
    try:
        done = import_model(src, directory)
    except (ValueError, OSError) as exc:
        fail(str(exc), code=2)
    verb = "reused" if done.reused else "wrote"
    console.print(
        f"{verb} {done.directory}: {done.architecture}, {done.parameters / 1e6:.1f}M parameters, "
        f"vocabulary {done.vocab_size}, chat template {'yes' if done.chat_template else 'no'}"
    )
    if not publish:
        return

    async def go() -> tuple[int, bool]:
        client = _store(store)
        try:
            return await publish_once(client, name, directory)
        finally:
            await client.close()

    try:
        version, existed = asyncio.run(go())
    except grpc.aio.AioRpcError as exc:
        fail(f"weight store: {exc.code().name}: {exc.details()}")
    console.print(f"{name}@{version} {'(already in the store)' if existed else 'published'}")


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
    from treadle_cli.run_client import RunClient

    code = RunClient(config, get_settings(), console).execute(timeout)
    raise typer.Exit(code)


def _run_dir(run: str, runs_dir: Path) -> Path:
    """A run's directory: `run` itself when it is one, else `runs_dir/run`."""
    path = Path(run)
    found = path if path.is_dir() else runs_dir / run
    if not found.is_dir():
        fail(f"no run directory {run!r} (nor {runs_dir / run})", code=2)
    return found


@app.command()
def replay(
    run: Annotated[str, typer.Argument(help="A run id (under --runs-dir) or a run directory")],
    until: Annotated[int | None, typer.Option(help="Replay steps 1..UNTIL only")] = None,
    against: Annotated[
        str | None, typer.Option("--diff", help="Compare RUN's schedule with this run's instead")
    ] = None,
    runs_dir: Annotated[Path, typer.Option(help="Where runs write their outputs")] = Path(
        ".treadle/runs"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Re-run a run's training from its recorded schedule (no rollout, no environments) and
    check its weights bit for bit; with --diff, name the first step where two runs differ.
    Exits 1 when the replay is not identical."""
    try:
        from treadle_trainer.public import diff, replay
    except ImportError:
        fail("treadle replay needs the trainer installed (pip install treadle-trainer)")
    first = _run_dir(run, runs_dir)
    if against is not None:
        report: BaseModel = diff(first, _run_dir(against, runs_dir))
        ok = True
    else:
        result = replay(first, until)
        report, ok = result, result.identical
    if as_json:
        print(report.model_dump_json())
    else:
        for key, value in report.model_dump().items():
            console.print(f"{key:>22}  {value}")
    raise typer.Exit(0 if ok else 1)


@app.command()
def trace(
    run_id: Annotated[str, typer.Argument(help="The run whose spans to write")],
    fmt: Annotated[
        str, typer.Option("--format", help="perfetto (ui.perfetto.dev) or otlp-json (Jaeger)")
    ] = "perfetto",
    out: Annotated[
        Path | None, typer.Option(help="File to write (default: RUN_ID.pftrace / .otlp.json)")
    ] = None,
    trace_dir: Annotated[
        Path | None,
        typer.Option(
            help="The processes' span files (default: TREADLE_TRACE_DIR or {state}/traces)"
        ),
    ] = None,
) -> None:
    """Write a run's spans (its tasks across trainer, rollout, env-gateway and reward; its
    publishes and swaps with the weight-store's) as one file Perfetto or Jaeger opens, with a
    lane per service and per step. Spans are what the services recorded (`TREADLE_TRACES=file`,
    `TREADLE_TRACE_SAMPLE` of the tasks)."""
    from treadle_cli.trace_export import FORMATS, export

    if fmt not in FORMATS:
        fail(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}", code=2)
    settings = get_settings()
    directory = trace_dir or settings.trace_dir or settings.state_dir / "traces"
    path = out or Path(f"{run_id}.{'pftrace' if fmt == 'perfetto' else 'otlp.json'}")
    try:
        written = export(directory, run_id, fmt, path)
    except LookupError as exc:
        fail(str(exc), code=1)
    except ImportError:
        fail("--format perfetto needs Perfetto's package: pip install 'treadle-cli[trace]'")
    services = sorted({s.service for s in written.spans})
    traces = len({s.trace_id for s in written.spans})
    console.print(
        f"wrote {path}: {len(written.spans)} spans, {traces} traces ({', '.join(services)})"
    )
    if written.unreadable_lines:  # a process killed mid-write leaves a partial last line
        console.print(f"skipped {written.unreadable_lines} lines that were not spans")


# -- runs ------------------------------------------------------------------------------------
runs_app = typer.Typer(no_args_is_help=True, help="Runs' state in Redis.")
app.add_typer(runs_app, name="runs")


@runs_app.command("gc")
def runs_gc(
    older_than: Annotated[
        float, typer.Option(help="Delete runs that ended more than this many seconds ago")
    ] = 24 * 3600.0,
    redis_url: Annotated[str | None, typer.Option("--redis", help="Redis URL")] = None,
    dry_run: Annotated[bool, typer.Option(help="Only list them")] = False,
) -> None:
    """Delete finished runs' Redis keys (streams, ledger, dead letters, state); active runs
    and runs that ended recently are left alone (they expire on their own after
    TREADLE_TRAINER_RUN_RETENTION_S)."""
    import redis.asyncio as aioredis

    from treadle_common.fleet import retention

    async def go() -> tuple[list[str], int]:
        r = aioredis.from_url(redis_url or Infra(get_settings()).url_for("redis"))
        try:
            runs = await retention.finished_runs(r, older_than)
            return runs, 0 if dry_run else await retention.delete_runs(r, runs)
        finally:
            await r.aclose()

    runs, keys = asyncio.run(go())
    for run in runs:
        console.print(run)
    verb = "would delete" if dry_run else f"deleted {keys} keys of"
    console.print(f"{verb} {len(runs)} finished runs")


# -- weights ---------------------------------------------------------------------------------
weights_app = typer.Typer(no_args_is_help=True, help="Inspect and export weight-store versions.")
app.add_typer(weights_app, name="weights")
StoreOption = Annotated[str | None, typer.Option("--store", help="weight-store gRPC address")]


def _store(address: str | None):
    from treadle_common.clients.weights import WeightStoreClient

    settings = get_settings()
    return WeightStoreClient(address or settings.weight_store_addr, token=settings.client_token())


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

    from treadle_common.model.export import export_hf

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


def add_plugins() -> None:
    """Sub-commands other distributions add through the `treadle.commands` entry-point group
    (`treadle-bench` adds `treadle bench`): each entry point is a typer app, named by its key."""
    for entry in entry_points(group=PLUGIN_GROUP):
        app.add_typer(entry.load(), name=entry.name)


def main() -> None:
    signals.unwind_on_sigterm()  # a stopped command stops what it started
    add_plugins()
    app()


if __name__ == "__main__":
    main()
