"""`treadle bench rollout`: generation through the rollout service vs the same engine in-process.

Starts private redis + nats, a weight-store and a rollout service (hf engine) on a tiny local
model (or `model`, an imported one). In the same run, each round sends `prompts` concurrent
requests to the service's gRPC Generate API and then has an in-process `HFEngine` on the
same model generate the same prompts with the same seeds and the same concurrency. Then,
while the service is generating, the trainer side publishes `swaps` new versions; the
service fetches each delta and swaps at a step boundary.

    service_tokens_per_s     generated tokens / s through the service (median round)
    raw_engine_tokens_per_s  the same work on the engine in this process (median round)
    ratio                    median of per-round service / raw
    hf_generate_tokens_per_s the same prompts as one batch through transformers' own
                             `generate` (left-padded, sampled at temperature 1, each row's
                             tokens up to its end of sequence counted; median round): the
                             plain HF equivalent of the engine
    engine_over_hf_generate  raw_engine_tokens_per_s / hf_generate_tokens_per_s
    openai_stream_tokens_per_s  the same prompts as chat messages, streamed (SSE) through
                             the service's OpenAI API, as a sustained load: 4 x `prompts`
                             requests per round, `prompts` in flight at a time (median
                             round). The client is a lean SSE reader (`sse_client`:
                             HTTP/1.1 keep-alive over httptools; it parses every event's
                             JSON), because on a small machine the client shares the cores
                             with the service: the official `openai` client spends about
                             twice the service's CPU per request, aiohttp about half
    openai_raw_engine_tokens_per_s  the engine in this process, the same requests (chat
                             prompts, seeds) at the same concurrency (median round)
    openai_stream_ratio      median of per-round stream / raw
    openai_stream_ttft_ms_p50  median time from sending a request to its first content chunk
    openai_sdk_stream_tokens_per_s, openai_sdk_stream_ratio  the same load sent by the
                             official `openai` client (`AsyncOpenAI`), against the same raw
                             rounds: what a client on the service's own cores costs it
    swap_pause_ms_p50        median generation pause of the service's swaps

The engine runs with `torch_threads` torch threads on both sides (default: half the cores,
what `treadle up` gives rollout, which also sets `OMP_WAIT_POLICY=PASSIVE` for it, as here).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import torch

from treadle_bench.harness import free_port, infra_with_weight_store, start_service
from treadle_bench.sse_client import SSEClient
from treadle_cli.tiny_model import init_tiny
from treadle_common.auth.policy import bearer, token_from_env
from treadle_common.clients.rollout import GenerationClient
from treadle_common.clients.torch_weights import TorchWeightClient
from treadle_common.runtime.logs import configure_logging
from treadle_rollout.public import HFEngine, Sampling, cpus, session_free_prompt

SERVED = "bench-model"
"""The name the service serves the model under."""


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


def hf_generate_round(engine: HFEngine, prompts, max_new: int, seed: int) -> tuple[int, float]:
    """The prompts as one left-padded batch through the engine's model's own `generate`
    (sampled, temperature 1): the tokens generated (each row's up to and including its end of
    sequence) and the seconds."""
    model, pad, eos = engine.model, engine.pad_id, engine.eos_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=engine.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=engine.device
    )
    torch.manual_seed(seed)
    sync = torch.cuda.synchronize if engine.device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]  # engine.model is typed as a Module
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=pad,
            eos_token_id=eos,
        )
    sync()
    secs = time.perf_counter() - start
    tokens = 0
    for row in out[:, width:].tolist():
        tokens += row.index(eos) + 1 if eos in row else len(row)
    return tokens, secs


def chat_messages(n: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"{i}+{3 * i}= what is the answer " * (1 + i % 4)}]
        for i in range(n)
    ]


async def _closed_loop(one, concurrency: int, total: int) -> float:
    """`total` requests, `concurrency` in flight at a time (each worker sends its next as
    soon as its last finished: the sustained load a serving path sees); the seconds."""
    counter = iter(range(total))
    start = time.perf_counter()

    async def worker() -> None:
        for i in counter:
            await one(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


async def openai_stream_load(
    client: openai.AsyncOpenAI, conversations, max_new: int, total: int
) -> tuple[int, float, list[float]]:
    """`total` streamed chat completions, `len(conversations)` at a time; tokens, seconds
    and each request's time to its first content chunk."""
    tokens: list[int] = []
    firsts: list[float] = []

    async def one(i: int) -> None:
        sent = time.perf_counter()
        stream = await client.chat.completions.create(
            model=SERVED,
            messages=conversations[i % len(conversations)],
            max_tokens=max_new,
            temperature=1.0,
            seed=i + 1,
            stream=True,
            stream_options={"include_usage": True},
        )
        first = 0.0
        async for chunk in stream:
            if not first and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - sent
                firsts.append(first)
            if chunk.usage is not None:
                tokens.append(chunk.usage.completion_tokens)

    secs = await _closed_loop(one, len(conversations), total)
    return sum(tokens), secs, firsts


async def sse_stream_load(
    client: SSEClient, conversations, max_new: int, total: int
) -> tuple[int, float, list[float]]:
    """As `openai_stream_load`, with a lean client (`sse_client`): every event's JSON
    parsed, the tokens from the usage of the last one."""
    tokens: list[int] = []
    firsts: list[float] = []

    async def one(i: int) -> None:
        sent = time.perf_counter()
        state = {"first": 0.0, "done": False}

        def on_data(data: bytes) -> None:
            if data.startswith(b"[DONE]"):
                state["done"] = True
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            choices = chunk["choices"]
            if not state["first"] and choices and choices[0]["delta"].get("content"):
                state["first"] = time.perf_counter() - sent
                firsts.append(state["first"])
            if chunk.get("usage"):
                tokens.append(chunk["usage"]["completion_tokens"])

        body = {
            "model": SERVED,
            "messages": conversations[i % len(conversations)],
            "max_tokens": max_new,
            "temperature": 1.0,
            "seed": i + 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        await client.post("/v1/chat/completions", body, on_data)
        if not state["done"]:
            raise RuntimeError("a stream ended without [DONE]")

    secs = await _closed_loop(one, len(conversations), total)
    return sum(tokens), secs, firsts


async def raw_load(engine: HFEngine, prompts, max_new: int, total: int) -> tuple[int, float]:
    """The same requests (prompt, seed) on the engine, with the same concurrency."""
    tokens: list[int] = []

    async def one(i: int) -> None:
        gen = await engine.generate(prompts[i % len(prompts)], Sampling(1.0, 1.0, max_new, i + 1))
        tokens.append(len(gen.tokens))

    secs = await _closed_loop(one, len(prompts), total)
    return sum(tokens), secs


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
            version = await client.publish(model.state_dict(), SERVED, step=step)
            await load
            while True:
                info = (await http_client.get(f"{http}/v1/info")).json()
                if info["policy_version"] >= version:
                    break
                await asyncio.sleep(0.05)
        swaps_done = (await http_client.get(f"{http}/v1/swaps")).json()["swaps"]
    await client.close()
    return [s["pause_s"] for s in swaps_done]


def run(
    prompts: int = 32,
    max_new_tokens: int = 32,
    rounds: int = 5,
    swaps: int = 5,
    hidden_size: int = 128,
    layers: int = 2,
    torch_threads: int = 0,
    engine_cpus: str = "auto",
    model: Path | None = None,
) -> dict:
    configure_logging("bench", level="WARNING")
    threads = torch_threads or max(1, (os.cpu_count() or 2) // 2)
    split = cpus.split(engine_cpus, threads)
    torch.set_num_threads(threads)  # the in-process engine's, as the service's below
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = model or init_tiny(
            tmp / "tiny",
            hidden_size=hidden_size,
            num_layers=layers,
            num_heads=max(1, hidden_size // 64),
        )
        with infra_with_weight_store(tmp) as (infra, common, procs):
            http, grpc_addr = _serve(infra, common, procs, tmp, model_dir, threads, engine_cpus)
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
                    split,
                )
            )
    shape = {"hidden_size": hidden_size, "layers": layers}
    return {
        "bench": "rollout",
        "engine": "hf",
        "prompts": prompts,
        "model": model.name if model is not None else shape,
        "torch_threads": threads,
        "engine_cpus": split[0] if split else None,
        "serving_cpus": split[1] if split else None,
        **result,
    }


def _serve(
    infra, common: dict, procs: list, tmp: Path, model_dir: Path, threads: int, engine_cpus: str
) -> tuple[str, str]:
    """A rollout replica on the model: its HTTP URL and gRPC address."""
    ports = {k: free_port() for k in ("ro_http", "ro_grpc")}
    procs.append(  # healthy is enough: the bench needs no env-gateway
        start_service(
            "treadle_rollout",
            {
                **common,
                "TREADLE_NATS_URL": infra.url_for("nats", "rollout"),
                "TREADLE_REDIS_URL": infra.url_for("redis", "rollout"),
                "TREADLE_GRPC_PORT": str(ports["ro_grpc"]),
                "TREADLE_ROLLOUT_MODEL": str(model_dir),
                "TREADLE_ROLLOUT_MODEL_NAME": SERVED,
                "TREADLE_TORCH_THREADS": str(threads),
                "TREADLE_ROLLOUT_ENGINE_CPUS": engine_cpus,
                "OMP_WAIT_POLICY": "PASSIVE",
            },
            ports["ro_http"],
            log=tmp / "rollout.log",
            ready_path="/healthz",
        )
    )
    http = f"http://127.0.0.1:{ports['ro_http']}"
    grpc_addr = f"127.0.0.1:{ports['ro_grpc']}"
    return http, grpc_addr


async def _measure(
    model_dir, grpc_addr, http, store_addr, n, max_new, rounds, swaps, split
) -> dict:
    # as in the service: the engine's thread on its CPUs, and here the load (the clients)
    # where the service serves, off them
    engine = HFEngine(model_dir, SERVED, cpus=split[0] if split else None)
    cpus.bind(split[1] if split else None)
    prompts = make_prompts(engine.tokenizer, n)
    # warm-up, a whole round on each side: connections, the first batch, and the caches
    # (prefix KV, chat openings) that every later round finds warm; without it the first
    # round measured a cold start, which a sustained load sees once
    await service_round(grpc_addr, prompts, max_new)
    await raw_round(engine, prompts, max_new)
    grpc = await _grpc_rounds(engine, grpc_addr, prompts, max_new, rounds)
    plain = await _hf_generate_rounds(engine, prompts, max_new, rounds, split[0] if split else None)
    streamed = await _openai_rounds(engine, http, n, max_new, rounds)
    await engine.close()
    pauses = await swap_pauses(http, grpc_addr, store_addr, Path(model_dir), swaps)
    return {
        "max_new_tokens": max_new,
        "rounds": rounds,
        **grpc,
        "hf_generate_tokens_per_s": plain,
        "engine_over_hf_generate": round(grpc["raw_engine_tokens_per_s"] / plain, 3),
        **streamed,
        "swaps": len(pauses),
        "swap_pause_ms_p50": round(statistics.median(pauses) * 1e3, 3) if pauses else None,
        "swap_pause_ms_max": round(max(pauses) * 1e3, 3) if pauses else None,
    }


async def _grpc_rounds(engine: HFEngine, grpc_addr: str, prompts, max_new: int, rounds: int):
    """The service's gRPC generation against the engine in process, round by round."""
    service_rates, raw_rates, ratios = [], [], []
    for _ in range(rounds):
        tokens_s, secs_s = await service_round(grpc_addr, prompts, max_new)
        tokens_r, secs_r = await raw_round(engine, prompts, max_new)
        service_rates.append(tokens_s / secs_s)
        raw_rates.append(tokens_r / secs_r)
        ratios.append(service_rates[-1] / raw_rates[-1])
    return {
        "service_tokens_per_s": round(statistics.median(service_rates), 1),
        "raw_engine_tokens_per_s": round(statistics.median(raw_rates), 1),
        "ratio": round(statistics.median(ratios), 3),
    }


async def _hf_generate_rounds(
    engine: HFEngine, prompts, max_new: int, rounds: int, engine_cpus: list[int] | None
) -> float:
    """transformers' `generate` on the same prompts, on a thread bound to the CPUs the engine
    computes on: the median round's tokens per second, after a warm-up round."""
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1, initializer=cpus.bind, initargs=(engine_cpus,)) as thread:
        await loop.run_in_executor(thread, hf_generate_round, engine, prompts, max_new, 0)
        rates = []
        for r in range(rounds):
            round_ = (engine, prompts, max_new, r + 1)
            tokens, secs = await loop.run_in_executor(thread, hf_generate_round, *round_)
            rates.append(tokens / secs)
    return round(statistics.median(rates), 1)


async def _openai_rounds(engine: HFEngine, http: str, n: int, max_new: int, rounds: int):
    """The OpenAI API, streamed, against the engine on the same chat prompts and seeds."""
    conversations = chat_messages(n)
    chat_prompts = [session_free_prompt(engine.tokenizer, m) for m in conversations]
    client = openai.AsyncOpenAI(
        base_url=f"{http}/v1", api_key=token_from_env() or "none", max_retries=0
    )
    host, port = http.removeprefix("http://").rsplit(":", 1)
    lean = SSEClient(host, int(port), bearer(token_from_env()))
    await openai_stream_load(client, conversations[:4], 4, 4)  # warm-up, as above
    await sse_stream_load(lean, conversations, max_new, n)
    await raw_load(engine, chat_prompts, max_new, n)
    stream_rates, chat_raw_rates, stream_ratios, ttfts = [], [], [], []
    sdk_rates, sdk_ratios = [], []
    for _ in range(rounds):
        total = 4 * n
        # the raw side right after the stream it is compared with: this machine's speed
        # drifts by 10-20% within seconds, and the SDK's round is compared with it too
        tokens_o, secs_o, firsts = await sse_stream_load(lean, conversations, max_new, total)
        tokens_c, secs_c = await raw_load(engine, chat_prompts, max_new, total)
        tokens_k, secs_k, _ = await openai_stream_load(client, conversations, max_new, total)
        stream_rates.append(tokens_o / secs_o)
        sdk_rates.append(tokens_k / secs_k)
        chat_raw_rates.append(tokens_c / secs_c)
        stream_ratios.append(stream_rates[-1] / chat_raw_rates[-1])
        sdk_ratios.append(sdk_rates[-1] / chat_raw_rates[-1])
        ttfts += firsts
    await lean.close()
    await client.close()
    return {
        "openai_stream_tokens_per_s": round(statistics.median(stream_rates), 1),
        "openai_raw_engine_tokens_per_s": round(statistics.median(chat_raw_rates), 1),
        "openai_stream_ratio": round(statistics.median(stream_ratios), 3),
        "openai_stream_ttft_ms_p50": round(statistics.median(ttfts) * 1e3, 1) if ttfts else None,
        "openai_sdk_stream_tokens_per_s": round(statistics.median(sdk_rates), 1),
        "openai_sdk_stream_ratio": round(statistics.median(sdk_ratios), 3),
    }
