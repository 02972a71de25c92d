"""The real `treadle` CLI as a subprocess, on private infrastructure and free ports."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port_range, free_ports
from treadle_common.clients.rollout import GenerationClient
from treadle_common.clients.trainer import TrainerClient
from treadle_common.infra import alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TREADLE = str(Path(sys.executable).parent / "treadle")


@pytest.fixture
def cli_env(tmp_path) -> dict[str, str]:
    redis_port, nats_port = free_ports(2)
    return {
        **os.environ,
        "TREADLE_STATE_DIR": str(tmp_path / ".treadle"),
        "TREADLE_REDIS_URL": f"redis://127.0.0.1:{redis_port}",
        "TREADLE_NATS_URL": f"nats://127.0.0.1:{nats_port}",
        "TREADLE_BASE_PORT": str(free_port_range(8)),
        "TREADLE_TRACE_SAMPLE": "1",  # every task traced: the skeleton run checks one trace
    }


def treadle(*args: str, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TREADLE, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


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
        parent["env.Step"] == parent["reward.score"] == parent["trainer.step"] == "rollout.episode"
    )


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
        # the thin clients reach the running services
        spec = json.loads((tmp_path / ".treadle" / "stack.json").read_text())["spec"]
        assert asyncio.run(_generate_and_list(spec["ports"])) == []  # no runs submitted yet
        # `treadle run` against a deployed stack (compose, k8s): endpoints from TREADLE_*_URL
        ports = spec["ports"]
        remote_env = {
            **cli_env,
            "TREADLE_STATE_DIR": str(tmp_path / "elsewhere"),  # no stack record to find
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
        spent = after_run["time"]["trainer remote-run"]
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


async def _generate_and_list(ports: dict) -> list:
    rollout = GenerationClient(f"127.0.0.1:{ports['rollout']['grpc']}")
    result = await rollout.generate([1, 2, 3], max_new_tokens=5, temperature=0.0)
    await rollout.close()
    assert 1 <= len(result.tokens) <= 5
    assert len(result.logprobs) == len(result.token_versions) == len(result.tokens)
    assert all(lp <= 0 for lp in result.logprobs) and set(result.token_versions) == {0}
    trainer = TrainerClient(f"http://127.0.0.1:{ports['trainer']['http']}")
    runs = await trainer.list_runs()
    await trainer.close()
    return runs


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
