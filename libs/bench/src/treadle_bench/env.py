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
from treadle_common.logs import configure_logging
from treadle_common.proto.treadle.v1 import env_pb2 as pb


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
    from treadle_env_gateway.envs.arith import Arith

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
