"""Many runs, one fleet, on a real Redis: which run's task a rollout replica starts next
(`treadle_common.fleet.scheduling` in `TaskWorker`), and which runs it serves at all."""

from __future__ import annotations

import asyncio
import json
import uuid

import grpc
import httpx
import pytest
import redis
import torch

from tests.support.services import TOKENS, start_service
from treadle_common import names
from treadle_common.auth import policy as auth
from treadle_common.clients import streams
from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.config.recipe import RunConfig
from treadle_common.fleet import runs as fleet
from treadle_common.fleet import scheduling
from treadle_common.fleet.quotas import TenantQuotas
from treadle_common.proto.treadle.v1 import task_pb2, weights_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout.worker import TaskWorker

pytestmark = pytest.mark.integration


class Recorded:
    """Episodes that record which run's task started, in order, and take a moment (longer
    for runs named in `slow_s`)."""

    def __init__(self, slow_s: dict[str, float] | None = None) -> None:
        self.started: list[str] = []
        self.slow_s = slow_s or {}

    async def run(self, task, index, gate=None):
        name = task.run_id.split("-")[0]
        if index == 0:
            self.started.append(name)
        await asyncio.sleep(self.slow_s.get(name, 0.02))
        return tpb.Trajectory(trajectory_id=f"{task.task_id}/{index}", run_id=task.run_id)


class Held:
    class engine:  # noqa: N801
        version = 0


async def add_run(
    r, run: str, base: str, tasks: int, weight=1.0, priority=0, at=0.0, tenant="default"
) -> None:
    """A registered run with `tasks` tasks fed at `at`, `at` + 1, ... (created_at)."""
    policy = fleet.RunPolicy(
        run_id=run, policy=base, base=base, weight=weight, priority=priority, tenant=tenant
    )
    await fleet.register(r, policy)
    stream = names.tasks_stream(run)
    for i in range(tasks):
        task = task_pb2.Task(
            task_id=f"{run}-{i}",
            run_id=run,
            env="e",
            scorer="s",
            group_size=2,
            model=base,
            created_at=at + i,
        )
        task.sampling.max_new_tokens = 4
        await streams.add(r, stream, task)
    await r.sadd(names.RUNS_KEY, run)


async def started_order(
    r, policy: scheduling.Policy, runs: dict, until: int, slow_s=None, slots: int = 1
) -> list[str]:
    episodes = Recorded(slow_s)
    worker = TaskWorker(
        r, episodes, Held(), consumer="c1", max_concurrent_tasks=slots, policy=policy, model="tiny"
    )
    job = asyncio.create_task(worker.run())
    try:
        for _ in range(400):
            if len(episodes.started) >= until:
                break
            await asyncio.sleep(0.05)
    finally:
        await worker.drain()
        job.cancel()
        for run in runs:
            await r.srem(names.RUNS_KEY, run)
            await fleet.unregister(r, run)
    return episodes.started


async def test_priority_first_then_shares_by_weight_and_other_models_untouched(redis_client):
    tag = uuid.uuid4().hex[:6]
    runs = {
        f"hi-{tag}": dict(priority=1),
        f"a-{tag}": dict(weight=2.0),
        f"b-{tag}": {},
        f"c-{tag}": {},
    }
    for run, kw in runs.items():
        await add_run(redis_client, run, "tiny", 20 if run.startswith("hi") else 40, **kw)
    other = f"o-{tag}"
    await add_run(redis_client, other, "tiny-b", 5)  # a model this replica does not serve
    try:
        order = await started_order(redis_client, scheduling.WeightedFairShare(), runs, 60)
    finally:  # the shared Redis's other tests run workers that serve every model
        await redis_client.srem(names.RUNS_KEY, other)
        await fleet.unregister(redis_client, other)
    assert order[:20] == ["hi"] * 20  # the high-priority run's tasks go first
    shares = {k: order[20:60].count(k) for k in ("a", "b", "c")}
    # weights 2:1:1 of slot-seconds; equal tasks, so of tasks too (up to their jitter: each
    # is charged the wall time it held its slot, which a loaded machine stretches)
    assert abs(shares["a"] - 20) <= 4 and all(abs(shares[k] - 10) <= 3 for k in "bc"), shares
    assert "o" not in order
    assert await redis_client.xlen(names.trajectories_stream(other)) == 0
    info = await redis_client.xinfo_groups(names.tasks_stream(other))
    assert not info or info[0]["entries-read"] in (None, 0)  # never read


async def test_a_run_whose_tasks_hold_slots_long_pays_for_the_time(redis_client):
    """Slot-seconds are what is shared: a run whose episodes take 10x longer (slow tools, a
    reward timeout storm) gets about a tenth of the task starts of an equal-weight run, not
    half of them, so it cannot crowd the other out of the slots."""
    tag = uuid.uuid4().hex[:6]
    runs = {f"slow-{tag}": {}, f"fast-{tag}": {}}
    for run in runs:
        await add_run(redis_client, run, "tiny", 60)
    slow = {"slow": 0.05, "fast": 0.005}
    order = await started_order(redis_client, scheduling.WeightedFairShare(), runs, 50, slow, 2)
    assert order[:50].count("fast") >= 2 * order[:50].count("slow"), order


async def test_fifo_is_the_baseline_and_goes_by_feeding_time_alone(redis_client):
    """First come, first served: the oldest task first, whatever the weights and priorities
    (a's tasks fed at 0, 1, 2, ...; b's at 0.5, 1.5, ...: they alternate)."""
    tag = uuid.uuid4().hex[:6]
    runs = {f"a-{tag}": dict(weight=2.0, at=0.0), f"b-{tag}": dict(priority=5, at=0.5)}
    for run, kw in runs.items():
        await add_run(redis_client, run, "tiny", 10, **kw)
    order = await started_order(redis_client, scheduling.Fifo(), runs, 20)
    assert order == ["a", "b"] * 10, order


A_TOKEN, B_TOKEN = "tenant-a-token-0123456789", "tenant-b-token-0123456789"
A_AGENT, B_AGENT = "tenant-a-agent-0123456789", "tenant-b-agent-0123456789"
KEY_1, KEY_2 = "tenant-a-tinker-key-one-0123", "tenant-a-tinker-key-two-0123"
"""Two Tinker API keys of tenant a (role `tinker`)."""


class Overlapping:
    """Episodes that take a moment and record the most of each tenant's at once."""

    def __init__(self, tenant_of: dict[str, str]) -> None:
        self.tenant_of, self.now, self.most = tenant_of, {}, {}
        self.done = 0

    async def run(self, task, index, gate=None):
        t = self.tenant_of[task.run_id]
        self.now[t] = self.now.get(t, 0) + 1
        self.most[t] = max(self.most.get(t, 0), self.now[t])
        self.most["all"] = max(self.most.get("all", 0), sum(self.now.values()))
        await asyncio.sleep(0.3)
        self.now[t] -= 1
        self.done += 1
        return tpb.Trajectory(trajectory_id=f"{task.task_id}/{index}", run_id=task.run_id)


async def test_a_tenant_past_its_episode_quota_waits_and_the_other_does_not(redis_client):
    """`tenant_max_episodes` = 2 (fleet-wide, in Redis): tenant x's two runs (a task of each
    would be 4 episodes) never have more than two episodes in flight on a replica with 8
    slots; tenant y's run goes on beside them."""
    tag = uuid.uuid4().hex[:6]
    x, y = f"x-{tag}", f"y-{tag}"
    tenant_of = {f"x1-{tag}": x, f"x2-{tag}": x, f"y1-{tag}": y}
    for run, tenant in tenant_of.items():
        await add_run(redis_client, run, "tiny", 6, tenant=tenant)
    episodes = Overlapping(tenant_of)
    quotas = TenantQuotas(redis_client, max_episodes=2)
    worker = TaskWorker(
        redis_client, episodes, Held(), consumer="c1", max_concurrent_tasks=8, quotas=quotas
    )
    job = asyncio.create_task(worker.run())
    try:
        for _ in range(400):
            if episodes.done >= 36:  # 18 tasks of 2 episodes
                break
            await asyncio.sleep(0.05)
    finally:
        await worker.drain()
        job.cancel()
        for run in tenant_of:
            await redis_client.srem(names.RUNS_KEY, run)
            await fleet.unregister(redis_client, run)
    assert episodes.done == 36
    assert episodes.most[x] == 2 and episodes.most["all"] == 4, episodes.most
    assert worker.share.quota_waits > 0
    assert await redis_client.zcard(names.tenant_episodes(x)) == 0  # every lease released


@pytest.fixture(scope="module")
def tenants(infra, tiny_model, tmp_path_factory):
    """A trainer (with its weight-store and env-gateway) whose token table gives two tenants
    a trainer token each, and lets a tenant have one active run; its Tinker API trains the
    tiny model; and a rollout whose agent tokens are the two tenants' too. Yields (trainer,
    weight-store, rollout)."""
    tmp = tmp_path_factory.mktemp("tenants")
    table = {
        "admin": TOKENS["admin"],
        "trainer": [
            TOKENS["trainer"],
            {"token": A_TOKEN, "tenant": "a"},
            {"token": B_TOKEN, "tenant": "b"},
        ],
        "read": TOKENS["read"],
        "rollout": TOKENS["rollout"],
        "agent": [
            TOKENS["agent"],
            {"token": A_AGENT, "tenant": "a"},
            {"token": B_AGENT, "tenant": "b"},
        ],
        "tinker": [{"token": KEY_1, "tenant": "a"}, {"token": KEY_2, "tenant": "a"}],
    }
    env = {"TREADLE_AUTH_TOKENS": json.dumps(table), "TREADLE_AUTH_TOKENS_FILE": ""}
    store = start_service(
        "weight-store",
        infra,
        tmp,
        TREADLE_WEIGHT_STORE_DIR=str(tmp / "ws"),
        TREADLE_TENANT_MAX_STORED_BYTES="100",
        **env,
    )
    gateway = start_service("env-gateway", infra, tmp)
    trainer = start_service(
        "trainer",
        infra,
        tmp,
        TREADLE_WEIGHT_STORE_ADDR=store.grpc_addr or "",
        TREADLE_ENV_GATEWAY_ADDR=gateway.grpc_addr or "",
        TREADLE_TRAINER_TENANT_MAX_RUNS="1",
        TREADLE_TRAINER_TINKER_MODELS=json.dumps({"tiny": str(tiny_model)}),
        **env,
    )
    rollout = start_service(
        "rollout",
        infra,
        tmp,
        TREADLE_ROLLOUT_MODEL=str(tiny_model),
        TREADLE_ROLLOUT_MODEL_NAME=f"tenants-{uuid.uuid4().hex[:6]}",  # serves no other run
        TREADLE_WEIGHT_STORE_ADDR=store.grpc_addr or "",
        TREADLE_ENV_GATEWAY_ADDR=gateway.grpc_addr or "",
        TREADLE_TENANT_MAX_TOKENS_PER_MINUTE="12",
        **env,
    )
    yield trainer, store, rollout
    for proc in (rollout, trainer, gateway, store):
        proc.stop_checked()
    # its runs never end by themselves: out of the shared Redis's active runs, so no other
    # test's trainer resumes them (their lease lapsed with this trainer)
    r = redis.Redis.from_url(infra.redis_url)
    for run in [m.decode() for m in r.smembers(names.RUNS_KEY)]:
        policy = r.hget(names.RUN_POLICIES, run)
        if policy is not None and fleet.RunPolicy.model_validate_json(policy).tenant in ("a", "b"):
            r.srem(names.RUNS_KEY, run)
            r.hdel(names.RUN_POLICIES, run)
    r.close()


def _as(token: str, base: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers=auth.bearer(token), timeout=30)


def test_a_tenant_sees_and_controls_only_its_runs_and_is_held_to_its_run_quota(
    tenants, tiny_model, tmp_path
):
    base = tenants[0].http
    a, b = _as(A_TOKEN, base), _as(B_TOKEN, base)
    admin = _as(TOKENS["admin"], base)
    tag = uuid.uuid4().hex[:6]

    def recipe(run: str) -> dict:
        return RunConfig.model_validate(
            {
                "run_id": run,
                "model": {"path": str(tiny_model), "name": f"m-{run}"},
                "trainer": {"num_steps": 50, "batch_timeout_s": 600},
                "output_dir": str(tmp_path),
            }
        ).model_dump(mode="json")

    ra, rb = f"ra-{tag}", f"rb-{tag}"
    started = a.post("/v1/runs", json=recipe(ra))
    assert started.status_code == 202 and started.json()["tenant"] == "a", started.text
    assert b.post("/v1/runs", json=recipe(rb)).json()["tenant"] == "b"
    assert [r["run_id"] for r in a.get("/v1/runs").json()] == [ra]
    assert a.get(f"/v1/runs/{ra}").status_code == 200
    refused = a.get(f"/v1/runs/{rb}")
    assert refused.status_code == 403 and "another tenant" in refused.text
    assert a.post(f"/v1/runs/{rb}/evaluations", json={"step": 1}).status_code == 403
    over = a.post("/v1/runs", json=recipe(f"rc-{tag}"))
    assert over.status_code == 429 and "quota runs" in over.text and "'a'" in over.text
    assert {r["run_id"] for r in admin.get("/v1/runs").json()} >= {ra, rb}
    assert admin.get(f"/v1/runs/{rb}").status_code == 200
    # a training session may not publish other weights under the model of an active run
    admin_trainer = _as(TOKENS["admin"], base)
    sid = admin_trainer.post(
        "/v1/training/sessions",
        json={"model_path": str(tiny_model), "model_name": f"m-{ra}", "seed": 0},
    ).json()["session_id"]
    assert admin_trainer.post(f"/v1/training/sessions/{sid}/save_weights").status_code == 200
    datum = {"model_input": [5, 6, 7], "target_tokens": [6, 7, 8]}
    body = {"loss_fn": "cross_entropy", "aggregation": "token", "data": [datum]}
    assert admin_trainer.post(f"/v1/training/sessions/{sid}/forward_backward", json=body).is_success
    adam = {"learning_rate": 0.1}
    assert admin_trainer.post(f"/v1/training/sessions/{sid}/optim_step", json=adam).is_success
    changed = admin_trainer.post(f"/v1/training/sessions/{sid}/save_weights")
    assert changed.status_code == 409 and f"base of active runs ['{ra}']" in changed.text
    admin_trainer.delete(f"/v1/training/sessions/{sid}")


def _future(client: httpx.Client, answer: httpx.Response) -> dict:
    """A Tinker future's result (it long-polls: try_again until done)."""
    assert answer.status_code == 200, answer.text
    request_id = answer.json()["request_id"]
    for _ in range(60):
        got = client.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if got.get("type") != "try_again":
            assert "error" not in got, got
            return got
    raise AssertionError("the future never finished")


def test_a_tenant_reaches_only_its_own_tinker_sessions_clients_futures_and_checkpoints(tenants):
    from tinker import types

    def body(request) -> dict:
        return request.model_dump(mode="json")

    base = tenants[0].http
    a, b, admin = _as(A_TOKEN, base), _as(B_TOKEN, base), _as(TOKENS["admin"], base)
    session = body(types.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0.38.0"))
    sid = a.post("/api/v1/create_session", json=session).json()["session_id"]
    create = body(
        types.CreateModelRequest(
            session_id=sid, model_seq_id=0, base_model="tiny", lora_config=types.LoraConfig(rank=4)
        )
    )
    model_id = _future(a, a.post("/api/v1/create_model", json=create))["model_id"]
    save = body(types.SaveWeightsRequest(model_id=model_id, path="c1"))
    path = _future(a, a.post("/api/v1/save_weights", json=save))["path"]
    adam = body(
        types.OptimStepRequest(
            model_id=model_id, seq_id=7, adam_params=types.AdamParams(learning_rate=1e-3)
        )
    )
    stepped = a.post("/api/v1/optim_step", json=adam).json()["request_id"]
    load = body(types.LoadWeightsRequest(model_id=model_id, path=path, optimizer=False))
    sampling = body(
        types.CreateSamplingSessionRequest(
            session_id=sid, sampling_session_seq_id=0, base_model="tiny"
        )
    )

    refused = {
        "get_info": b.post("/api/v1/get_info", json={"model_id": model_id}),
        "heartbeat": b.post("/api/v1/session_heartbeat", json={"session_id": sid}),
        "create_model": b.post("/api/v1/create_model", json={**create, "model_seq_id": 1}),
        "optim_step": b.post("/api/v1/optim_step", json={**adam, "seq_id": 9}),
        "retrieve_future": b.post("/api/v1/retrieve_future", json={"request_id": stepped}),
        "weights_info": b.post("/api/v1/weights_info", json={"tinker_path": path}),
        "load_weights": b.post("/api/v1/load_weights", json=load),
        "sampling": b.post("/api/v1/create_sampling_session", json=sampling),
        "finish": b.post(f"/api/v1/sessions/{sid}/finish"),
    }
    assert {k: r.status_code for k, r in refused.items()} == dict.fromkeys(refused, 403)
    assert all("another tenant" in r.text for r in refused.values()), refused
    # b's own session may not load a's checkpoint into a client of its own
    b_sid = b.post("/api/v1/create_session", json=session).json()["session_id"]
    stolen = {**load, "model_id": None, "session_id": b_sid, "model_seq_id": 0}
    assert b.post("/api/v1/load_weights", json=stolen).status_code == 403
    # a, and admin, still reach it all: nothing of a's was touched
    got = a.post("/api/v1/retrieve_future", json={"request_id": stepped})
    assert got.status_code == 200 and "metrics" in got.json(), got.text
    assert admin.post("/api/v1/get_info", json={"model_id": model_id}).status_code == 200
    assert a.post("/api/v1/weights_info", json={"tinker_path": path}).status_code == 200
    assert a.post(f"/api/v1/sessions/{sid}/finish").status_code == 204
    b.post(f"/api/v1/sessions/{b_sid}/finish")


async def test_a_tinker_key_reaches_only_what_it_made_and_no_weight_store_mutation(tenants):
    """A `tinker` key trains through the Tinker API and nothing else: another key of its own
    tenant does not reach its session, client, future or checkpoint; it mutates nothing in
    the weight store and starts no run (the `trainer` role could do both)."""
    from tinker import types

    trainer, store, _ = tenants
    one, two = _as(KEY_1, trainer.http), _as(KEY_2, trainer.http)
    a = _as(A_TOKEN, trainer.http)  # the tenant's own trainer token sees its keys' work
    session = {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
    sid = one.post("/api/v1/create_session", json=session).json()["session_id"]
    create = types.CreateModelRequest(
        session_id=sid, model_seq_id=0, base_model="tiny", lora_config=types.LoraConfig(rank=4)
    ).model_dump(mode="json")
    model_id = _future(one, one.post("/api/v1/create_model", json=create))["model_id"]
    save = {"model_id": model_id, "path": "k1", "type": "save_weights"}
    path = _future(one, one.post("/api/v1/save_weights", json=save))["path"]
    refused = {
        "get_info": two.post("/api/v1/get_info", json={"model_id": model_id}),
        "heartbeat": two.post("/api/v1/session_heartbeat", json={"session_id": sid}),
        "weights_info": two.post("/api/v1/weights_info", json={"tinker_path": path}),
        "finish": two.post(f"/api/v1/sessions/{sid}/finish"),
        "start a run": one.post("/v1/runs", json={}),
        "evaluate a run": one.post("/v1/runs/some-run/evaluations", json={}),
    }
    assert {k: r.status_code for k, r in refused.items()} == dict.fromkeys(refused, 403)
    assert one.post("/api/v1/get_info", json={"model_id": model_id}).status_code == 200
    assert a.post("/api/v1/weights_info", json={"tinker_path": path}).status_code == 200
    key = WeightStoreClient(store.grpc_addr or "", token=KEY_1, attempts=1)
    raw = state_dict_to_raw({"w": torch.ones(4)})
    try:
        for call in (
            key.publish(f"k1-{uuid.uuid4().hex[:6]}", raw),
            key.delete_version("tiny", 1),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await call
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        a_store = WeightStoreClient(store.grpc_addr or "", token=A_TOKEN, attempts=1)
        a_model = f"a-k-{uuid.uuid4().hex[:6]}"
        try:
            await a_store.publish(a_model, raw)  # its tenant's: not the key's to see
        finally:
            await a_store.close()
        listed = await key.stub.ListModels(weights_pb2.ListModelsRequest())
        assert a_model not in listed.models, listed.models
    finally:
        await key.close()
    assert one.post(f"/api/v1/sessions/{sid}/finish").status_code == 204


async def test_a_tenant_reaches_only_its_own_and_the_fleets_weights(tenants):
    store = tenants[1]
    tag = uuid.uuid4().hex[:6]
    a = WeightStoreClient(store.grpc_addr or "", token=A_TOKEN, attempts=1)
    b = WeightStoreClient(store.grpc_addr or "", token=B_TOKEN, attempts=1)
    fleet_token = WeightStoreClient(store.grpc_addr or "", token=TOKENS["trainer"], attempts=1)
    raw = state_dict_to_raw({"w": torch.ones(4)})
    try:
        await a.publish(f"a-own-{tag}", raw, metadata={names.WEIGHTS_TENANT_KEY: "b"})
        # the trainer service publishes a run's versions for its tenant
        await fleet_token.publish(f"run-of-a-{tag}", raw, metadata={names.WEIGHTS_TENANT_KEY: "a"})
        await fleet_token.publish(f"fleet-{tag}", raw)  # a base model: the fleet's
        for model in (f"a-own-{tag}", f"run-of-a-{tag}"):
            assert (await a.get_manifest(model)).metadata[names.WEIGHTS_TENANT_KEY] == "a"
            for call in (
                b.get_manifest(model),
                b.list_versions(model),
                b.fetch(model, -1),
                b.delete_version(model, 1),
                b.publish(model, raw),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # a tenant writes no fleet model
            await a.publish(f"fleet-{tag}", raw)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await b.get_manifest(f"fleet-{tag}")).model == f"fleet-{tag}"  # bases: all read
        seen_by_b = await b.stub.ListModels(weights_pb2.ListModelsRequest())
        assert f"fleet-{tag}" in seen_by_b.models
        assert not {f"a-own-{tag}", f"run-of-a-{tag}"} & set(seen_by_b.models)
        http = _as(B_TOKEN, store.http)
        assert http.get(f"/v1/models/a-own-{tag}/versions").status_code == 403
        assert f"a-own-{tag}" not in http.get("/v1/models").json()["models"]
    finally:
        for client in (a, b, fleet_token):
            await client.close()


async def test_a_tenant_reaches_only_its_own_openai_sessions_and_runs(tenants, redis_client):
    rollout = tenants[2]
    a, b, admin = (_as(t, rollout.http) for t in (A_AGENT, B_AGENT, TOKENS["admin"]))
    a_trainer = _as(A_TOKEN, rollout.http)  # a's trainer token may set a reward (an agent not)
    sid = f"s-{uuid.uuid4().hex[:8]}"
    model = a.get("/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    header = {"X-Treadle-Session": sid}
    assert a.post("/v1/chat/completions", json=chat, headers=header).status_code == 200
    b_run, a_run = f"rb-{uuid.uuid4().hex[:6]}", f"ra-{uuid.uuid4().hex[:6]}"
    for run, tenant in ((b_run, "b"), (a_run, "a")):
        policy = fleet.RunPolicy(run_id=run, policy="m", base="m", tenant=tenant)
        await fleet.register(redis_client, policy)
        await redis_client.sadd(names.RUNS_KEY, run)
    try:
        refused = {
            "continue": b.post("/v1/chat/completions", json=chat, headers=header),
            "read": b.get(f"/v1/sessions/{sid}"),
            "finish": b.post(f"/v1/sessions/{sid}/finish", json={}),
            "delete": b.delete(f"/v1/sessions/{sid}"),
            # a's own session, but into b's run: b's trajectories are b's alone
            "into another's run": a_trainer.post(
                f"/v1/sessions/{sid}/finish", json={"run_id": b_run, "reward": 1.0}
            ),
        }
        assert {k: r.status_code for k, r in refused.items()} == dict.fromkeys(refused, 403)
        assert all("another tenant" in r.text for r in refused.values()), refused
        assert await redis_client.xlen(names.trajectories_stream(b_run)) == 0
        assert admin.get(f"/v1/sessions/{sid}").json()["turns"] == 1  # untouched by b
        done = a_trainer.post(f"/v1/sessions/{sid}/finish", json={"run_id": a_run, "reward": 1.0})
        assert done.status_code == 200, done.text
        assert await redis_client.xlen(names.trajectories_stream(a_run)) == 1
    finally:
        for run in (a_run, b_run):
            await redis_client.srem(names.RUNS_KEY, run)
            await fleet.unregister(redis_client, run)


async def test_past_a_tenants_quota_its_requests_are_refused_naming_it(tenants):
    """Generated tokens per minute (rollout: 429) and stored bytes (weight-store:
    RESOURCE_EXHAUSTED); the other tenant is not held to what the first used."""
    _, store, rollout = tenants
    b = _as(B_AGENT, rollout.http)
    model = b.get("/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    # 4 tokens each, fewer where the model ends early: some request past 12 tokens is refused
    answers = [b.post("/v1/chat/completions", json=chat) for _ in range(20)]
    codes = [a.status_code for a in answers]
    assert 429 in codes and set(codes) == {200, 429}, codes
    refused = answers[codes.index(429)]
    assert "quota tokens_per_minute" in refused.text and "'b'" in refused.text
    assert refused.json()["error"]["code"] == "quota_exceeded"
    a = _as(A_AGENT, rollout.http)
    assert a.post("/v1/chat/completions", json={**chat, "max_tokens": 1}).status_code == 200

    tag = uuid.uuid4().hex[:6]
    client = WeightStoreClient(store.grpc_addr or "", token=B_TOKEN, attempts=1)
    other = WeightStoreClient(store.grpc_addr or "", token=A_TOKEN, attempts=1)
    try:

        def forty_bytes(i: int) -> dict:
            return state_dict_to_raw({"w": torch.full((10,), float(i))})

        for i in range(2):  # two fit in the quota of 100
            await client.publish(f"b-q-{tag}", forty_bytes(i))
        with pytest.raises(grpc.aio.AioRpcError) as over:
            await client.publish(f"b-q-{tag}", forty_bytes(9))
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "quota stored_bytes" in (over.value.details() or "")
        await other.publish(f"a-q-{tag}", state_dict_to_raw({"w": torch.zeros(10)}))
    finally:
        await client.close()
        await other.close()


def test_a_tenant_reaches_only_its_own_training_sessions(tenants, tiny_model):
    """`/v1/training` sessions are their creator's tenant's (the training-session core): the
    other tenant's token is refused on every route; the owner's and admin's are not."""
    base = tenants[0].http
    a, b, admin = _as(A_TOKEN, base), _as(B_TOKEN, base), _as(TOKENS["admin"], base)
    created = a.post(
        "/v1/training/sessions",
        json={"model_path": str(tiny_model), "model_name": f"own-{uuid.uuid4().hex[:6]}"},
    )
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    datum = {"model_input": [5, 6, 7], "target_tokens": [6, 7, 8]}
    fb = {"loss_fn": "cross_entropy", "aggregation": "token", "data": [datum]}
    routes = {
        "forward_backward": ("post", f"{sid}/forward_backward", fb),
        "optim_step": ("post", f"{sid}/optim_step", {"learning_rate": 0.1}),
        "save_state": ("post", f"{sid}/save_state", {"name": "mine"}),
        "save_weights": ("post", f"{sid}/save_weights", None),
    }
    for method, path, body in routes.values():
        refused = b.request(method, f"/v1/training/sessions/{path}", json=body)
        assert refused.status_code == 403 and "another tenant" in refused.text, refused.text
    assert b.delete(f"/v1/training/sessions/{sid}").status_code == 403
    for method, path, body in routes.values():
        answer = a.request(method, f"/v1/training/sessions/{path}", json=body)
        assert answer.is_success, answer.text
    assert a.post(f"/v1/training/sessions/{sid}/optim_step", json={}).json()["step"] == 2
    assert admin.delete(f"/v1/training/sessions/{sid}").status_code == 204
    gone = a.post(f"/v1/training/sessions/{sid}/optim_step", json={})
    assert gone.status_code == 404, gone.text
