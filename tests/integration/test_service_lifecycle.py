"""The standard lifecycle: readiness names the missing dependency; SIGTERM drains and exits."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import nats
import pytest

from tests.support.services import ServiceProc, free_port, free_ports, wait_ready
from treadle_common import names

pytestmark = pytest.mark.integration


def test_not_ready_without_nats_and_says_why(tmp_path, infra):
    http, dead_port = free_ports(2)
    dead_nats = f"nats://127.0.0.1:{dead_port}"
    env = {
        **os.environ,
        "TREADLE_NATS_URL": dead_nats,
        "TREADLE_HTTP_PORT": str(http),
        "TREADLE_STATE_DIR": str(tmp_path),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle_reward"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        body = None
        for _ in range(100):
            try:
                response = httpx.get(f"http://127.0.0.1:{http}/readyz", timeout=3)
                body = response.json()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert response.status_code == 503
        assert body["ready"] is False and dead_nats in body["checks"]["nats"]
        assert httpx.get(f"http://127.0.0.1:{http}/healthz").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


async def test_heartbeat_and_sigterm_drain(tmp_path, infra):
    http = free_port()
    env = {
        **os.environ,
        "TREADLE_NATS_URL": infra.nats_url,
        "TREADLE_HTTP_PORT": str(http),
        "TREADLE_STATE_DIR": str(tmp_path),
        "TREADLE_INSTANCE": "hb-test",
        "TREADLE_HEARTBEAT_INTERVAL_S": "0.2",
    }
    log = tmp_path / "reward.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle_reward"],
        env=env,
        start_new_session=True,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    wait_ready(ServiceProc("reward", proc, f"http://127.0.0.1:{http}", None, log))
    nc = await nats.connect(infra.nats_url)
    kv = await nc.jetstream().key_value(names.HEARTBEAT_BUCKET)
    beat = json.loads((await kv.get("reward.hb-test")).value)
    assert beat["service"] == "reward" and time.time() - beat["ts"] < 10
    await nc.close()
    # SIGUSR1: every thread's stack into the log (where a stuck service is stuck), serving on
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while "Current thread" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "Current thread" in log.read_text() and 'File "' in log.read_text()
    assert httpx.get(f"http://127.0.0.1:{http}/healthz").status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "draining" in log.read_text() and "stopped" in log.read_text()


def test_port_in_use_names_service_and_port(tmp_path, infra):
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = {
            **os.environ,
            "TREADLE_NATS_URL": infra.nats_url,
            "TREADLE_HTTP_PORT": str(port),
            "TREADLE_STATE_DIR": str(tmp_path),
        }
        result = subprocess.run(
            [sys.executable, "-m", "treadle_reward"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode != 0
    assert f"reward: http port 127.0.0.1:{port} is already in use" in result.stderr
