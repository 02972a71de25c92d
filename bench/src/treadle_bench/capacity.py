"""`treadle bench capacity`: what one core of Redis, of NATS and of the trainer's ingest
costs per unit of a run's traffic, measured on this machine, for `treadle sim` (its
scenarios' `infra:`, `treadle sim scale --infra FILE`).

Real servers: a private redis-server and nats-server (`treadle_cli.infra`), driven by this
process through Treadle's own calls and messages:

    redis    a group's life in the streams, as a run makes it: the feeder's XADD of the task
             (`streams.add`), rollout's XREADGROUP of it and its one Lua commit of the
             group's trajectories with the task's ack (`streams.commit_owned`), the trainer's
             XREADGROUP of the trajectories and their XACK. Baseline: the same bytes with
             plain XADD / XREADGROUP / XACK, no Lua and no protobuf.
    nats     a group's scores: one `treadle.reward._batch` request of the group's answers and
             its reply (`RewardClient.score_batch`; the replier here answers at once).
    ingest   the trainer's side of the trajectories, as its collector does it: decoding the
             read entries into `Trajectory` messages (`streams.entries`), checking each
             (`invalid_reason`), assembling groups (`GroupBuffer`) and the step's batch
             (`build_batch`), in this process.

What is measured is each server's CPU seconds (its process's user + system time, psutil)
and this process's for ingest, over many groups at two group sizes and two lengths, fitted
by least squares to a cost per task, per trajectory and per KiB of trajectory (or request)
bytes. One core of each does 1 / cost of them a second; the simulator divides a run's
traffic by that (`treadle_sim.scale`).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import numpy as np
import psutil
import redis.asyncio as aioredis

from treadle_bench.harness import bench_auth, free_port
from treadle_cli.infra import Infra
from treadle_common.auth import infra as infra_auth
from treadle_common.clients import streams
from treadle_common.clients.reward import RewardClient
from treadle_common.config.recipe import TrainerConfig
from treadle_common.config.settings import Settings
from treadle_common.proto.treadle.v1 import reward_pb2 as rpb
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_common.runtime.logs import configure_logging
from treadle_trainer.public import Entry, GroupBuffer, build_batch, invalid_reason

SHAPES = ((4, 256), (4, 2048), (16, 256), (16, 2048))
"""(group size, generated tokens) of the measured workloads."""
PROMPT_TOKENS = 200
VOCAB = 49152
"""The tokens' range (SmolLM2's vocabulary)."""
CHARS_PER_TOKEN = 4
"""An answer's text per generated token (a scored answer is text)."""


@dataclass
class Shape:
    group: int
    tokens: int

    def trajectories(self, task_id: str) -> list[tpb.Trajectory]:
        """The group's trajectories as rollout writes them: prompt and generated tokens, a
        mask, logprobs and the version of every token."""
        prompt, gen = PROMPT_TOKENS, self.tokens
        return [
            tpb.Trajectory(
                trajectory_id=f"{task_id}/{i}",
                group_id=task_id,
                task_id=task_id,
                run_id="capacity",
                env="arith",
                sample_index=i,
                tokens=[(7919 * (j + i)) % VOCAB for j in range(prompt + gen)],
                loss_mask=[0] * prompt + [1] * gen,
                logprobs=[0.0] * prompt + [-0.5 - (j % 7) / 10 for j in range(gen)],
                token_versions=[-1] * prompt + [3] * gen,
                reward=float(i % 2),
                status=tpb.TRAJECTORY_STATUS_OK,
                num_turns=1,
            )
            for i in range(self.group)
        ]

    def score_batch(self, task_id: str) -> list[rpb.ScoreRequest]:
        answer = "x" * (self.tokens * CHARS_PER_TOKEN)
        return [
            rpb.ScoreRequest(
                request_id=f"{task_id}/{i}",
                scorer="exact_match",
                task_json='{"answer": "42"}',
                answer=answer,
            )
            for i in range(self.group)
        ]


def cpu_s(pid: int | None = None) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def redis_round(r: aioredis.Redis, shape: Shape, groups: int, ours: bool) -> dict:
    """`groups` groups through the streams; their trajectories' bytes and the ingest CPU."""
    tasks, trajs = f"cap:{ours}:{shape}:tasks", f"cap:{ours}:{shape}:trajs"
    for stream in (tasks, trajs):
        await streams.ensure_group(r, stream, "g")
    payload_bytes = 0
    ingest_s = 0.0
    buffer = GroupBuffer(shape.group)
    config = TrainerConfig(num_steps=1, tasks_per_step=1, max_staleness=8)
    for n in range(groups):
        task_id = f"task-{n:06d}"
        messages = shape.trajectories(task_id)
        payload_bytes += sum(m.ByteSize() for m in messages)
        if ours:
            await streams.add(r, tasks, task_pb2.Task(task_id=task_id, run_id="capacity"))
            [(_, entry_id, _)] = await streams.read_group(r, [tasks], "g", "c", task_pb2.Task)
            await streams.commit_owned(
                r, tasks, "g", "c", entry_id, out_stream=trajs, messages=messages
            )
            reply = await r.xreadgroup("g", "t", {trajs: ">"}, count=shape.group)
            start = time.process_time()
            read = streams.entries(reply, tpb.Trajectory)
            for _, tid, msg in read:
                assert isinstance(msg, tpb.Trajectory)
                buffer.add(Entry(tid, msg, invalid_reason(msg, VOCAB)))
            build_batch(buffer.take(1), 3, 8, config)
            ingest_s += time.process_time() - start
            await r.xack(trajs, "g", *[tid for _, tid, _ in read])
        else:
            blobs = [m.SerializeToString() for m in messages]
            await r.xadd(tasks, {"pb": task_id.encode()})
            task: Any = await r.xreadgroup("g", "c", {tasks: ">"}, count=1)
            pipe = r.pipeline(transaction=False)
            for blob in blobs:
                pipe.xadd(trajs, {"pb": blob})
            pipe.xack(tasks, "g", task[0][1][0][0])
            await pipe.execute()
            got: Any = await r.xreadgroup("g", "t", {trajs: ">"}, count=shape.group)
            await r.xack(trajs, "g", *[entry_id for entry_id, _ in got[0][1]])
    await r.delete(tasks, trajs)
    return {"bytes": payload_bytes, "ingest_s": ingest_s}


async def measure_redis(url: str, pid: int, groups: int) -> dict[str, Any]:
    r = aioredis.Redis.from_url(url)
    rows: dict[str, list[dict]] = {"ours": [], "raw": []}
    try:
        await redis_round(r, Shape(4, 64), 50, True)  # warm-up: connection, scripts loaded
        for group, tokens in SHAPES:
            shape = Shape(group, tokens)
            for side in ("ours", "raw"):
                before = cpu_s(pid)
                got = await redis_round(r, shape, groups, side == "ours")
                server_s = cpu_s(pid) - before
                rows[side].append({"shape": shape, "groups": groups, "server_s": server_s, **got})
    finally:
        await r.aclose()
    return rows


async def measure_nats(client_url: str, replier_url: str, pid: int, groups: int) -> list[dict]:
    prefix = infra_auth.inbox_prefix_of
    replier = await nats.connect(replier_url, inbox_prefix=prefix(replier_url))
    caller = await nats.connect(client_url, inbox_prefix=prefix(client_url))

    async def reply(msg: Any) -> None:
        batch = rpb.ScoreBatchRequest.FromString(msg.data)
        ok = rpb.SCORE_STATUS_OK
        results = [rpb.ScoreResult(request_id=q.request_id, status=ok) for q in batch.requests]
        await msg.respond(rpb.ScoreBatchResult(results=results).SerializeToString())

    await replier.subscribe("treadle.reward._batch", queue="reward", cb=reply)
    await replier.flush()
    client = RewardClient(caller, timeout_s=30)
    rows = []
    try:
        for group, tokens in SHAPES:
            shape = Shape(group, tokens)
            requests = [shape.score_batch(f"task-{n:06d}") for n in range(groups)]
            size = sum(rpb.ScoreBatchRequest(requests=q).ByteSize() for q in requests)
            before = cpu_s(pid)
            for batch in requests:
                results = await client.score_batch(batch)
                assert all(x.status == rpb.SCORE_STATUS_OK for x in results)
            rows.append(
                {"shape": shape, "groups": groups, "server_s": cpu_s(pid) - before, "bytes": size}
            )
    finally:
        await caller.close()
        await replier.close()
    return rows


def fit(rows: list[dict], key: str) -> dict[str, float]:
    """Least squares of `key` seconds over (tasks, trajectories, KiB): non-negative costs."""
    a = np.array([[r["groups"], r["groups"] * r["shape"].group, r["bytes"] / 1024] for r in rows])
    y = np.array([r[key] for r in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.clip(coef, 0.0, None)
    return {
        "s_per_task": float(coef[0]),
        "s_per_trajectory": float(coef[1]),
        "s_per_kib": float(coef[2]),
    }


def per_group_us(rows: list[dict], key: str) -> list[dict[str, float]]:
    return [
        {
            "group": r["shape"].group,
            "tokens": r["shape"].tokens,
            "us_per_group": round(r[key] / r["groups"] * 1e6, 1),
            "bytes_per_group": round(r["bytes"] / r["groups"]),
        }
        for r in rows
    ]


def run(groups: int = 300) -> dict[str, Any]:
    configure_logging("bench", level="WARNING")
    with tempfile.TemporaryDirectory() as tmp, bench_auth():
        settings = Settings(
            state_dir=Path(tmp),
            nats_url=f"nats://127.0.0.1:{free_port()}",
            redis_url=f"redis://127.0.0.1:{free_port()}",
        )
        infra = Infra(settings)
        try:
            states = {s.name: s for s in infra.up(("redis", "nats"))}
            redis_pid, nats_pid = states["redis"].pid, states["nats"].pid
            assert redis_pid and nats_pid, "the bench's own servers have no pid"
            streams_rows = asyncio.run(measure_redis(infra.url_for("redis"), redis_pid, groups))
            nats_rows = asyncio.run(
                measure_nats(
                    infra.url_for("nats", "rollout"),
                    infra.url_for("nats", "reward"),
                    nats_pid,
                    groups,
                )
            )
        finally:
            infra.down()
    ours, raw = streams_rows["ours"], streams_rows["raw"]
    redis_fit, ingest_fit = fit(ours, "server_s"), fit(ours, "ingest_s")
    nats_fit = fit(nats_rows, "server_s")
    short, long = (Shape(1, t).trajectories("t")[0].ByteSize() for t in (256, 2048))
    generated = (long - short) / (2048 - 256)
    prompt = (short - 256 * generated) / PROMPT_TOKENS  # with the message's fixed fields
    return {
        "bench": "capacity",
        "groups_per_shape": groups,
        "redis": {
            "ours": per_group_us(ours, "server_s"),
            "raw": per_group_us(raw, "server_s"),
            "ours_over_raw": round(
                sum(r["server_s"] for r in ours) / sum(r["server_s"] for r in raw), 3
            ),
        },
        "nats": per_group_us(nats_rows, "server_s"),
        "ingest": per_group_us(ours, "ingest_s"),
        "infra": {
            "redis": redis_fit,
            "nats": nats_fit,
            "ingest": ingest_fit,
            "trajectory_bytes_per_prompt_token": round(prompt, 2),
            "trajectory_bytes_per_generated_token": round(generated, 2),
            "answer_bytes_per_token": CHARS_PER_TOKEN,
        },
    }
