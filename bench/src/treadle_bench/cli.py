"""`treadle bench ...`: added to the `treadle` command through the `treadle.commands`
entry-point group (see `treadle_cli.cli.add_plugins`).

treadle bench weights|env|reward|capacity|rollout|trainer|tinker|e2e|learn|mismatch|multirun|
    step|chaos [--json]
    our path vs a baseline, or learning per seed, as JSON
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Benchmarks: our path vs a raw baseline, as JSON.")

MODEL_HELP = "An imported model: its NAME (STATE_DIR/models/NAME) or its directory; default tiny"

SizeMb = Annotated[int, typer.Option(help="State dict size")]
NumTensors = Annotated[int, typer.Option(help="Tensors in the state dict")]
ModelWeights = Annotated[
    str | None, typer.Option(help=MODEL_HELP.replace("default tiny", "its weights"))
]
"""The state dict options of the benches that move weights (`weights`, `overlap`)."""


def model_dir(model: str | None) -> Path | None:
    """`--model`: a directory, or the name `treadle model import` gave it."""
    if model is None:
        return None
    from treadle_cli.settings import get_settings

    for candidate in (Path(model), get_settings().state_dir / "models" / model):
        if (candidate / "config.json").is_file():
            return candidate.resolve()
    raise typer.BadParameter(
        f"no model directory {model} nor {get_settings().state_dir / 'models' / model} "
        "(treadle model import SRC NAME makes one)",
        param_hint="--model",
    )


@app.command("weights")
def bench_weights(
    size_mb: SizeMb = 512,
    num_tensors: NumTensors = 64,
    changed: Annotated[float, typer.Option(help="Fraction of tensors a step changes")] = 0.03,
    replicas: Annotated[int, typer.Option(help="Concurrent fetchers in the fan-out")] = 8,
    model: ModelWeights = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Weight sync: publish/fetch via the weight-store vs a plain gRPC stream, delta, fan-out;
    of random tensors (`--size-mb`, `--num-tensors`) or of a model's own (`--model`)."""
    from treadle_bench import weights

    result = weights.run(size_mb, num_tensors, changed, replicas, model=model_dir(model))
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("overlap")
def bench_overlap(
    seconds: Annotated[float, typer.Option(help="Seconds per phase")] = 10.0,
    rounds: Annotated[int, typer.Option(help="Rounds of the three phases")] = 3,
    size_mb: SizeMb = 513,
    num_tensors: NumTensors = 273,
    model: ModelWeights = None,
    device: Annotated[str, typer.Option(help="Where the training thread's loop runs")] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """A training thread's operations per second alone, beside a publish on this process's
    event loop, and beside the same publish from a child process (`PublishWorker`)."""
    from treadle_bench import overlap

    report = overlap.run(seconds, rounds, size_mb, num_tensors, model_dir(model), device)
    print(json.dumps(report, indent=None if as_json else 2))


@app.command("env")
def bench_env(
    sessions: Annotated[int, typer.Option(help="Concurrent sessions")] = 256,
    seconds: Annotated[float, typer.Option(help="Measurement time per side")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
    sandbox: Annotated[
        bool, typer.Option(help="Also python_tests runs per second on each sandbox backend")
    ] = True,
    sandbox_sessions: Annotated[int, typer.Option(help="Concurrent python_tests sessions")] = 64,
    sandbox_seconds: Annotated[float, typer.Option(help="Measurement time per backend")] = 10.0,
    backend: Annotated[
        list[str] | None, typer.Option(help="Sandbox backends to measure (default: all)")
    ] = None,
) -> None:
    """Env-gateway episodes (arith) vs a plain gRPC echo at the same concurrency; then
    `sandbox_runs_per_s` of python_tests on each sandbox backend (unshare, bwrap, docker;
    the docker backend's image is TREADLE_ENV_SANDBOX_IMAGE)."""
    from treadle_bench import env

    result = env.run(sessions, seconds)
    if sandbox:
        result["sandbox"] = env.sandbox_run(sandbox_sessions, sandbox_seconds, tuple(backend or ()))
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("reward")
def bench_reward(
    requests: Annotated[int, typer.Option(help="Scoring requests per measurement")] = 200,
    concurrency: Annotated[int, typer.Option(help="Requests in flight")] = 32,
    rounds: Annotated[int, typer.Option(help="CPU work per score (sha256 rounds)")] = 100_000,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """CPU-bound scoring with 1 then 2 reward replicas (separate processes) over NATS."""
    from treadle_bench import reward

    print(json.dumps(reward.run(requests, concurrency, rounds), indent=None if as_json else 2))


@app.command("capacity")
def bench_capacity(
    groups: Annotated[int, typer.Option(help="Groups per measured workload")] = 300,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """CPU of a private Redis, NATS and the trainer's ingest per task, trajectory and KiB of
    a run's traffic (Treadle's calls; plain Redis calls as the baseline), for `treadle sim`."""
    from treadle_bench import capacity

    print(json.dumps(capacity.run(groups), indent=None if as_json else 2))


@app.command("tinker")
def bench_tinker(
    steps: Annotated[int, typer.Option(help="Training steps per round and side")] = 10,
    rounds: Annotated[int, typer.Option(help="Measured rounds per side")] = 3,
    batch: Annotated[int, typer.Option(help="Datums per forward_backward")] = 32,
    seq_len: Annotated[int, typer.Option(help="Tokens per datum")] = 128,
    rank: Annotated[int, typer.Option(help="LoRA rank")] = 16,
    prompts: Annotated[int, typer.Option(help="Concurrent sample requests per round")] = 8,
    num_samples: Annotated[int, typer.Option(help="Samples per request")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Tokens per sample")] = 64,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """The Tinker SDK against Treadle: a LoRA training step vs the same step in-process,
    sampling vs rollout's own API, adapter vs full-weight publish bytes."""
    from treadle_bench import tinker_api

    result = tinker_api.run(steps, rounds, batch, seq_len, rank, prompts, num_samples, max_tokens)
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("rollout")
def bench_rollout(
    prompts: Annotated[int, typer.Option(help="Concurrent requests per round")] = 32,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per request")] = 32,
    rounds: Annotated[int, typer.Option(help="Measured rounds per side")] = 5,
    swaps: Annotated[int, typer.Option(help="Weight versions published under load")] = 5,
    hidden_size: Annotated[int, typer.Option(help="Tiny model width (head size 64)")] = 128,
    layers: Annotated[int, typer.Option(help="Tiny model layers")] = 2,
    torch_threads: Annotated[
        int,
        typer.Option(
            help="Torch threads of the engine, in the service and in-process alike "
            "(0: half the cores, what `treadle up` gives rollout)"
        ),
    ] = 0,
    engine_cpus: Annotated[
        str,
        typer.Option(
            help="CPUs of the engine, in the service and in-process alike, the rest for "
            "serving and the load (auto: as `treadle up`; '': no binding)"
        ),
    ] = "auto",
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Generation through the rollout service (hf engine) vs the same engine in-process."""
    from treadle_bench import rollout

    result = rollout.run(
        prompts,
        max_new_tokens,
        rounds,
        swaps,
        hidden_size,
        layers,
        torch_threads,
        engine_cpus,
        model=model_dir(model),
    )
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("trainer")
def bench_trainer(
    steps: Annotated[int, typer.Option(help="Training steps (the first 2 warm up)")] = 16,
    groups: Annotated[int, typer.Option(help="Groups (tasks) per step")] = 16,
    group_size: Annotated[int, typer.Option(help="Trajectories per group")] = 4,
    completion_len: Annotated[int, typer.Option(help="Generated tokens per trajectory")] = 224,
    backend: Annotated[
        str, typer.Option(help="trainer.backend: single, or megatron (also runs single to compare)")
    ] = "single",
    tensor_parallel: Annotated[
        int, typer.Option(min=1, help="megatron: tensor-parallel ranks (torchrun processes)")
    ] = 2,
    model: Annotated[str | None, typer.Option(help=MODEL_HELP)] = None,
    profile_dir: Annotated[
        Path | None,
        typer.Option(
            help="Also profile one more step of each (torch.profiler): the service's "
            "(trainer.profile_steps) into DIR/<backend>, the plain loop's into DIR/raw"
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """Full trainer steps (Redis -> loss -> AdamW -> publish) vs a plain torch loop; with
    `--backend megatron`, megatron-core's steps next to the single backend's on the same batch."""
    from treadle_bench import trainer

    if backend not in ("single", "megatron"):
        raise typer.BadParameter("single or megatron", param_hint="--backend")
    result = trainer.run(
        steps,
        groups,
        group_size,
        completion_len=completion_len,
        backend=backend,
        tensor_parallel=tensor_parallel,
        model=model_dir(model),
        profile_dir=profile_dir,
    )
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("e2e")
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
    from treadle_bench import e2e

    result = e2e.run(
        recipe, steps, max_concurrent_tasks, quality_recipe if quality else None, quality_overrides
    )
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("learn")
def bench_learn(
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds, one run each")] = "0,1,2",
    recipe: Annotated[Path, typer.Option(help="Learning recipe")] = Path("recipes/demo.yaml"),
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a.b=c")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """The demo recipe once per seed: held-out accuracy at the start, after the warm-up and
    at the end; `min_rl_lift` is what RL alone gained on the worst seed."""
    from treadle_bench import learn

    result = learn.run([int(s) for s in seeds.split(",")], recipe, overrides)
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("mismatch")
def bench_mismatch(
    seeds: Annotated[
        str, typer.Option(help="Comma-separated seeds, one run per arm each")
    ] = "0,1,2",
    noise: Annotated[
        float, typer.Option(help="Std of the engine's injected logit bias per vocabulary token")
    ] = 1.0,
    recipe: Annotated[Path, typer.Option(help="Learning recipe")] = Path("recipes/demo.yaml"),
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a.b=c")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """A train-inference mismatch injected into rollout's engine: held-out learning of a clean
    run, of the biased one uncorrected (off_policy none) and corrected (off_policy auto)."""
    from treadle_bench import mismatch

    result = mismatch.run([int(s) for s in seeds.split(",")], noise, recipe, overrides)
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("multirun")
def bench_multirun(
    runs: Annotated[int, typer.Option(min=2, help="LoRA runs (seeds 0..N-1)")] = 4,
    recipe: Annotated[Path, typer.Option(help="Workload recipe")] = Path("recipes/demo.yaml"),
    lora_rank: Annotated[int, typer.Option(help="Every run's LoRA rank")] = 8,
    lora_lr: Annotated[
        float, typer.Option(help="Every run's learning rate (an adapter wants ~10x full weights')")
    ] = 3e-4,
    steps: Annotated[
        int | None, typer.Option(help="RL steps of each alone/together run (default: recipe's)")
    ] = None,
    share_steps: Annotated[
        int | None, typer.Option(help="RL steps of each weighted/priority run (None: recipe's)")
    ] = 100,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a.b=c")] = None,
    slots: Annotated[int, typer.Option(help="Rollout's tasks in flight (the stack's)")] = 16,
    max_batch: Annotated[int, typer.Option(help="Rollout's rows per decode step")] = 128,
    lanes: Annotated[
        int, typer.Option(help="Trainer's torch lanes (runs' steps side by side; the stack's)")
    ] = 1,
    trainer_threads: Annotated[
        int, typer.Option(help="Trainer's torch threads (0: the cores rollout's engine leaves)")
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """N LoRA runs of the recipe on one stack at once vs one after another on it: speedup,
    RL lift per run, fairness, weighted shares, priority, memory, lost and trained twice."""
    from treadle_bench import multirun

    sets = [f"trainer.lr={lora_lr}", *(overrides or [])]
    result = multirun.run(
        runs,
        recipe.resolve(),
        lora_rank,
        steps,
        share_steps,
        sets,
        slots,
        max_batch,
        lanes,
        trainer_threads,
    )
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("step")
def bench_step(
    steps: Annotated[int, typer.Option(help="Trainer steps per way")] = 100,
    recipe: Annotated[Path, typer.Option(help="Workload recipe")] = Path("recipes/step.yaml"),
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a.b=c")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """A short, compute-bound step three ways: an in-process loop with the same engine and
    trainer code, Treadle sync, Treadle async; seconds per step, where they go, publishes."""
    from treadle_bench import step

    result = step.run(steps, recipe, overrides)
    print(json.dumps(result, indent=None if as_json else 2))


@app.command("chaos")
def bench_chaos(
    recipe: Annotated[Path, typer.Option(help="An async recipe")] = Path("recipes/chaos.yaml"),
    steps: Annotated[int | None, typer.Option(help="Override trainer.num_steps")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a.b=c")] = None,
    baseline: Annotated[
        bool, typer.Option("--baseline/--no-baseline", help="Also run it without faults")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line")] = False,
) -> None:
    """An async run while every service is SIGKILLed, Redis and NATS restart and a second
    trainer takes the run over: completed, nothing lost or trained twice (from the ledger),
    and the slowdown against the same run without faults."""
    from treadle_bench import chaos

    result = chaos.run(steps, recipe, overrides, baseline)
    print(json.dumps(result, indent=None if as_json else 2))
