"""The env-gateway as a real process: sessions over gRPC and HTTP, health, bad input."""

import asyncio

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.services import api_get, api_post
from treadle_common.clients.env import EnvClient

pytestmark = pytest.mark.integration


async def test_sessions_over_grpc_and_http(service):
    gw = service("env-gateway")
    client = EnvClient(gw.grpc_addr)
    assert "arith" in await client.list_envs()
    tasks = await client.sample_tasks("arith", 3, seed=0)
    assert len(tasks) == 3 and all("answer" in t for t in tasks)
    session = await client.create("arith", tasks[0])
    assert session.observation.messages[0].content == f"{tasks[0]['a']}+{tasks[0]['b']}="
    assert session.session_id.startswith(session.replica + ":")
    step = await client.step(session.session_id, tasks[0]["answer"])
    assert step.done and not step.has_reward
    await client.close_session(session.session_id)

    health = health_pb2_grpc.HealthStub(client.channel)
    assert (
        await health.Check(health_pb2.HealthCheckRequest())
    ).status == health_pb2.HealthCheckResponse.SERVING

    with pytest.raises(grpc.aio.AioRpcError) as unknown_env:
        await client.create("nope", {})
    assert (
        unknown_env.value.code() == grpc.StatusCode.NOT_FOUND
        and "known: ['arith'" in unknown_env.value.details()
    )
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await client.step(session.session_id, "1")
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as bad_task:
        await client.create("arith", {"a": "x"})
    assert bad_task.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await client.close()

    created = api_post(
        f"{gw.http}/v1/sessions", json={"env": "arith", "task": {"a": 1, "b": 2, "op": "+"}}
    ).json()
    stepped = api_post(
        f"{gw.http}/v1/sessions/{created['session_id']}/step", json={"text": "3"}
    ).json()
    assert stepped["done"] and stepped["info"]["answer"] == "3"
    assert api_post(f"{gw.http}/v1/sessions", json={"env": "nope", "task": {}}).status_code == 404
    assert api_post(f"{gw.http}/v1/sessions/missing/step", json={"text": "1"}).status_code == 404
    assert api_get(f"{gw.http}/openapi.json").json()["paths"]["/v1/sessions"]
    assert httpx.get(f"{gw.http}/readyz").status_code == 200


async def test_capacity_and_idle_expiry(service):
    gw = service("env-gateway", TREADLE_ENV_MAX_SESSIONS="1", TREADLE_ENV_IDLE_TTL_S="1")
    client = EnvClient(gw.grpc_addr)
    first = await client.create("guess_number", {"low": 1, "high": 9, "target": 5})
    with pytest.raises(grpc.aio.AioRpcError) as full:
        await client.create("guess_number", {"low": 1, "high": 9, "target": 5})
    assert (
        full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "limit is 1" in full.value.details()
    )
    task = {"env": "arith", "task": {"a": 1, "b": 1, "op": "+"}}
    assert api_post(f"{gw.http}/v1/sessions", json=task).status_code == 429
    await asyncio.sleep(2.5)  # idle past the TTL: the session is gone, its slot is free
    with pytest.raises(grpc.aio.AioRpcError) as expired:
        await client.step(first.session_id, "5")
    assert (
        expired.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in expired.value.details()
    )
    assert (await client.create("arith", {"a": 1, "b": 1, "op": "+"})).session_id
    await client.close()


async def test_stall_detector_names_the_stage_that_made_no_progress(service):
    gw = service("env-gateway", TREADLE_STALL_AFTER_S="0.5")
    client = EnvClient(gw.grpc_addr)
    task = {"a": 1, "b": 2, "op": "+"}
    slow = await client.create("arith", task, options={"latency": {"fixed_ms": 3000}})
    step = asyncio.create_task(client.step(slow.session_id, "3"))

    def stage() -> dict:
        return api_get(f"{gw.http}/v1/info").json()["progress"]["step"]

    for _ in range(50):  # the slow step is pending; after 0.5 s without progress: stalled
        await asyncio.sleep(0.1)
        if stage()["stalled"]:
            break
    assert stage()["stalled"] and stage()["pending"] == 1
    await asyncio.sleep(1.2)  # the detector's loop has seen it: gauge set
    gauge = 'treadle_stage_stalled{service="env-gateway",stage="step"} 1.0'
    assert gauge in api_get(f"{gw.http}/metrics").text
    assert (await step).done
    after = stage()
    assert not after["stalled"] and after["pending"] == 0 and after["done"] == 1
    await client.close()


async def test_a_groups_hops_travel_together_and_a_slow_step_holds_up_only_its_own(service):
    gw = service("env-gateway")
    client = EnvClient(gw.grpc_addr, batch=True)
    task = {"a": 2, "b": 3, "op": "+", "answer": "5"}
    fast, other = await asyncio.gather(
        client.create("arith", task, seed=0), client.create("arith", task, seed=1)
    )
    slow_session = await client.create("arith", task, 2, {"latency": {"fixed_ms": 1500}})
    order: list[str] = []

    async def step(name, session_id, text):
        result = await client.step(session_id, text, close_when_done=True)
        order.append(name)
        return result

    results = await asyncio.gather(
        step("slow", slow_session.session_id, "5"),
        step("fast", fast.session_id, "5"),
        step("wrong", other.session_id, "4"),
        step("gone", "nope:1", "5"),
        return_exceptions=True,
    )
    slow_result, fast_result, wrong, gone = results
    assert order[-1] == "slow" and set(order[:2]) == {"fast", "wrong"}  # as each finished
    assert slow_result.done and fast_result.done and wrong.done
    # each episode got the result of its own action
    assert [json_of(r.info_json)["answer"] for r in (slow_result, fast_result, wrong)] == [
        "5",
        "5",
        "4",
    ]
    assert gone.code == "NOT_FOUND" and "no session" in gone.message  # its own error only
    with pytest.raises(grpc.aio.AioRpcError) as closed:  # done + close_when_done: closed
        await EnvClient(gw.grpc_addr).step(fast.session_id, "5")
    assert closed.value.code() == grpc.StatusCode.NOT_FOUND
    # creates of one group in one call; a bad one fails them all and leaves none open
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await client.create_many("arith", '{"a": "x"}', [0, 1], "{}")
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert api_get(f"{gw.http}/v1/info").json()["sessions"] == 0
    await client.close()


def json_of(text: str) -> dict:
    import json

    return json.loads(text)
