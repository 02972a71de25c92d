"""redis-server and nats-server go away and come back under running services: `/readyz`
turns 503 naming the dependency, then 200 again; reward serves again once NATS is back (its
subscription is renewed); the trainer's run API answers again once Redis is back."""

import asyncio
import json
import time
from pathlib import Path

import httpx
import nats
import pytest

from tests.support.services import api_get, private_infra, start_service
from treadle_cli.infra import Infra, terminate
from treadle_common.clients.reward import RewardClient
from treadle_common.proto.treadle.v1 import reward_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


@pytest.fixture
def own_infra(tmp_path):
    """A private redis-server (AOF) and nats-server (JetStream on disk) this test restarts."""
    with private_infra(tmp_path / "infra") as infra:
        yield infra


def readiness(http: str) -> tuple[int, dict]:
    try:
        response = httpx.get(f"{http}/readyz", timeout=3)
    except httpx.HTTPError as exc:
        return 0, {"http": repr(exc)}
    return response.status_code, response.json()["checks"]


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def stop(manager: Infra, name: str) -> None:
    record = manager._read_pidfile(name)
    assert record is not None
    terminate(record.pid)
    manager._pidfile(name).unlink()


async def score(nats_url: str) -> pb.ScoreResult:
    nc = await nats.connect(nats_url)
    try:
        request = pb.ScoreRequest(
            scorer="exact_match", task_json=json.dumps({"answer": "4"}), answer="4"
        )
        return await RewardClient(nc, timeout_s=10).score(request)
    finally:
        await nc.close()


async def test_nats_restart_under_reward_and_trainer(own_infra, tmp_path: Path):
    manager, urls = own_infra
    (tmp_path / "r").mkdir()
    (tmp_path / "t").mkdir()
    reward = start_service("reward", urls, tmp_path / "r")
    trainer = start_service("trainer", urls, tmp_path / "t")
    try:
        assert (await score(urls.nats_url)).status == pb.SCORE_STATUS_OK
        host, password = urls.nats_url.rsplit("@", 1)[1], manager.secrets().nats["reward"]
        stop(manager, "nats")
        for svc in (reward, trainer):
            wait_for(lambda s=svc: readiness(s.http)[0] == 503)
            code, checks = readiness(svc.http)
            assert checks["nats"] != "ok" and host in checks["nats"], checks
            assert ":***@" in checks["nats"] and password not in checks["nats"]  # redacted
        manager.up(("nats",))
        for svc in (reward, trainer):
            wait_for(lambda s=svc: readiness(s.http)[0] == 200)
        assert readiness(reward.http)[1]["subscription"] == "ok"
        result = await score(urls.nats_url)  # served: the replica subscribed again
        assert result.status == pb.SCORE_STATUS_OK and result.reward == 1.0
    finally:
        reward.stop_checked()
        trainer.stop_checked()


async def test_redis_restart_under_the_trainer(own_infra, tmp_path: Path):
    manager, urls = own_infra
    trainer = start_service("trainer", urls, tmp_path)
    try:
        assert api_get(f"{trainer.http}/v1/backlog", timeout=5).status_code == 200
        stop(manager, "redis")
        wait_for(lambda: readiness(trainer.http)[0] == 503)
        checks = readiness(trainer.http)[1]
        assert checks["redis"] != "ok" and checks["nats"] == "ok", checks
        assert httpx.get(f"{trainer.http}/healthz", timeout=5).status_code == 200  # alive
        manager.up(("redis",))
        wait_for(lambda: readiness(trainer.http)[0] == 200)
        assert api_get(f"{trainer.http}/v1/backlog", timeout=5).status_code == 200
    finally:
        trainer.stop_checked()


async def test_a_publish_while_nats_is_away_succeeds_and_is_announced_later(own_infra, tmp_path):
    """The version is committed whatever NATS does; its announcement goes out once NATS is
    back (rollout would also find it by polling the store meanwhile)."""
    import torch

    from treadle_common.clients.torch_weights import state_dict_to_raw
    from treadle_common.clients.weights import WeightStoreClient, watch

    manager, urls = own_infra
    store = start_service("weight-store", urls, tmp_path)
    client = WeightStoreClient(store.grpc_addr or "")
    try:
        await client.publish("m", state_dict_to_raw({"w": torch.zeros(10)}))
        stop(manager, "nats")
        wait_for(lambda: readiness(store.http)[0] == 503)
        published = await client.publish("m", state_dict_to_raw({"w": torch.ones(10)}))
        assert published.version == 2  # committed, not failed for want of NATS
        manager.up(("nats",))
        nc = await nats.connect(urls.nats_url)
        seen: list[int] = []

        async def on_announce(a) -> None:
            seen.append(a.version)

        await watch(nc.jetstream(), "m", on_announce)
        for _ in range(200):
            if 2 in seen:
                break
            await asyncio.sleep(0.1)
        assert 2 in seen
        await nc.close()
    finally:
        await client.close()
        store.stop_checked()
