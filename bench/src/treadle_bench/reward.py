"""`treadle bench reward`: scoring throughput with 1 and then 2 reward replicas.

Real processes: a private nats-server, `python -m treadle_reward` replicas in queue group
`reward`, and this client sending CPU-bound requests (`bench_cpu`) over NATS request-reply
with fixed concurrency. Adding a replica should add capacity with no coordinator:

    scores_per_s_1, scores_per_s_2   throughput with one / two replicas
    scaling                          scores_per_s_2 / scores_per_s_1
    p99_ms                           request latency at the 99th percentile (two replicas)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import nats

from treadle_bench.harness import bench_auth, free_port, start_service
from treadle_cli.infra import Infra, terminate
from treadle_common.auth import infra as infra_auth
from treadle_common.clients.reward import RewardClient
from treadle_common.config.settings import Settings
from treadle_common.proto.treadle.v1 import reward_pb2 as pb
from treadle_common.runtime.logs import configure_logging


def start_replica(nats_url: str, state_dir: str) -> subprocess.Popen:
    env = {
        "TREADLE_NATS_URL": nats_url,
        "TREADLE_STATE_DIR": state_dir,
        "TREADLE_SCORER_MODULES": "treadle_bench.cpu_scorer",
        "TREADLE_REWARD_CACHE_SIZE": "0",
        "TREADLE_LOG_LEVEL": "WARNING",
    }
    return start_service("treadle_reward", env, free_port(), timeout_s=60)


async def load(
    nats_url: str, requests: int, concurrency: int, rounds: int
) -> tuple[float, list[float]]:
    nc = await nats.connect(nats_url, inbox_prefix=infra_auth.inbox_prefix_of(nats_url))
    client = RewardClient(nc, timeout_s=120)
    latencies: list[float] = []
    queue = iter(range(requests))

    async def worker() -> None:
        for i in queue:
            request = pb.ScoreRequest(
                scorer="bench_cpu",
                answer=f"answer {i}",
                options_json=json.dumps({"rounds": rounds}),
            )
            start = time.perf_counter()
            result = await client.score(request)
            assert result.status == pb.SCORE_STATUS_OK, result.message
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await nc.close()
    return requests / elapsed, latencies


def run(requests: int = 200, concurrency: int = 32, rounds: int = 100_000) -> dict:
    configure_logging("bench", level="WARNING")
    with tempfile.TemporaryDirectory() as tmp, bench_auth():
        settings = Settings(
            state_dir=Path(tmp),
            nats_url=f"nats://127.0.0.1:{free_port()}",
            redis_url="redis://127.0.0.1:1",
        )
        infra = Infra(settings)
        replicas: list[subprocess.Popen] = []
        try:
            infra.up(("nats",))
            scorer, caller = infra.url_for("nats", "reward"), infra.url_for("nats", "rollout")
            replicas.append(start_replica(scorer, tmp))
            asyncio.run(load(caller, concurrency, concurrency, rounds))  # warm-up
            one, _ = asyncio.run(load(caller, requests, concurrency, rounds))
            replicas.append(start_replica(scorer, tmp))
            asyncio.run(load(caller, concurrency, concurrency, rounds))
            two, latencies = asyncio.run(load(caller, requests, concurrency, rounds))
        finally:
            for proc in replicas:
                terminate(proc.pid)
            infra.down()
    return {
        "bench": "reward",
        "scorer": "bench_cpu",
        "requests": requests,
        "concurrency": concurrency,
        "scores_per_s_1": round(one, 1),
        "scores_per_s_2": round(two, 1),
        "scaling": round(two / one, 3),
        "p99_ms": round(statistics.quantiles(latencies, n=100)[98] * 1e3, 1),
    }
