"""Embedded infrastructure: real redis-server / nats-server processes on free ports."""

import socket

import pytest
import redis

from tests.conftest import free_ports
from treadle_cli.infra import Infra, InfraError, alive
from treadle_common.settings import Settings

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
        assert redis.Redis.from_url(infra.url("redis")).ping()
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
def test_s3_server_answers_s3(tmp_path):
    import httpx

    from tests.conftest import free_port_range

    base = free_port_range(6, also_offset=10000)
    settings = Settings(
        state_dir=tmp_path,
        redis_url="redis://127.0.0.1:1",
        nats_url="nats://127.0.0.1:1",
        s3_endpoint=f"127.0.0.1:{base}",
    )
    infra = Infra(settings)
    try:
        (state,) = infra.up(("s3",), timeout_s=60)
        assert state.healthy and state.detail == "started"
        listing = httpx.get(f"http://127.0.0.1:{base}/", timeout=10)
        assert listing.status_code == 200 and "ListAllMyBucketsResult" in listing.text
    finally:
        assert infra.down() == ["s3"]
