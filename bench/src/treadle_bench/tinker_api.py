"""`treadle bench tinker`: the Tinker SDK against Treadle vs the same work without the API.

Starts private redis + nats, a weight-store, a rollout service (hf engine) and a trainer
serving the Tinker API on a tiny local model, then in the same run:

    sdk_steps_per_s          forward_backward + optim_step (a LoRA client, cross_entropy on a
                             fixed batch) through the `tinker` SDK, each step's results fetched
    inprocess_steps_per_s    the same step on the same adapter code in this process
    train_ratio              sdk / in-process (median of per-round ratios)
    sdk_sample_tokens_per_s  tokens sampled through the SDK (a trained adapter's sampling
                             client; `prompts` concurrent requests of `num_samples` each)
    rollout_tokens_per_s     the same requests straight to rollout's /v1/completions, one
                             HTTP request per prompt (the adapter named as the model)
    sample_ratio             sdk / rollout (median of per-round ratios)
    adapter_publish_bytes    bytes the weight-store received for the adapter (a version of
                             its own) vs full_publish_bytes for the model's full weights
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from treadle_bench.harness import free_port, infra_with_weight_store, start_service
from treadle_cli.tiny_model import init_tiny
from treadle_common.auth.policy import bearer, token_from_env
from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.model import lora
from treadle_common.runtime.logs import configure_logging

MODEL = "bench-tiny"


def _batch(n: int, length: int) -> list[list[int]]:
    return [[5 + (i * 7 + t) % 300 for t in range(length)] for i in range(n)]


def run(
    steps: int = 10,
    rounds: int = 3,
    batch: int = 32,
    seq_len: int = 128,
    rank: int = 16,
    prompts: int = 8,
    num_samples: int = 4,
    max_tokens: int = 64,
) -> dict:
    configure_logging("bench", level="WARNING")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = init_tiny(tmp / MODEL)
        with infra_with_weight_store(tmp) as (infra, common, procs):
            rollout, trainer = _services(infra, common, procs, tmp, model_dir)
            train = _train(trainer, model_dir, steps, rounds, batch, seq_len, rank)
            sampling = _sample(trainer, rollout, rounds, prompts, num_samples, max_tokens, rank)
            publish = asyncio.run(
                _publish_bytes(common["TREADLE_WEIGHT_STORE_ADDR"], model_dir, rank)
            )
    return {
        "bench": "tinker",
        "steps": steps,
        "rounds": rounds,
        "batch": batch,
        "seq_len": seq_len,
        "lora_rank": rank,
        **train,
        **sampling,
        **publish,
    }


def _services(infra, common: dict, procs: list, tmp: Path, model_dir: Path) -> tuple[str, str]:
    """A rollout replica and a trainer serving the Tinker API on the model: their URLs."""
    ro_http, ro_grpc, tr_http = free_port(), free_port(), free_port()
    procs.append(
        start_service(
            "treadle_rollout",
            {
                **common,
                "TREADLE_NATS_URL": infra.url_for("nats", "rollout"),
                "TREADLE_REDIS_URL": infra.url_for("redis", "rollout"),
                "TREADLE_GRPC_PORT": str(ro_grpc),
                "TREADLE_ROLLOUT_MODEL": str(model_dir),
                "TREADLE_ROLLOUT_MODEL_NAME": MODEL,
            },
            ro_http,
            log=tmp / "rollout.log",
            ready_path="/healthz",
        )
    )
    rollout = f"http://127.0.0.1:{ro_http}"
    procs.append(
        start_service(
            "treadle_trainer",
            {
                **common,
                "TREADLE_NATS_URL": infra.url_for("nats", "trainer"),
                "TREADLE_REDIS_URL": infra.url_for("redis", "trainer"),
                "TREADLE_TRAINER_TINKER_MODELS": json.dumps({MODEL: str(model_dir)}),
                "TREADLE_TRAINER_ROLLOUT_URL": rollout,
            },
            tr_http,
            log=tmp / "trainer.log",
            ready_path="/healthz",
        )
    )
    return rollout, f"http://127.0.0.1:{tr_http}"


def _service_client(trainer: str):
    import tinker

    return tinker.ServiceClient(base_url=trainer, api_key="tml-" + (token_from_env() or ""))


def _datums(batch: int, seq_len: int):
    import numpy as np
    from tinker import types

    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(np.asarray(seq[1:], np.int64)),
                "weights": types.TensorData.from_numpy(np.ones(seq_len - 1, np.float32)),
            },
        )
        for seq in _batch(batch, seq_len)
    ]


def _train(trainer, model_dir, steps, rounds, batch, seq_len, rank) -> dict:
    from tinker import types

    from treadle_common.api.training import AdamParams
    from treadle_trainer.public import BaseModel, LoraClient, TinkerDatum

    adam = types.AdamParams(learning_rate=1e-4)
    data = _datums(batch, seq_len)
    sc = _service_client(trainer)
    client = sc.create_lora_training_client(base_model=MODEL, rank=rank, seed=0).result()

    base = BaseModel(MODEL, str(model_dir))
    local = LoraClient.create("bench", base, lora.AdapterConfig(rank=rank, seed=0))
    local_data = [
        TinkerDatum.of(seq[:-1], target_tokens=seq[1:], weights=[1.0] * (seq_len - 1))
        for seq in _batch(batch, seq_len)
    ]
    local_adam = AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12)

    def sdk_step() -> None:
        fb = client.forward_backward(data, "cross_entropy")
        opt = client.optim_step(adam)
        fb.result()
        opt.result()

    def local_step() -> None:
        local.forward_backward(local_data, "cross_entropy", {}, False)
        local.optim_step(local_adam, 0.0)

    for _ in range(2):  # warm-up: connections, first allocations
        sdk_step()
        local_step()
    sdk_rates, local_rates, ratios = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            sdk_step()
        sdk_rates.append(steps / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(steps):
            local_step()
        local_rates.append(steps / (time.perf_counter() - start))
        ratios.append(sdk_rates[-1] / local_rates[-1])
    return {
        "sdk_steps_per_s": round(statistics.median(sdk_rates), 2),
        "inprocess_steps_per_s": round(statistics.median(local_rates), 2),
        "train_ratio": round(statistics.median(ratios), 3),
    }


def _sample(trainer, rollout, rounds, prompts, num_samples, max_tokens, rank) -> dict:
    from tinker import types

    sc = _service_client(trainer)
    client = sc.create_lora_training_client(base_model=MODEL, rank=rank, seed=1).result()
    client.forward_backward(_datums(4, 32), "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    prompt_ids = _batch(prompts, 16)
    adapter = _wait_for_adapter(sampler, rollout, prompt_ids[0], params)

    def sdk_round() -> tuple[int, float]:
        start = time.perf_counter()
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), num_samples, params) for p in prompt_ids
        ]
        tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        return tokens, time.perf_counter() - start

    sdk_rates, rollout_rates, ratios = [], [], []
    for _ in range(rounds):
        tokens, secs = sdk_round()
        sdk_rates.append(tokens / secs)
        tokens, secs = asyncio.run(
            _rollout_round(rollout, adapter, prompt_ids, num_samples, max_tokens)
        )
        rollout_rates.append(tokens / secs)
        ratios.append(sdk_rates[-1] / rollout_rates[-1])
    return {
        "prompts": prompts,
        "num_samples": num_samples,
        "max_tokens": max_tokens,
        "sdk_sample_tokens_per_s": round(statistics.median(sdk_rates), 1),
        "rollout_tokens_per_s": round(statistics.median(rollout_rates), 1),
        "sample_ratio": round(statistics.median(ratios), 3),
    }


async def _rollout_round(
    rollout: str, adapter: str, prompt_ids: list[list[int]], num_samples: int, max_tokens: int
) -> tuple[int, float]:
    """The same samples from rollout's completions API directly: (tokens, seconds)."""
    async with httpx.AsyncClient(base_url=rollout, headers=bearer(token_from_env())) as http:
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(
                http.post(
                    "/v1/completions",
                    json={
                        "model": adapter,
                        "prompt": p,
                        "n": num_samples,
                        "max_tokens": max_tokens,
                        "temperature": 1.0,
                        "logprobs": 0,
                        "return_tokens_as_token_ids": True,
                    },
                    timeout=600,
                )
                for p in prompt_ids
            )
        )
        elapsed = time.perf_counter() - start
    tokens = sum(
        len(c["logprobs"]["tokens"])
        for a in answers
        for c in a.raise_for_status().json()["choices"]
    )
    return tokens, elapsed


def _wait_for_adapter(sampler, rollout, prompt, params) -> str:
    """Sample once (rollout loads the adapter on first use); the adapter's name in rollout."""
    from tinker import types

    sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    served = httpx.get(
        f"{rollout}/v1/adapters", headers=bearer(token_from_env()), timeout=30
    ).json()["adapters"]
    if len(served) != 1:
        raise RuntimeError(f"expected one adapter in rollout, found {served}")
    return served[0]


async def _publish_bytes(store_addr: str, model_dir: Path, rank: int) -> dict:
    """One adapter version and one full-weight version, each into a fresh model name."""
    from treadle_trainer.public import BaseModel, LoraClient

    base = BaseModel(MODEL, str(model_dir))
    client = LoraClient.create("publish", base, lora.AdapterConfig(rank=rank))
    store = WeightStoreClient(store_addr, token=token_from_env())
    adapter = await store.publish("bench-adapter", state_dict_to_raw(client.adapter_state()))
    full_state = {k: v.detach().clone() for k, v in base.model.state_dict().items()}
    full = await store.publish("bench-full", state_dict_to_raw(full_state))
    await store.close()
    return {
        "adapter_publish_bytes": adapter.bytes_received,
        "full_publish_bytes": full.bytes_received,
        "adapter_over_full_bytes": round(adapter.bytes_received / full.bytes_received, 4),
    }
