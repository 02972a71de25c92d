"""Embedded infrastructure: real redis-server / nats-server processes on free ports, which
refuse clients without credentials and hold each NATS user to its subjects."""

import asyncio
import socket
from pathlib import Path

import nats
import pytest
import redis

from tests.support.services import free_ports
from treadle_cli.infra import Infra, InfraError, alive
from treadle_common import names
from treadle_common.auth import infra as infra_auth
from treadle_common.config.settings import Settings

pytestmark = pytest.mark.integration


def settings_for(tmp_path, redis_port=None, nats_port=None) -> Settings:
    free_redis, free_nats = free_ports(2)
    return Settings(
        state_dir=tmp_path,
        redis_url=f"redis://127.0.0.1:{redis_port or free_redis}",
        nats_url=f"nats://127.0.0.1:{nats_port or free_nats}",
    )


def test_up_status_down_leaves_no_process(tmp_path):
    infra = Infra(settings_for(tmp_path))
    states = infra.up()
    try:
        assert [(s.name, s.healthy, s.detail) for s in states] == [
            ("redis", True, "started"),
            ("nats", True, "started"),
        ]
        assert redis.Redis.from_url(infra.url_for("redis")).ping()
        assert (tmp_path / "logs" / "nats.log").exists() and (tmp_path / "redis").is_dir()
        assert all(s.healthy and s.managed for s in infra.status())
    finally:
        assert infra.down() == ["redis", "nats"]
    assert not any(alive(s.pid) for s in states)
    assert not any(s.healthy for s in infra.status())


def test_configured_url_that_answers_is_reused(infra, tmp_path):
    ours = Settings(state_dir=tmp_path, redis_url=infra.redis_url, nats_url=infra.nats_url)
    states = Infra(ours).up()
    assert all(s.detail == "already running" and not s.managed for s in states)
    assert Infra(ours).down() == []  # never stops what it did not start


def test_port_taken_by_something_else_names_the_port(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(InfraError, match=f"port 127.0.0.1:{port} is in use"):
            Infra(settings_for(tmp_path, redis_port=port)).up(("redis",))


@pytest.mark.slow
def test_two_s3_servers_started_at_once_on_one_machine_answer_s3(tmp_path):
    """Two at once (two test workers, two stacks): weed's extras on fixed ports (Iceberg 8181,
    Lance 9101) raced for them and one weed died at start; Treadle turns them off."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.support.services import free_port_range

    servers = []
    for i in range(2):
        base = free_port_range(6, also_offset=10000)
        settings = Settings(
            state_dir=tmp_path / str(i),
            redis_url="redis://127.0.0.1:1",
            nats_url="nats://127.0.0.1:1",
            s3_endpoint=f"127.0.0.1:{base}",
        )
        servers.append((Infra(settings), base))
    try:
        with ThreadPoolExecutor(2) as pool:
            states = list(pool.map(lambda s: s[0].up(("s3",), timeout_s=60), servers))
        assert [(s.healthy, s.detail) for (s,) in states] == [(True, "started")] * 2
        for _, base in servers:
            listing = httpx.get(f"http://127.0.0.1:{base}/", timeout=10)
            assert listing.status_code == 200 and "ListAllMyBucketsResult" in listing.text
        logs = [(infra.state_dir / "logs" / "s3.log").read_text() for infra, _ in servers]
        assert not [log for log in logs if "Iceberg" in log or "0.0.0.0" in log]
    finally:
        assert [infra.down() for infra, _ in servers] == [["s3"]] * len(servers)


def raw_reply(url: str, command: bytes) -> bytes:
    host, port = url.removeprefix("redis://").rsplit("@", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(command)
        return sock.recv(256)


def test_redis_without_the_password_gets_noauth(infra):
    plain = "redis://" + infra.redis_url.rsplit("@", 1)[1]
    assert raw_reply(plain, b"PING\r\n").startswith(b"-NOAUTH")
    assert raw_reply(plain, b"GET treadle:runs\r\n").startswith(b"-NOAUTH")
    with pytest.raises(redis.exceptions.RedisError):
        redis.Redis.from_url(plain, protocol=2).get("treadle:runs")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(infra_auth.with_credentials(plain, "", "wrong")).ping()
    assert redis.Redis.from_url(infra.redis_url).ping()


def refused(client: redis.Redis, *command) -> bool:
    """The command was refused for want of permission (at the top or inside a script)."""
    try:
        client.execute_command(*command)
    except redis.exceptions.ResponseError as exc:
        said = str(exc).lower()
        if "noperm" in said or "no permissions" in said or "can't" in said:
            return True
        raise
    return False


def test_redis_holds_each_service_to_its_keys_and_commands(infra):
    """A service's Redis credentials reach only its own keys (and those it shares with the
    other side of a run), never another's, and no administrative command; services that
    never use Redis have none."""
    assert set(infra.redis_urls) == set(infra_auth.REDIS_SERVICES) == {"rollout", "trainer"}
    admin = redis.Redis.from_url(infra.redis_url)
    rollout, trainer = (redis.Redis.from_url(infra.redis_for(s)) for s in ("rollout", "trainer"))
    run = "acl-run"
    trainers_own = [
        names.run_config(run),
        names.run_owner(run),
        names.run_fence(run),
        names.ledger_stream(run),
        names.fed_tasks(run),
        names.run_status(run),
        names.run_steps(run),
    ]
    for key in trainers_own:  # a config a rollout could rewrite, a lease it could steal
        admin.set(key, "x")
        assert refused(rollout, "GET", key) and refused(rollout, "DEL", key), key
        assert not refused(trainer, "EXISTS", key), key
    session = names.issued_session("s1")  # what an agent is judged against
    assert not refused(rollout, "SET", session, "{}")
    assert refused(trainer, "GET", session) and refused(trainer, "SET", session, "{}")
    for client in (rollout, trainer):
        assert refused(client, "GET", "not-treadle")
        for command in (
            ("FLUSHALL",),
            ("FLUSHDB",),
            ("KEYS", "*"),
            ("SCAN", 0),
            ("CONFIG", "SET", "requirepass", "x"),
            ("INFO",),
            ("CLIENT", "LIST"),
            ("ACL", "LIST"),
            ("DEBUG", "SLEEP", 0),
            ("MONITOR",),
            ("SCRIPT", "FLUSH"),
            ("SHUTDOWN",),
        ):
            assert refused(client, *command), command
        # a script reaches only what its caller may: declared or not
        other = session if client is trainer else names.run_config(run)
        assert refused(client, "EVAL", "return redis.call('GET', KEYS[1])", 1, other)
        assert refused(client, "EVAL", f"return redis.call('GET', '{other}')", 0)
        assert refused(client, "EVAL", "return redis.call('FLUSHALL')", 0)
    # what each side of a run shares works for both
    for client in (rollout, trainer):
        assert not refused(client, "HINCRBY", names.run_state(run), "n", 1)
        assert not refused(client, "XADD", names.trajectories_stream(run), "*", "pb", b"x")
        assert not refused(client, "SISMEMBER", names.RUNS_KEY, run)
    assert admin.hget(names.run_state(run), "n") == b"2"
    assert admin.get(names.run_config(run)) == b"x"  # untouched
    admin.acl_log_reset()  # refused on purpose (the infra fixture checks nothing else was)


async def nats_errors(url: str, act) -> list[str]:
    """What the server refused while `act(nc)` ran (permission errors arrive asynchronously)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False)
    try:
        await act(nc)
        await nc.flush()
        await asyncio.sleep(0.3)
    finally:
        await nc.close()
    return errors


async def test_nats_holds_each_user_to_its_subjects(infra):
    anonymous = "nats://" + infra.nats_url.rsplit("@", 1)[1]
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(anonymous, allow_reconnect=False, max_reconnect_attempts=0)
    wrong = infra_auth.with_credentials(anonymous, "rollout", "not-the-password")
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(wrong, allow_reconnect=False, max_reconnect_attempts=0)

    async def announce(nc) -> None:
        await nc.publish(names.weights_subject("served"), b"forged")

    async def join_reward(nc) -> None:
        await nc.subscribe(names.REWARD_WILDCARD, queue=names.REWARD_QUEUE)

    async def delete_stream(nc) -> None:
        await nc.publish(f"$JS.API.STREAM.DELETE.{names.WEIGHTS_STREAM}", b"")

    for service in ("rollout", "trainer", "env-gateway", "reward"):
        refused = await nats_errors(infra.nats_for(service), announce)
        assert any("permissions violation for publish" in e for e in refused), service
        refused = await nats_errors(infra.nats_for(service), delete_stream)
        assert any("permissions violation for publish" in e for e in refused), service
    for service in ("rollout", "trainer", "env-gateway", "weight-store"):
        refused = await nats_errors(infra.nats_for(service), join_reward)
        assert any("permissions violation for subscription" in e for e in refused), service
    assert await nats_errors(infra.nats_for("weight-store"), announce) == []
    assert await nats_errors(infra.nats_for("reward"), join_reward) == []

    async def read_others_replies(nc) -> None:  # a shared _INBOX.> once let anyone
        await nc.subscribe("_INBOX.>")
        await nc.subscribe(f"{infra_auth.inbox_prefix('rollout')}.>")

    for service in ("trainer", "env-gateway", "weight-store", "reward"):
        refused = await nats_errors(infra.nats_for(service), read_others_replies)
        assert sum("permissions violation for subscription" in e for e in refused) == 2, service

    async def own_replies(nc) -> None:
        await nc.subscribe(f"{infra_auth.inbox_prefix('rollout')}.x")

    assert await nats_errors(infra.nats_for("rollout"), own_replies) == []

    async def own_heartbeat_only(nc) -> None:
        await nc.publish(f"$KV.{names.HEARTBEAT_BUCKET}.trainer.forged", b"{}")

    refused = await nats_errors(infra.nats_for("rollout"), own_heartbeat_only)
    assert any("permissions violation for publish" in e for e in refused)


def test_the_committed_nats_configs_are_the_rendered_one():
    """compose and k8s run the same users and permissions as `treadle up`."""
    root = Path(__file__).resolve().parents[2]
    rendered = infra_auth.render_nats_conf()
    for path in ("deploy/nats/nats.conf", "k8s/base/nats.conf"):
        assert (root / path).read_text() == rendered, f"{path}: run `make nats-conf`"
