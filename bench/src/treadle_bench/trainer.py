"""`treadle bench trainer`: the trainer service's full step vs a plain torch loop.

Service path: a real trainer process owns an async run on private redis + nats with a real
weight-store; a synthetic rollout (treadle_bench/synthetic_rollout.py) answers its tasks with
fixed-shape trajectories through Redis. Each step reads the trajectories from Redis, validates
and groups them, computes advantages, runs the PPO loss and AdamW, and publishes the weights
(delta) to the weight store. service_tokens_per_s = loss tokens / step wall time (steady-state
steps, after the warm-up ones; the median step,
as the CPU of this 2-core machine is shared with the weight store).

`--backend megatron`: the same run with megatron-core over `tensor_parallel` torchrun ranks,
then again with the single backend, on the same synthetic batches (same seed); both rates and
`megatron_over_single` are reported.

Raw baseline (same run, after the service finished, so they never share the CPU): the same
trajectories of one step as padded tensors in this process, the same model, the same PPO loss
(written inline) and AdamW with gradient clipping, in a plain loop; nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis.asyncio as aioredis
import torch
from transformers import AutoModelForCausalLM

from treadle_bench.harness import free_port, infra_with_weight_store, start_service
from treadle_bench.synthetic_rollout import SyntheticRollout
from treadle_cli.tiny_model import init_tiny
from treadle_common.auth.policy import bearer, token_from_env
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_common.runtime.logs import configure_logging
from treadle_trainer.public import TrainerSettings, phase, profiled

MODEL = "bench-trainer"
WARMUP_STEPS = 2
"""Not measured: the first steps, and any step that overlapped the synthetic rollout (it
shares this machine's CPU with the trainer)."""


def run(
    steps: int = 16,
    groups: int = 16,
    group_size: int = 4,
    prompt_len: int = 32,
    completion_len: int = 224,
    backend: str = "single",
    tensor_parallel: int = 2,
    model: Path | None = None,
    profile_dir: Path | None = None,
) -> dict:
    """`model`: an HF directory to train (`treadle model import` makes one); default a tiny
    model built here. `profile_dir`: one more step of each run and of the plain loop, after
    the measured ones, under torch.profiler (`profiled`), its trace and tables kept there."""
    configure_logging("bench", level="WARNING")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = model.resolve() if model is not None else init_tiny(tmp / "tiny")
        dataset = tmp / "tasks.jsonl"
        extra = 1 if profile_dir is not None else 0  # the profiled step, after the measured
        dataset.write_text(
            "".join(json.dumps({"i": i}) + "\n" for i in range(groups * (steps + extra)))
        )
        shape = (steps, groups, group_size, prompt_len, completion_len)
        measured = {
            name: _service_run(
                tmp / name, model_dir, dataset, shape, name, tensor_parallel, profile_dir
            )
            for name in dict.fromkeys([backend, "single"])
        }
        raw = _raw(model_dir, measured["single"]["batch"], steps - WARMUP_STEPS, profile_dir)
    ours = measured[backend]
    report = {
        "bench": "trainer",
        "model": model_dir.name if model is not None else "tiny",
        "backend": backend,
        "loss": "ppo",
        "deterministic": TrainerSettings().trainer_deterministic,
        "steps": steps,
        "sequences_per_step": groups * group_size,
        "tokens_per_sequence": prompt_len + completion_len,
        "service_tokens_per_s": ours["tokens_per_s"],
        "raw_tokens_per_s": round(raw, 1),
        "ratio": round(ours["tokens_per_s"] / raw, 3),
        **{k: v for k, v in ours.items() if k not in ("batch", "tokens_per_s")},
    }
    if profile_dir is not None:
        report["profile_dir"] = str(profile_dir.resolve())
    if backend != "single":
        single = measured["single"]["tokens_per_s"]
        report |= {
            "tensor_parallel": tensor_parallel,
            "single_tokens_per_s": single,
            f"{backend}_over_single": round(ours["tokens_per_s"] / single, 3),
            "single_step_s_p50": measured["single"]["step_s_p50"],
        }
    return report


def _recipe(
    tmp: Path,
    model_dir: Path,
    dataset: Path,
    shape: tuple[int, int, int, int, int],
    backend: str,
    tensor_parallel: int,
    profile: bool = False,
) -> dict:
    """The bench's run: async, every step's batch from the dataset, one checkpoint at the end;
    `profile`: one more step, under torch.profiler."""
    steps, groups, group_size, _, _ = shape
    megatron = backend == "megatron"
    parallel = {"backend": backend, "tensor_parallel": tensor_parallel if megatron else 1}
    if profile:
        parallel["profile_steps"] = [steps + 1]
        steps += 1
    return {
        "run_id": "bench",
        "mode": "async",
        "model": {"path": str(model_dir), "name": MODEL},
        "data": {"path": str(dataset)},
        "rollout": {"group_size": group_size},
        "trainer": {
            "num_steps": steps,
            "tasks_per_step": groups,
            "loss": "ppo",
            "lr": 1e-5,
            "max_staleness": steps,
            "checkpoint_every": steps,
            **parallel,
        },
        "output_dir": str(tmp / "runs"),
    }


def _rates(status: dict, batch: int, quiet_from: int, last: int) -> dict:
    """Step rates over the steps after warm-up (and after the trainer's quiet point) up to
    `last` (a profiled step after it is not measured)."""
    first = max(WARMUP_STEPS + 1, quiet_from)
    steps = [s for s in status["steps"] if s["step"] <= last]
    measured = [s for s in steps if s["step"] >= first] or steps[-1:]

    def p50(key: str) -> float:
        return round(statistics.median(s[key] for s in measured), 4)

    return {
        "batch": batch,
        "tokens_per_s": round(
            statistics.median(s["num_tokens"] / s["duration_s"] for s in measured), 1
        ),
        "step_s": [round(s["duration_s"], 3) for s in steps],
        "measured_steps": [s["step"] for s in measured],
        "step_s_p50": p50("duration_s"),
        "train_s_p50": p50("train_s"),
        "publish_s_p50": p50("publish_s"),
        "wait_for_batch_s_p50": p50("wait_for_batch_s"),
    }


def _service_run(
    tmp: Path,
    model_dir: Path,
    dataset: Path,
    shape: tuple[int, int, int, int, int],
    backend: str,
    tensor_parallel: int,
    profile_dir: Path | None = None,
) -> dict:
    """One async run of the trainer service on its own infrastructure; its step rates (and
    its profiled step's files in `profile_dir`/`backend`)."""
    steps, groups, group_size, prompt_len, completion_len = shape
    megatron = backend == "megatron"
    tmp.mkdir()
    with infra_with_weight_store(tmp) as (infra, common, procs):
        http_port = free_port()
        # the model and tasks are shared
        roots = json.dumps(sorted({str(tmp.parent.resolve()), str(model_dir.parent)}))
        procs.append(
            start_service(
                "treadle_trainer",
                {
                    **common,
                    "TREADLE_NATS_URL": infra.url_for("nats", "trainer"),
                    "TREADLE_REDIS_URL": infra.url_for("redis", "trainer"),
                    "TREADLE_TRAINER_PATH_ROOTS": roots,
                },
                http_port,
                log=tmp / "trainer.log",
                ranks=tensor_parallel if megatron else 1,
            )
        )
        recipe = _recipe(
            tmp, model_dir, dataset, shape, backend, tensor_parallel, profile_dir is not None
        )
        status, batch, quiet_from = asyncio.run(
            _service(
                f"http://127.0.0.1:{http_port}",
                infra.url_for("redis"),
                common["TREADLE_WEIGHT_STORE_ADDR"],
                recipe,
                prompt_len,
                completion_len,
            )
        )
    if status["state"] != "succeeded":
        raise RuntimeError(f"bench run ({backend}) failed: {status['error']}")
    if profile_dir is not None:
        # a second bench into the same directory replaces the step files it writes
        shutil.copytree(
            tmp / "runs" / "bench" / "profile", profile_dir / backend, dirs_exist_ok=True
        )
    return _rates(status, batch, quiet_from, last=steps)


async def _service(http, redis_url, store_addr, recipe, prompt_len, completion_len):
    r = aioredis.from_url(redis_url)
    store = WeightStoreClient(store_addr)
    vocab = json.loads((Path(recipe["model"]["path"]) / "config.json").read_text())["vocab_size"]
    total_groups = recipe["trainer"]["num_steps"] * recipe["trainer"]["tasks_per_step"]
    rollout = SyntheticRollout(
        r,
        store,
        "bench",
        MODEL,
        vocab,
        prompt_len=prompt_len,
        completion_len=completion_len,
        limit=total_groups,  # the trainer keeps feeding ahead; produce what the steps use
    )
    headers = bearer(token_from_env())
    async with httpx.AsyncClient(base_url=http, timeout=30, headers=headers) as client:
        response = await client.post("/v1/runs", json=recipe)
        response.raise_for_status()
        producer = asyncio.create_task(rollout.run_forever())
        quiet_from = None  # the first step that started after the producer went quiet
        try:
            while (status := (await client.get("/v1/runs/bench")).json())["state"] == "running":
                if producer.done():
                    producer.result()
                if quiet_from is None and rollout.groups >= total_groups:
                    quiet_from = status["step"] + 2
                await asyncio.sleep(0.5)
        finally:
            producer.cancel()
    needed = recipe["trainer"]["tasks_per_step"] * recipe["rollout"]["group_size"]
    batch = rollout.first[:needed]  # the run trimmed its stream: what the rollout kept
    await store.close()
    await r.aclose()
    return status, batch, quiet_from or status["step"]


def _raw(
    model_dir: Path, batch: list[tpb.Trajectory], steps: int, profile_dir: Path | None = None
) -> float:
    """PPO + AdamW on the batch in a plain loop; loss tokens per second. On the device the
    service's single backend trains on: CUDA where torch sees it, under bf16 autocast with fp32
    master weights (the backend's default), else the CPU in fp32; with the service's choice of
    deterministic algorithms (`TREADLE_TRAINER_DETERMINISTIC`, on by default: on a GPU they
    cost 40% of the training time). `profile_dir`: one more step under torch.profiler, into
    `profile_dir`/raw."""
    torch.manual_seed(0)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(TrainerSettings().trainer_deterministic, warn_only=True)
    try:
        step, num_tokens, device = _raw_step(model_dir, batch)
        step()  # warm-up, as the service's first step
        rates = []
        for _ in range(steps):
            started = time.perf_counter()
            step()
            rates.append(num_tokens / (time.perf_counter() - started))
        if profile_dir is not None:
            with profiled(profile_dir / "raw", steps + 2, device, phases="raw."):
                step()
        return statistics.median(rates)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _raw_step(
    model_dir: Path, batch: list[tpb.Trajectory]
) -> tuple[Callable[[], None], float, str]:
    """One plain PPO + AdamW step on the whole batch; its loss tokens; the device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device)  # type: ignore[arg-type]  # transformers types `to` oddly
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.tensor([list(t.tokens) for t in batch], device=device)
    mask = torch.tensor([list(t.loss_mask[1:]) for t in batch], dtype=torch.float32, device=device)
    old = torch.tensor([list(t.logprobs[1:]) for t in batch], device=device)
    rewards = torch.tensor([t.reward for t in batch], device=device)
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(batch):
        groups.setdefault(t.group_id, []).append(i)
    adv = torch.zeros(len(batch), device=device)
    for members in groups.values():
        r = rewards[members]
        adv[members] = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model.train()

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def step() -> None:
        with phase("raw.forward"), autocast:
            logits = model(input_ids=inputs).logits.float()
        logp = torch.log_softmax(logits, -1).gather(2, targets[..., None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        a = adv[:, None]
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.28) * a)
        loss = -(surrogate * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        with phase("raw.backward"):
            loss.backward()
        with phase("raw.optim_step"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    return step, float(mask.sum()), device
