"""The real `treadle` CLI as a subprocess, on private infrastructure and free ports."""

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.support.cli import treadle
from tests.support.services import ROOT
from tests.support.trace_checks import (
    FIVE,
    check_otlp_json,
    check_perfetto,
    trace_processor_slices,
)
from treadle_cli.infra import alive
from treadle_common.auth import policy as auth
from treadle_common.clients.rollout import GenerationClient
from treadle_common.clients.trainer import TrainerClient

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_skeleton_recipe_runs_three_steps_through_every_service(cli_env, tmp_path):
    result = treadle("run", str(ROOT / "recipes/skeleton.yaml"), env=cli_env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (summary_path,) = (tmp_path / ".treadle" / "runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["state"] == "succeeded" and summary["steps"] == 3
    assert summary["tasks_fed"] == 12
    assert summary["trajectories_produced"] == summary["trajectories_consumed"] == 48
    assert (
        summary["trajectories_acked"] == 48
        and summary["duplicates"] == 0
        and summary["pending_after_run"] == 0
    )
    assert summary["exactly_once"] is True
    assert summary["versions_published"] == summary["weight_store_versions"] == [1, 2, 3]
    assert summary["rollout_policy_version"] == 3 and summary["rollout_swaps"] == 3
    assert (summary_path.parent / "config.yaml").exists()
    # the stack the run started is gone again: no supervisor state left behind
    assert not (tmp_path / ".treadle" / "stack.json").exists()
    assert_one_trace_spans_every_service(tmp_path / ".treadle" / "traces")
    assert_trace_export(summary_path.parent.name, cli_env, tmp_path)


def assert_trace_export(run_id: str, env: dict, cwd: Path) -> None:
    """`treadle trace` writes the run's spans as a Perfetto trace in which one task's
    slices reach all five services, and as OTLP/JSON that parses as OTLP's `TracesData`."""
    pftrace, otlp = cwd / "run.pftrace", cwd / "run.otlp.json"
    for fmt, out in (("perfetto", pftrace), ("otlp-json", otlp)):
        result = treadle("trace", run_id, "--format", fmt, "--out", str(out), env=env, cwd=cwd)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    seen = check_perfetto(pftrace)
    assert set(seen) == FIVE and all(n > 0 for n in seen.values()), seen
    assert check_otlp_json(otlp) > 0
    slices = trace_processor_slices(pftrace)  # None where no trace processor binary is at hand
    assert slices is None or slices > 0
    missing = treadle("trace", "no-such-run", "--out", str(cwd / "x"), env=env, cwd=cwd)
    assert missing.returncode == 1 and "no spans of run" in missing.stdout + missing.stderr


def test_skeleton_recipe_trains_a_lora_adapter_and_moves_only_the_adapter(cli_env, tmp_path):
    """`trainer.lora`: the run publishes its base weights once (under the model) and then
    adapter versions under its own policy model (only the adapter's tensors); rollout serves
    each as an adapter on those base weights; the exported final model has the adapter merged
    in."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = treadle(
        "run",
        str(ROOT / "recipes/skeleton.yaml"),
        *("--set", "trainer.lora.rank=4", "--set", "trainer.loss=cross_entropy"),
        *("--set", "trainer.lr=0.01"),
        env=cli_env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (summary_path,) = (tmp_path / ".treadle" / "runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["state"] == "succeeded" and summary["exactly_once"] is True
    assert summary["trajectories_trained"] == 48
    # tiny@1: the full base weights; tiny.{run}@1: the new adapter, 2..4: one per step
    assert summary["versions_published"] == summary["weight_store_versions"] == [1, 2, 3, 4]
    assert summary["rollout_policy_version"] == 4
    log = (tmp_path / ".treadle" / "logs" / "trainer.log").read_text()
    ready = next(line for line in log.splitlines() if "backend ready" in line)
    assert "backend=LoraBackend" in ready and "lora_rank=4" in ready, ready
    rollout_log = (tmp_path / ".treadle" / "logs" / "rollout.log").read_text()
    sizes = [
        float(line.split("fetched_mb=")[1].split()[0])
        for line in rollout_log.splitlines()
        if "adapter policy swapped" in line
    ]
    full_mb = (tmp_path / ".treadle/models/tiny/model.safetensors").stat().st_size / 2**20
    assert len(sizes) >= 4 and max(sizes) < 0.1 * full_mb, (sizes, full_mb)  # adapters only
    final = Path(summary["final_model_dir"])
    if not final.is_absolute():
        final = tmp_path / final
    merged = load_file(str(final / "model.safetensors"))
    base = load_file(str(tmp_path / ".treadle/models/tiny/model.safetensors"))
    moved = [k for k in base if not torch.equal(merged[k], base[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved), moved
    assert AutoModelForCausalLM.from_pretrained(final) is not None


def test_skeleton_recipe_trains_with_megatron_core_over_two_tensor_parallel_ranks(
    cli_env, tmp_path
):
    """`trainer.backend=megatron`: the run's own stack starts the trainer as two torchrun ranks,
    megatron-core splits every layer over them, and rollout swaps to each version it published
    (in HF layout: rollout cannot tell which backend trained)."""
    result = treadle(
        "run",
        str(ROOT / "recipes/skeleton.yaml"),
        *("--set", "trainer.backend=megatron", "--set", "trainer.tensor_parallel=2"),
        env=cli_env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (summary_path,) = (tmp_path / ".treadle" / "runs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["state"] == "succeeded" and summary["exactly_once"] is True
    assert summary["trajectories_trained"] == 48
    assert summary["versions_published"] == summary["weight_store_versions"] == [1, 2, 3]
    assert summary["rollout_policy_version"] == 3 and summary["rollout_swaps"] == 3
    log = (tmp_path / ".treadle" / "logs" / "trainer.log").read_text()
    ready = next(line for line in log.splitlines() if "backend ready" in line)
    assert "backend=MegatronBackend" in ready and "tensor_parallel=2" in ready, ready
    assert "ranks=2" in ready


def test_a_sync_run_fed_ahead_trains_every_step_on_policy(cli_env, tmp_path):
    """`trainer.feed_ahead`: each step's tasks are fed while the step before trains and wait in
    rollout for its weights; every trajectory is still generated by the version it is
    trained against (staleness 0), and nothing is lost or doubled."""
    result = treadle(
        "run",
        str(ROOT / "recipes/skeleton.yaml"),
        *("--set", "trainer.feed_ahead=true", "--set", "trainer.num_steps=4"),
        env=cli_env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (run_dir,) = (tmp_path / ".treadle" / "runs").glob("*/")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "succeeded" and summary["steps"] == 4
    assert summary["tasks_fed"] == 16 and summary["exactly_once"] is True
    assert summary["trajectories_produced"] == summary["trajectories_consumed"] == 64
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["max_staleness"] == 0 for s in steps)


def assert_one_trace_spans_every_service(trace_dir: Path) -> None:
    """A trained trajectory's trace holds spans of all four services, correctly parented."""
    spans = [
        json.loads(line)
        for path in trace_dir.glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    traces: dict[str, list[dict]] = {}
    for span in spans:
        traces.setdefault(span["context"]["trace_id"], []).append(span)
    trained = [t for t in traces.values() if any(s["name"] == "trainer.step" for s in t)]
    assert trained, f"no trace reaches a trainer step among {len(traces)} traces"
    trace = trained[0]
    services = {s["resource"]["attributes"]["service.name"] for s in trace}
    assert services == {"trainer", "rollout", "env-gateway", "reward"}, services
    names = {s["name"] for s in trace}
    assert {
        "trainer.feed_task",
        "rollout.queued",
        "rollout.task",
        "rollout.episode",
        "rollout.generate",
        "env.CreateSessions",
        "env.Step",
        "rollout.score",
        "reward.score",
        "trainer.queued",
        "trainer.step",
    } <= names, names
    by_id = {s["context"]["span_id"]: s for s in trace}
    (root,) = [s for s in trace if s["parent_id"] is None]
    assert root["name"] == "trainer.feed_task"
    for span in trace:  # every other span hangs off a span of the same trace
        assert span is root or span["parent_id"] in by_id, span["name"]
    parent = {s["name"]: by_id[s["parent_id"]]["name"] for s in trace if s["parent_id"]}
    assert (
        parent["env.Step"] == parent["rollout.score"] == parent["trainer.step"] == "rollout.episode"
    )
    assert parent["reward.score"] == "rollout.score"  # the reward hop as rollout saw it


def test_up_status_down_without_orphans(cli_env, tmp_path):
    up = treadle("up", "--detach", env=cli_env, cwd=tmp_path, timeout=240)
    try:
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        status = treadle("status", "--json", env=cli_env, cwd=tmp_path)
        assert status.returncode == 0, status.stdout
        health = json.loads(status.stdout)
        assert health["healthy"] is True
        assert set(health["services"]) == {
            "weight-store",
            "env-gateway",
            "reward",
            "rollout",
            "trainer",
        }
        assert all(s["healthy"] for s in health["services"].values())
        assert health["infra"]["redis"]["healthy"] and health["infra"]["nats"]["healthy"]
        infra_pids = [
            json.loads(p.read_text())["pid"]
            for p in (tmp_path / ".treadle" / "infra").glob("*.json")
        ]
        pids = [
            health["supervisor_pid"],
            *(s["pid"] for s in health["services"].values()),
            *infra_pids,
        ]
        assert len(infra_pids) == 2 and all(alive(p) for p in pids)
        if len(os.sched_getaffinity(0)) >= 2:  # rollout's engine computes on CPUs of its own
            rollout_pid = health["services"]["rollout"]["pid"]
            children = Path(f"/proc/{rollout_pid}/task/{rollout_pid}/children").read_text()
            (engine_pid,) = map(int, children.split())
            engine_cpus = {
                frozenset(os.sched_getaffinity(int(tid)))
                for tid in os.listdir(f"/proc/{engine_pid}/task")
            }
            assert len(engine_cpus) == 1, engine_cpus  # every thread of the engine process
            (engine,) = engine_cpus
            serving = os.sched_getaffinity(rollout_pid)
            assert engine and serving and not engine & serving, (engine, serving)
        # the thin clients reach the running services
        spec = json.loads((tmp_path / ".treadle" / "stack.json").read_text())["spec"]
        # the admin token `up` wrote (0600) is what a client of this stack presents
        token_file = tmp_path / ".treadle" / "auth" / "admin.token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text()
        assert asyncio.run(_generate_and_list(spec["ports"], token)) == []  # no runs yet
        _tinker_round_trip(spec["ports"], token, spec["model_name"])
        # `treadle run` against a deployed stack (compose, k8s): endpoints from TREADLE_*_URL
        ports = spec["ports"]
        remote_env = {
            **cli_env,
            "TREADLE_STATE_DIR": str(tmp_path / "elsewhere"),  # no stack record to find
            "TREADLE_TOKEN_FILE": str(tmp_path / ".treadle" / "auth" / "admin.token"),
            "TREADLE_TRAINER_URL": f"http://127.0.0.1:{ports['trainer']['http']}",
            "TREADLE_ROLLOUT_URL": f"http://127.0.0.1:{ports['rollout']['http']}",
            "TREADLE_WEIGHT_STORE_URL": f"http://127.0.0.1:{ports['weight-store']['http']}",
            "TREADLE_WEIGHT_STORE_ADDR": f"127.0.0.1:{ports['weight-store']['grpc']}",
            "TREADLE_ENV_GATEWAY_ADDR": f"127.0.0.1:{ports['env-gateway']['grpc']}",
        }
        run = treadle(
            "run",
            str(ROOT / "recipes/skeleton.yaml"),
            "--set",
            f"model.path={spec['model_dir']}",
            "--set",
            f"model.name={spec['model_name']}",
            "--set",
            "run_id=remote-run",
            env=remote_env,
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert json.loads((tmp_path / ".treadle/runs/remote-run/summary.json").read_text())[
            "exactly_once"
        ]
        assert not (tmp_path / "elsewhere" / "stack.json").exists()  # it started no stack
        # status: nothing stalled, and where the finished run's time went
        after_run = json.loads(treadle("status", "--json", env=cli_env, cwd=tmp_path).stdout)
        assert after_run["stalled"] == {}
        assert after_run["services"]["rollout"]["progress"]["generate"]["done"] > 0
        spent = after_run["time"]["runs"]["remote-run"]
        assert spent["step"] == 3 and 0 <= spent["wait_for_batch_fraction"] <= 1
        assert 0 < after_run["time"]["rollout"]["engine_busy_fraction"] <= 1
        # a crashed service is reported and restarted by the supervisor
        os.kill(health["services"]["reward"]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            reward = json.loads(treadle("status", "--json", env=cli_env, cwd=tmp_path).stdout)[
                "services"
            ]["reward"]
            if reward["restarts"] == 1 and reward["healthy"]:
                break
            time.sleep(0.5)
        assert reward["restarts"] == 1 and reward["healthy"], reward
        pids.append(reward["pid"])
    finally:
        down = treadle("down", env=cli_env, cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert not [p for p in pids if alive(p)]
    after = treadle("status", "--json", env=cli_env, cwd=tmp_path)
    assert after.returncode == 1 and json.loads(after.stdout)["running"] is False


def _tinker_round_trip(ports: dict, token: str, model_name: str) -> None:
    """The Tinker SDK against the stack `treadle up` started: its model is served for LoRA
    training, and a trained adapter samples through the stack's rollout."""
    import tinker
    from tinker import types

    trainer_url = f"http://127.0.0.1:{ports['trainer']['http']}"
    with tinker.ServiceClient(base_url=trainer_url, api_key="tml-" + token) as sc:
        client = sc.create_lora_training_client(base_model=model_name, rank=4).result()
        tokens = [5, 6, 7, 8, 9]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 4},
        )
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = client.save_weights_and_get_sampling_client().result()
        out = sampler.sample(
            types.ModelInput.from_ints(tokens), 2, types.SamplingParams(max_tokens=3)
        ).result()
        assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 3 for s in out.sequences)


async def _generate_and_list(ports: dict, token: str) -> list:
    rollout = GenerationClient(f"127.0.0.1:{ports['rollout']['grpc']}", token=token)
    result = await rollout.generate([1, 2, 3], max_new_tokens=5, temperature=0.0)
    await rollout.close()
    assert 1 <= len(result.tokens) <= 5
    assert len(result.logprobs) == len(result.token_versions) == len(result.tokens)
    assert all(lp <= 0 for lp in result.logprobs) and set(result.token_versions) == {0}
    http = httpx.Client(headers=auth.bearer(token))
    trainer = TrainerClient(f"http://127.0.0.1:{ports['trainer']['http']}", http)
    return trainer.list_runs()  # typed: RunStatus models


def test_bad_recipe_fails_before_anything_starts(cli_env, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: {path: m}\nrollout: {group_size: -1}\ntrainer: {lr: fast}\n")
    result = treadle("run", str(recipe), env=cli_env, cwd=tmp_path)
    assert result.returncode == 2
    assert "rollout.group_size" in result.stderr and "trainer.lr" in result.stderr
    assert not (tmp_path / ".treadle").exists()


def test_up_with_a_port_in_use_names_port_and_service(cli_env, tmp_path):
    base = int(cli_env["TREADLE_BASE_PORT"])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + 2))  # env-gateway grpc
        squatter.listen()
        result = treadle("up", "--detach", env=cli_env, cwd=tmp_path)
    assert result.returncode == 1
    assert f"port {base + 2} (env-gateway grpc) is already in use" in result.stderr.replace(
        "\n", " "
    )
