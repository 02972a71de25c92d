"""`treadle bench env`: episodes through the env-gateway vs a plain gRPC echo, same concurrency.

A second process hosts the real EnvGateway servicer and a raw echo service. `sessions`
concurrent workers each loop: CreateSession(arith) -> Step(answer) -> CloseSession. The raw
baseline makes the same three unary calls per loop with payloads of the same sizes, as plain
echo. Reported:

    steps_per_s   Step calls per second (one per arith episode)
    p50_ms/p99_ms latency of the Step calls
    raw_grpc_rps  echo calls per second
    ratio         episodes per second / raw loops per second (both three calls each)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import grpc

from treadle_bench.harness import free_port, server_process
from treadle_common.clients.env import EnvClient
from treadle_common.proto.treadle.v1 import env_pb2 as pb
from treadle_common.runtime.logs import configure_logging


async def _ours(
    address: str, tasks: list[dict], sessions: int, seconds: float
) -> tuple[int, list[float]]:
    client = EnvClient(address)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        task = tasks[i % len(tasks)]
        while time.perf_counter() < deadline:
            session = await client.create("arith", task)
            start = time.perf_counter()
            await client.step(session.session_id, task["answer"])
            latencies.append(time.perf_counter() - start)
            await client.close_session(session.session_id)

    await asyncio.gather(*(worker(i) for i in range(sessions)))
    await client.close()
    return len(latencies), latencies


async def _raw(address: str, task: dict, sessions: int, seconds: float) -> int:
    create = pb.CreateSessionRequest(env="arith", task_json=json.dumps(task)).SerializeToString()
    step = pb.StepRequest(
        session_id="x" * 40, action=pb.Action(text=task["answer"])
    ).SerializeToString()
    close = pb.CloseSessionRequest(session_id="x" * 40).SerializeToString()
    loops = 0
    deadline = time.perf_counter() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary("/treadle.bench.Echo/Call")

        async def worker() -> None:
            nonlocal loops
            while time.perf_counter() < deadline:
                for payload in (create, step, close):
                    await call(payload)
                loops += 1

        await asyncio.gather(*(worker() for _ in range(sessions)))
    return loops


def run(sessions: int = 256, seconds: float = 10.0) -> dict:
    configure_logging("bench", level="WARNING")
    from treadle_env_gateway.public import Arith

    tasks = Arith.sample_tasks(64, seed=0, split="bench", options={})
    port = free_port()
    address = f"127.0.0.1:{port}"
    with server_process("treadle_bench.env_server", str(port)):
        asyncio.run(_raw(address, tasks[0], 8, 1.0))  # warm-up
        asyncio.run(_ours(address, tasks, 8, 1.0))
        raw_loops = asyncio.run(_raw(address, tasks[0], sessions, seconds))
        steps, latencies = asyncio.run(_ours(address, tasks, sessions, seconds))
    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "bench": "env",
        "env": "arith",
        "sessions": sessions,
        "seconds": seconds,
        "steps_per_s": round(steps / seconds, 1),
        "p50_ms": round(statistics.median(latencies) * 1e3, 2),
        "p99_ms": round(quantiles[98] * 1e3, 2),
        "raw_grpc_rps": round(raw_loops * 3 / seconds, 1),
        "ratio": round(steps / raw_loops, 3),
    }


# --- the code sandbox, per backend ---------------------------------------------------------

SANDBOX_CODE = "```python\ndef add(a, b):\n    return a + b\n```"
SANDBOX_TESTS = "assert add(2, 3) == 5\nassert add(0, 1) == 1"
SANDBOX_TASK = {"prompt": "Write add(a, b).", "tests": SANDBOX_TESTS}
"""`sandbox_run`'s episode: a right answer, so every run goes the whole way (two sandboxes,
the calls relayed, the verdict)."""


async def _sandboxed(address: str, sessions: int, seconds: float) -> dict:
    """`python_tests` episodes (tests in one sandbox, the code in another) at `sessions`
    concurrency: how many judged runs per second, and how each ended."""
    client = EnvClient(address)
    outcomes: dict[str, int] = {}
    errors: dict[str, str] = {}
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            session = await client.create("python_tests", SANDBOX_TASK)
            start = time.perf_counter()
            step = await client.step(session.session_id, SANDBOX_CODE)
            latencies.append(time.perf_counter() - start)
            info = json.loads(step.info_json or "{}")
            outcome = step.status or info.get("sandbox", "?")
            if step.status in ("", "ok") and step.reward == 1.0:
                outcome = "passed"
            elif outcome not in errors:
                errors[outcome] = (step.error or info.get("stderr", ""))[-300:]
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            await client.close_session(session.session_id)

    await asyncio.gather(*(worker() for _ in range(sessions)))
    await client.close()
    return {"outcomes": outcomes, "errors": errors, "latencies": latencies}


def sandbox_run(sessions: int = 64, seconds: float = 10.0, backends: tuple[str, ...] = ()) -> dict:
    """`sandbox_runs_per_s` per backend: a gateway per backend (TREADLE_ENV_SANDBOX), the same
    `python_tests` load on each; a backend that cannot run here is reported with its reason."""
    import os
    import tempfile
    from pathlib import Path

    from treadle_env_gateway.public import Sandbox

    configure_logging("bench", level="WARNING")
    backends = backends or ("unshare", "bwrap", "docker")
    image = os.environ.get("TREADLE_ENV_SANDBOX_IMAGE", "python:3.11-slim-bookworm")
    results: dict[str, dict] = {}
    state = Path(".treadle") / "bench-sandbox"  # others must reach it (a root bwrap's uids)
    state.mkdir(parents=True, exist_ok=True)
    for backend in backends:
        probe = Sandbox(Path(tempfile.mkdtemp()), backend=backend, image=image).backend
        if why := probe.unavailable():
            results[backend] = {"available": False, "reason": why}
            continue
        port = free_port()
        env = {
            "TREADLE_ENV_SANDBOX": backend,
            "TREADLE_ENV_SANDBOX_IMAGE": image,
            "TREADLE_STATE_DIR": str(state.resolve()),
        }
        with server_process("treadle_bench.env_server", str(port), env=env):
            address = f"127.0.0.1:{port}"
            asyncio.run(_sandboxed(address, 4, 1.0))  # warm-up
            measured = asyncio.run(_sandboxed(address, sessions, seconds))
        runs, lat = sum(measured["outcomes"].values()), measured["latencies"]
        results[backend] = {
            "available": True,
            "sandbox_runs_per_s": round(runs / seconds, 2),
            "p50_ms": round(statistics.median(lat) * 1e3, 1) if lat else None,
            "outcomes": measured["outcomes"],
            "first_error": measured["errors"],
        }
    base = results.get("unshare", {}).get("sandbox_runs_per_s")
    for result in results.values():
        if base and result.get("sandbox_runs_per_s") is not None:
            result["vs_unshare"] = round(result["sandbox_runs_per_s"] / base, 3)
    return {
        "bench": "env-sandbox",
        "env": "python_tests",
        "sessions": sessions,
        "seconds": seconds,
        "image": image,
        "backends": results,
    }
