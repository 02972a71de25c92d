"""`treadle bench rollout`: generation through the rollout service vs the same engine in-process.

Starts private redis + nats, a weight-store and a rollout service (hf engine) on a tiny local
model. In the same run, each round sends `prompts` concurrent requests to the service's
gRPC Generate API and then has an in-process `HFEngine` on the same model generate the same
prompts with the same seeds and the same concurrency. Then, while the service is
generating, the trainer side publishes `swaps` new versions; the service fetches each delta
and swaps at a step boundary.

    service_tokens_per_s     generated tokens / s through the service (median round)
    raw_engine_tokens_per_s  the same work on the engine in this process (median round)
    ratio                    median of per-round service / raw
    swap_pause_ms_p50        median generation pause of the service's swaps
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from treadle_bench.harness import free_port, infra_with_weight_store, start_service
from treadle_cli.tiny_model import init_tiny
from treadle_common.auth import bearer, token_from_env
from treadle_common.clients.rollout import GenerationClient
from treadle_common.clients.torch_weights import TorchWeightClient
from treadle_common.logs import configure_logging
from treadle_rollout.engines.base import Sampling
from treadle_rollout.engines.hf import HFEngine


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer(f"{i}+{3 * i}= what is the answer " * (1 + i % 4), add_special_tokens=False)[
            "input_ids"
        ]
        for i in range(n)
    ]


async def service_round(address: str, prompts, max_new: int) -> tuple[int, float]:
    client = GenerationClient(address)
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            client.generate(p, max_new_tokens=max_new, temperature=1.0, seed=i + 1)
            for i, p in enumerate(prompts)
        )
    )
    elapsed = time.perf_counter() - start
    await client.close()
    return sum(len(r.tokens) for r in results), elapsed


async def raw_round(engine: HFEngine, prompts, max_new: int) -> tuple[int, float]:
    start = time.perf_counter()
    gens = await asyncio.gather(
        *(
            engine.generate(p, Sampling(1.0, 1.0, max_new, seed=i + 1))
            for i, p in enumerate(prompts)
        )
    )
    return sum(len(g.tokens) for g in gens), time.perf_counter() - start


async def swap_pauses(http: str, grpc_addr: str, store_addr: str, model_dir: Path, swaps: int):
    """Publish `swaps` versions while the service generates; its recorded pauses (s)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    client = TorchWeightClient(store_addr)
    load_prompts = [[5, 6, 7, 8] * 4] * 8
    async with httpx.AsyncClient(headers=bearer(token_from_env())) as http_client:
        for step in range(1, swaps + 1):
            with torch.no_grad():
                model.model.norm.weight.mul_(1.01)
            load = asyncio.create_task(service_round(grpc_addr, load_prompts, 24))
            version = await client.publish(model.state_dict(), "bench-tiny", step=step)
            await load
            while True:
                info = (await http_client.get(f"{http}/v1/info")).json()
                if info["policy_version"] >= version:
                    break
                await asyncio.sleep(0.05)
        swaps_done = (await http_client.get(f"{http}/v1/swaps")).json()["swaps"]
    await client.close()
    return [s["pause_s"] for s in swaps_done]


def run(prompts: int = 32, max_new_tokens: int = 32, rounds: int = 3, swaps: int = 5) -> dict:
    configure_logging("bench", level="WARNING")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = init_tiny(tmp / "bench-tiny")
        with infra_with_weight_store(tmp) as (infra, common, procs):
            ports = {k: free_port() for k in ("ro_http", "ro_grpc")}
            procs.append(  # healthy is enough: the bench needs no env-gateway
                start_service(
                    "treadle_rollout",
                    {
                        **common,
                        "TREADLE_NATS_URL": infra.url_for("nats", "rollout"),
                        "TREADLE_GRPC_PORT": str(ports["ro_grpc"]),
                        "TREADLE_ROLLOUT_MODEL": str(model_dir),
                        "TREADLE_ROLLOUT_MODEL_NAME": "bench-tiny",
                    },
                    ports["ro_http"],
                    log=tmp / "rollout.log",
                    ready_path="/healthz",
                )
            )
            http = f"http://127.0.0.1:{ports['ro_http']}"
            grpc_addr = f"127.0.0.1:{ports['ro_grpc']}"
            result = asyncio.run(
                _measure(
                    model_dir,
                    grpc_addr,
                    http,
                    common["TREADLE_WEIGHT_STORE_ADDR"],
                    prompts,
                    max_new_tokens,
                    rounds,
                    swaps,
                )
            )
    return {"bench": "rollout", "engine": "hf", "prompts": prompts, **result}


async def _measure(model_dir, grpc_addr, http, store_addr, n, max_new, rounds, swaps) -> dict:
    engine = HFEngine(model_dir, "bench-tiny")
    prompts = make_prompts(engine.tokenizer, n)
    await service_round(grpc_addr, prompts[:4], 4)  # warm-up: connections, first batch
    await raw_round(engine, prompts[:4], 4)
    service_rates, raw_rates, ratios = [], [], []
    for _ in range(rounds):
        tokens_s, secs_s = await service_round(grpc_addr, prompts, max_new)
        tokens_r, secs_r = await raw_round(engine, prompts, max_new)
        service_rates.append(tokens_s / secs_s)
        raw_rates.append(tokens_r / secs_r)
        ratios.append(service_rates[-1] / raw_rates[-1])
    await engine.close()
    pauses = await swap_pauses(http, grpc_addr, store_addr, Path(model_dir), swaps)
    return {
        "max_new_tokens": max_new,
        "rounds": rounds,
        "service_tokens_per_s": round(statistics.median(service_rates), 1),
        "raw_engine_tokens_per_s": round(statistics.median(raw_rates), 1),
        "ratio": round(statistics.median(ratios), 3),
        "swaps": len(pauses),
        "swap_pause_ms_p50": round(statistics.median(pauses) * 1e3, 3) if pauses else None,
        "swap_pause_ms_max": round(max(pauses) * 1e3, 3) if pauses else None,
    }
