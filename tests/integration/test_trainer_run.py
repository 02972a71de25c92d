"""The trainer service as a real process on real Redis, NATS and weight-store: SIGKILL between
a step and its checkpoint, restart, and the run ledger shows every trajectory exactly once.
Plus the Tinker-style training API over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid

import httpx
import psutil
import pytest
import redis.asyncio as aioredis

from tests.support.services import ADMIN, ServiceProc, free_ports, start_service
from treadle_bench.synthetic_rollout import SyntheticRollout
from treadle_common import names
from treadle_common.clients import streams
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.proto.treadle.v1 import task_pb2

pytestmark = pytest.mark.integration
GROUPS_PER_STEP, GROUP_SIZE, STEPS = 2, 2, 4


def start_trainer(infra, tmp_path, weight_store: ServiceProc) -> ServiceProc:
    return start_service(
        "trainer",
        infra,
        tmp_path,
        TREADLE_WEIGHT_STORE_ADDR=weight_store.grpc_addr or "",
        TREADLE_TRAINER_LEASE_S="2",
    )


async def wait_run(http: str, run: str, until, timeout_s: float = 120, producer=None) -> dict:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(headers=ADMIN, base_url=http, timeout=5) as client:
        while True:
            response = await client.get(f"/v1/runs/{run}")
            if response.status_code == 200 and until(status := response.json()):
                return status
            assert time.monotonic() < deadline, f"run {run} did not get there: {response.text}"
            if producer is not None and producer.done():
                producer.result()  # surface the synthetic rollout's error
            await asyncio.sleep(0.05)


async def test_sigkill_between_step_and_checkpoint_trains_every_trajectory_once(
    infra, tmp_path, tiny_model, weight_store
):
    run = f"crash-{uuid.uuid4().hex[:6]}"
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text("".join(json.dumps({"q": i}) + "\n" for i in range(5)))
    recipe = {
        "run_id": run,
        "mode": "async",
        "model": {"path": str(tiny_model), "name": "crashm"},
        "data": {"path": str(dataset)},
        "rollout": {"group_size": GROUP_SIZE},
        "trainer": {
            "num_steps": STEPS,
            "tasks_per_step": GROUPS_PER_STEP,
            "loss": "ppo",
            "advantage": "rloo",
            "max_staleness": 8,
            "checkpoint_every": 2,
            "micro_batch_tokens": 128,
        },
        "output_dir": str(tmp_path / "runs"),
    }
    r = aioredis.from_url(infra.redis_url)
    store = WeightStoreClient(weight_store.grpc_addr or "")
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    rollout = SyntheticRollout(r, store, run, "crashm", vocab_size=vocab, gated=True)
    trainer = start_trainer(infra, tmp_path, weight_store)
    producer = None
    try:
        async with httpx.AsyncClient(headers=ADMIN, base_url=trainer.http) as client:
            response = await client.post("/v1/runs", json=recipe)
            assert response.status_code == 202, response.text
        producer = asyncio.create_task(rollout.run_forever())
        # bad input on the stream: one undecodable entry, one trajectory of an unknown group
        stream = names.trajectories_stream(run)
        await r.xadd(stream, {names.STREAM_FIELD: b"\xff not a protobuf"})
        not_fed = task_pb2.Task(task_id="not-fed", run_id=run, env="x", group_size=1)
        stranger = rollout.trajectory(not_fed, 0, version=0)
        await streams.add(r, stream, stranger)
        rollout.release(2 * GROUPS_PER_STEP + 1)  # steps 1-2 (checkpointed), one group ahead
        await wait_run(trainer.http, run, lambda s: s["checkpoint_step"] == 2, producer=producer)
        rollout.release(GROUPS_PER_STEP - 1)  # step 3
        before = await wait_run(  # published in the background: wait until it is out
            trainer.http, run, lambda s: s["step"] >= 3 and s["steps"][-1]["published"]
        )
        assert before["checkpoint_step"] == 2 and await r.xlen(names.ledger_stream(run)) == 2
        os.kill(trainer.proc.pid, signal.SIGKILL)  # step 3 trained and published, not committed
        trainer.proc.wait(timeout=10)

        trainer = start_trainer(infra, tmp_path, weight_store)
        rollout.release(100)
        final = await wait_run(trainer.http, run, lambda s: s["state"] != "running", 180)
    finally:
        if producer is not None:
            producer.cancel()
        trainer.stop()
    assert final["state"] == "succeeded", final["error"]
    assert final["resumed"] == 1 and final["step"] == STEPS == final["checkpoint_step"]
    assert final["pending_after_run"] == 0

    ledger = await r.xrange(names.ledger_stream(run))
    kinds = [(int(f[b"step"]), f[b"kind"].decode()) for _, f in ledger]
    assert kinds[:STEPS] == [(s, "step") for s in range(1, STEPS + 1)]
    assert kinds[STEPS:] in ([], [(STEPS, "run_end")])  # unused groups, if any landed
    trained = [t for _, f in ledger for t in json.loads(f[b"trained"])]
    dropped = {k: v for _, f in ledger for k, v in json.loads(f[b"dropped"]).items()}
    assert len(trained) == len(set(trained)) == STEPS * GROUPS_PER_STEP * GROUP_SIZE
    ended = {k for k, v in dropped.items() if v == "run_ended"}
    assert sorted(v for v in dropped.values() if v != "run_ended") == [
        "invalid_entry",
        "unknown_group",
    ]
    assert stranger.trajectory_id in dropped
    # every trajectory the rollout produced was trained exactly once (including the ones of
    # step 3 that the killed process had already trained) or, unused at the end, dropped once
    assert set(trained) | ended == set(rollout.produced) and not set(trained) & ended
    assert len(rollout.produced) == len(set(rollout.produced)) == final["trajectories_produced"]
    assert set(rollout.produced[: 3 * GROUPS_PER_STEP * GROUP_SIZE]) <= set(trained)
    assert final["trajectories_trained"] == len(trained)
    assert final["dropped"] == {"invalid_entry": 1, "unknown_group": 1} | (
        {"run_ended": len(ended)} if ended else {}
    )
    assert final["rejected"] == 2
    assert final["trajectories_acked"] == final["trajectories_consumed"] + final["rejected"]
    assert final["trajectories_consumed"] == final["trajectories_produced"]
    # the trainer fed ahead; what no replica started was cancelled, not run
    assert final["tasks_fed"] == rollout.groups + final["tasks_cancelled"]
    # the restarted owner re-published its restored weights before training on
    versions = await store.list_versions("crashm")
    assert len(versions) == len(final["versions"]) + 1  # + step 3 of the killed process
    await store.close()
    await r.aclose()


def handoff_recipe(run: str, tmp_path, tiny_model, steps: int = 6) -> dict:
    dataset = tmp_path / "tasks.jsonl"
    dataset.write_text("".join(json.dumps({"q": i}) + "\n" for i in range(5)))
    return {
        "run_id": run,
        "mode": "async",
        "model": {"path": str(tiny_model), "name": f"m{run[-6:]}"},
        "data": {"path": str(dataset)},
        "rollout": {"group_size": GROUP_SIZE},
        "trainer": {
            "num_steps": steps,
            "tasks_per_step": GROUPS_PER_STEP,
            "loss": "ppo",
            "advantage": "rloo",
            "max_staleness": 8,
            "checkpoint_every": 1,
            "micro_batch_tokens": 128,
        },
        "output_dir": str(tmp_path / "runs"),
    }


async def assert_ledger_exact(r, run: str, steps: int, produced: list[str]) -> None:
    """Every step ledgered once; every produced trajectory trained once or dropped once."""
    ledger = await r.xrange(names.ledger_stream(run))
    step_entries = [int(f[b"step"]) for _, f in ledger if f[b"kind"] == b"step"]
    assert step_entries == list(range(1, steps + 1))
    trained = [t for _, f in ledger for t in json.loads(f[b"trained"])]
    dropped = [t for _, f in ledger for t in json.loads(f[b"dropped"])]
    assert len(trained) == len(set(trained)) == steps * GROUPS_PER_STEP * GROUP_SIZE
    assert not set(trained) & set(dropped) and len(dropped) == len(set(dropped))
    assert set(trained) | set(dropped) == set(produced)


async def test_sigterm_hands_the_run_off_to_another_trainer(
    infra, tmp_path, tiny_model, weight_store
):
    """SIGTERM on the owner mid-run: it checkpoints at its step boundary and releases the
    lease, and a second trainer resumes the run at once, losing and doubling nothing."""
    run = f"handoff-{uuid.uuid4().hex[:6]}"
    recipe = handoff_recipe(run, tmp_path, tiny_model)
    steps = recipe["trainer"]["num_steps"]
    r = aioredis.from_url(infra.redis_url)
    store = WeightStoreClient(weight_store.grpc_addr or "")
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    rollout = SyntheticRollout(r, store, run, recipe["model"]["name"], vocab, gated=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = start_trainer(infra, tmp_path / "a", weight_store)
    second = producer = None
    try:
        async with httpx.AsyncClient(headers=ADMIN, base_url=first.http) as client:
            response = await client.post("/v1/runs", json=recipe)
            assert response.status_code == 202, response.text
        producer = asyncio.create_task(rollout.run_forever())
        rollout.release(2 * GROUPS_PER_STEP)
        await wait_run(first.http, run, lambda s: s["checkpoint_step"] == 2, producer=producer)
        second = start_trainer(infra, tmp_path / "b", weight_store)
        first.proc.send_signal(signal.SIGTERM)  # waiting for step 3's batch: no more come
        assert first.proc.wait(timeout=30) == 0
        resumed = await wait_run(second.http, run, lambda s: s["resumed"] == 1, 30)
        assert resumed["step"] == 2  # from the handed-off checkpoint
        rollout.release(100)
        final = await wait_run(second.http, run, lambda s: s["state"] != "running", 120)
    finally:
        if producer is not None:
            producer.cancel()
        for trainer in (first, second):
            if trainer is not None and trainer.proc.poll() is None:
                trainer.stop()
    assert final["state"] == "succeeded", final["error"]
    assert final["step"] == steps and final["pending_after_run"] == 0
    assert "run handed off" in first.log.read_text()
    await assert_ledger_exact(r, run, steps, rollout.produced)
    # bounded state: what was acked is trimmed, and the finished run's keys expire
    assert await r.xlen(names.trajectories_stream(run)) == 0
    assert await r.xlen(names.tasks_stream(run)) == 0
    for key in (names.run_state(run), names.ledger_stream(run), names.run_config(run)):
        assert await r.ttl(key) > 0, key
    await store.close()
    await r.aclose()


async def test_a_trainer_that_stalled_past_its_lease_cannot_commit(
    infra, tmp_path, tiny_model, weight_store
):
    """The owner is frozen (SIGSTOP) past its lease; a second trainer takes the run over and
    trains on. Thawed, the first finds the run fenced: it commits nothing and reports the run
    `lost`, and the ledger holds every step once."""
    run = f"fence-{uuid.uuid4().hex[:6]}"
    recipe = handoff_recipe(run, tmp_path, tiny_model)
    steps = recipe["trainer"]["num_steps"]
    r = aioredis.from_url(infra.redis_url)
    store = WeightStoreClient(weight_store.grpc_addr or "")
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    rollout = SyntheticRollout(r, store, run, recipe["model"]["name"], vocab, gated=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = start_trainer(infra, tmp_path / "a", weight_store)
    second = producer = None
    try:
        async with httpx.AsyncClient(headers=ADMIN, base_url=first.http) as client:
            response = await client.post("/v1/runs", json=recipe)
            assert response.status_code == 202, response.text
        producer = asyncio.create_task(rollout.run_forever())
        rollout.release(2 * GROUPS_PER_STEP)
        await wait_run(first.http, run, lambda s: s["checkpoint_step"] == 2, producer=producer)
        owner_before = await r.get(names.run_owner(run))
        os.kill(first.proc.pid, signal.SIGSTOP)
        second = start_trainer(infra, tmp_path / "b", weight_store)
        await wait_run(second.http, run, lambda s: s["resumed"] == 1, 30)
        assert await r.get(names.run_owner(run)) != owner_before  # a new fencing token
        rollout.release(GROUPS_PER_STEP)  # step 3, read by the new owner
        await wait_run(second.http, run, lambda s: s["checkpoint_step"] == 3)
        os.kill(first.proc.pid, signal.SIGCONT)
        async with httpx.AsyncClient(headers=ADMIN, base_url=first.http, timeout=5) as client:
            for _ in range(600):  # the woken owner finds its lease taken and stops: `lost`
                info = (await client.get("/v1/info")).json()
                if info["runs"].get(run) == "lost":
                    break
                await asyncio.sleep(0.05)
            assert info["runs"][run] == "lost", info
            # and it answers for the run as its new owner keeps it (a client asking the old
            # owner follows the run)
            moved = (await client.get(f"/v1/runs/{run}")).json()
        assert moved["owner"] == (await r.get(names.run_owner(run))).decode()
        assert moved["state"] == "running" and moved["resumed"] == 1
        rollout.release(100)
        final = await wait_run(second.http, run, lambda s: s["state"] != "running", 120)
    finally:
        if producer is not None:
            producer.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(first.proc.pid, signal.SIGCONT)
        for trainer in (first, second):
            if trainer is not None and trainer.proc.poll() is None:
                trainer.stop()
    assert final["state"] == "succeeded", final["error"]
    assert final["step"] == steps and final["pending_after_run"] == 0
    await assert_ledger_exact(r, run, steps, rollout.produced)
    await store.close()
    await r.aclose()


async def test_training_api_sft_steps_lower_the_loss(infra, tmp_path, tiny_model, weight_store):
    trainer = start_trainer(infra, tmp_path, weight_store)
    try:
        async with httpx.AsyncClient(headers=ADMIN, base_url=trainer.http, timeout=60) as client:
            created = await client.post(
                "/v1/training/sessions", json={"model_path": str(tiny_model), "model_name": "sft"}
            )
            assert created.status_code == 201, created.text
            sid = created.json()["session_id"]
            seq = [5, 17, 42, 99, 7, 3, 250, 11]
            datum = {
                "model_input": seq[:-1],
                "target_tokens": seq[1:],
                "weights": [0, 0, 1, 1, 1, 1, 1],
            }
            body = {"loss_fn": "cross_entropy", "data": [datum, datum]}
            losses = []
            for _ in range(5):
                fb = await client.post(f"/v1/training/sessions/{sid}/forward_backward", json=body)
                assert fb.status_code == 200, fb.text
                losses.append(fb.json()["loss"])
                step = await client.post(
                    f"/v1/training/sessions/{sid}/optim_step", json={"learning_rate": 1e-2}
                )
                assert step.status_code == 200, step.text
            assert losses[-1] < losses[0] * 0.8, losses
            assert fb.json()["num_tokens"] == 10
            assert fb.json()["log_ratio_mean"] is None  # no behaviour logprobs: no drift
            # behaviour logprobs of 0 (probability 1): d is the trainer's own log p, below 0
            scored = await client.post(
                f"/v1/training/sessions/{sid}/forward_backward",
                json={**body, "data": [{**datum, "logprobs": [0.0] * 7}]},
            )
            drift = scored.json()
            assert drift["log_ratio_max"] >= drift["log_ratio_abs_mean"] > 0
            assert sum(drift["ratio_histogram"]) == 5 and drift["behaviour_kl"] >= 0
            saved = await client.post(f"/v1/training/sessions/{sid}/save_weights")
            assert saved.status_code == 200 and saved.json()["version"] >= 1
            state = await client.post(f"/v1/training/sessions/{sid}/save_state", json={})
            assert state.json()["step"] == 5
            loaded = await client.post(
                f"/v1/training/sessions/{sid}/load_state", json={"path": state.json()["path"]}
            )
            assert loaded.json() == {"step": 5}
            # bad input: clear 4xx, the service stays up
            bad = [
                ({**body, "loss_fn": "nope"}, 422, "cross_entropy"),
                ({**body, "data": [{**datum, "weights": [1]}]}, 422, "weights has 1 entries"),
                ({**body, "data": [{**datum, "model_input": [10**6] * 7}]}, 400, "token ids"),
                (  # a correction needs the logprobs it corrects against
                    {**body, "loss_fn": "ppo", "loss_params": {"off_policy": "tis"}},
                    400,
                    "every datum needs them",
                ),
            ]
            for payload, code, text in bad:
                response = await client.post(
                    f"/v1/training/sessions/{sid}/forward_backward", json=payload
                )
                assert response.status_code == code and text in response.text, response.text
            missing = await client.post(
                f"/v1/training/sessions/{sid}/load_state", json={"path": str(tmp_path / "x")}
            )
            assert missing.status_code == 404
            unknown = await client.post("/v1/training/sessions/zzz/optim_step", json={})
            assert unknown.status_code == 404 and "zzz" in unknown.text
            assert (await client.get("/healthz")).status_code == 200
    finally:
        trainer.stop()


async def test_a_damaged_checkpoint_falls_back_to_the_one_before(
    infra, tmp_path, tiny_model, weight_store
):
    """The trainer is killed after committing step 3, and that checkpoint's model file is
    then truncated (a node crash before the disk had it). The restarted trainer finds it
    damaged, restores step 2's, drops step 3's trajectories as `checkpoint_lost` (their
    entries were acked, they cannot be trained again) and finishes with every trajectory
    accounted for once."""
    run = f"damaged-{uuid.uuid4().hex[:6]}"
    recipe = handoff_recipe(run, tmp_path, tiny_model)
    steps = recipe["trainer"]["num_steps"]
    r = aioredis.from_url(infra.redis_url)
    store = WeightStoreClient(weight_store.grpc_addr or "")
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    rollout = SyntheticRollout(r, store, run, recipe["model"]["name"], vocab, gated=True)
    trainer = start_trainer(infra, tmp_path, weight_store)
    producer = None
    try:
        async with httpx.AsyncClient(headers=ADMIN, base_url=trainer.http) as client:
            response = await client.post("/v1/runs", json=recipe)
            assert response.status_code == 202, response.text
        producer = asyncio.create_task(rollout.run_forever())
        rollout.release(3 * GROUPS_PER_STEP)
        await wait_run(trainer.http, run, lambda s: s["checkpoint_step"] == 3, producer=producer)
        os.kill(trainer.proc.pid, signal.SIGKILL)
        trainer.proc.wait(timeout=10)
        checkpoints = tmp_path / "runs" / run / "checkpoints"
        [step3] = checkpoints.glob("step-000003-*")
        model = step3 / "model.safetensors"
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])

        trainer = start_trainer(infra, tmp_path, weight_store)
        resumed = await wait_run(trainer.http, run, lambda s: s["resumed"] == 1, 60)
        assert resumed["step"] == 2  # the checkpoint before the damaged one
        rollout.release(100)
        final = await wait_run(trainer.http, run, lambda s: s["state"] != "running", 120)
    finally:
        if producer is not None:
            producer.cancel()
        trainer.stop()
    assert final["state"] == "succeeded", final["error"]
    assert "checkpoint damaged" in trainer.log.read_text()
    per_step = GROUPS_PER_STEP * GROUP_SIZE
    assert final["dropped"].get("checkpoint_lost") == per_step
    assert final["pending_after_run"] == 0
    assert final["trajectories_consumed"] == final["trajectories_produced"]
    assert final["trajectories_acked"] == final["trajectories_consumed"] + final["rejected"]
    ledger = [f for _, f in await r.xrange(names.ledger_stream(run))]
    [rollback] = [f for f in ledger if f[b"kind"] == b"rollback"]
    lost = set(json.loads(rollback[b"dropped"]))
    step3 = [f for f in ledger if f[b"kind"] == b"step" and int(f[b"step"]) == 3]
    assert len(step3) == 2 and set(json.loads(step3[0][b"trained"])) == lost
    trained = [t for f in ledger for t in json.loads(f[b"trained"])]
    kept = [t for t in trained if t not in lost]
    assert len(kept) == len(set(kept)) == steps * per_step == final["trajectories_trained"]
    dropped = {t for f in ledger for t in json.loads(f[b"dropped"])}
    assert set(kept) | dropped == set(rollout.produced)
    await store.close()
    await r.aclose()


@pytest.mark.parametrize("publish_worker", ["never", "always"])
async def test_a_run_rides_through_a_weight_store_restart(
    infra, tmp_path, tiny_model, publish_worker
):
    """The weight-store is SIGKILLed mid-run and comes back 8 s later on the same address:
    the run's failed publish is an infrastructure error, so the trainer resumes the run from
    its last checkpoint (backoff) instead of failing it, and the ledger stays exact. The
    same with the background publishes in a child process (`trainer_publish_worker`, what a
    trainer on a GPU does): its error is the store's, and no child outlives its run."""
    run = f"wsdown-{uuid.uuid4().hex[:6]}"
    recipe = handoff_recipe(run, tmp_path, tiny_model)
    steps = recipe["trainer"]["num_steps"]
    (tmp_path / "ws").mkdir()
    http_port, grpc_port = free_ports(2)
    ports = {"TREADLE_HTTP_PORT": str(http_port), "TREADLE_GRPC_PORT": str(grpc_port)}
    store_proc = start_service("weight-store", infra, tmp_path / "ws", **ports)
    r = aioredis.from_url(infra.redis_url)
    store = WeightStoreClient(store_proc.grpc_addr or "", retry_s=1.0)  # rollout goes on
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    rollout = SyntheticRollout(r, store, run, recipe["model"]["name"], vocab, gated=True)
    # the store stays away longer than the trainer retries its calls (2 s here): the run
    # itself must recover (retrying, then resumed from its checkpoint)
    trainer = start_service(
        "trainer",
        infra,
        tmp_path,
        TREADLE_WEIGHT_STORE_ADDR=store_proc.grpc_addr or "",
        TREADLE_TRAINER_LEASE_S="2",
        TREADLE_WEIGHT_STORE_RETRY_S="2",
        TREADLE_TRAINER_PUBLISH_WORKER=publish_worker,
    )
    producer = None
    try:
        async with httpx.AsyncClient(headers=ADMIN, base_url=trainer.http) as client:
            response = await client.post("/v1/runs", json=recipe)
            assert response.status_code == 202, response.text
        producer = asyncio.create_task(rollout.run_forever())
        rollout.release(2 * GROUPS_PER_STEP)
        await wait_run(trainer.http, run, lambda s: s["checkpoint_step"] == 2, producer=producer)
        os.kill(store_proc.proc.pid, signal.SIGKILL)
        store_proc.proc.wait(timeout=10)
        rollout.release(GROUPS_PER_STEP)  # step 3 trains; its publish finds no store
        await asyncio.sleep(8.0)  # longer than the publish's own retries
        store_proc = start_service("weight-store", infra, tmp_path / "ws", **ports)
        rollout.release(100)
        final = await wait_run(
            trainer.http, run, lambda s: s["state"] in ("succeeded", "failed"), 180
        )
        left = [" ".join(c.cmdline()) for c in psutil.Process(trainer.proc.pid).children()]
        assert not [c for c in left if "weights_worker" in c], left
    finally:
        if producer is not None:
            producer.cancel()
        trainer.stop()
        store_proc.stop()
    assert final["state"] == "succeeded", (final["error"], trainer.log.read_text()[-4000:])
    assert final["resumed"] >= 1  # resumed from its checkpoint after the store came back
    assert final["step"] == steps and final["pending_after_run"] == 0
    assert "run interrupted; resuming" in trainer.log.read_text()
    assert ("publish worker started" in trainer.log.read_text()) == (publish_worker == "always")
    await assert_ledger_exact(r, run, steps, rollout.produced)
    await store.close()
    await r.aclose()
