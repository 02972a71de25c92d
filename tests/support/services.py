"""Services and infrastructure for tests: private redis-server / nats-server / S3 on free ports,
services as real processes, the session's tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from treadle_cli.infra import Infra, free_port_range
from treadle_common import names
from treadle_common.auth import infra as infra_auth
from treadle_common.auth import policy as auth
from treadle_common.config.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


TOKENS: dict[str, str] = auth.TokenTable.generate()
"""The session's token table (a token per role): every service a test starts checks callers
against it, and the test process presents the admin token (`TREADLE_TOKEN`), as a user of
`treadle up` does. `ADMIN` is the header for raw HTTP calls."""


ADMIN = auth.bearer(TOKENS["admin"])


def api_get(url: str, **kwargs) -> httpx.Response:
    """`httpx.get` presenting the admin token."""
    return httpx.get(url, headers=ADMIN, **kwargs)


def api_post(url: str, **kwargs) -> httpx.Response:
    """`httpx.post` presenting the admin token."""
    return httpx.post(url, headers=ADMIN, **kwargs)


TRACEBACK = "Traceback (most recent call last)"


def free_port() -> int:
    return free_ports(1)[0]


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """An ASGI app served by uvicorn on a free port, in a thread: its base URL."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


def free_ports(n: int) -> list[int]:
    """`n` consecutive free ports below the kernel's ephemeral range (`free_port_range`): no
    outgoing connection can take one between this check and the server binding it, which
    binding port 0 and releasing it (an ephemeral port) could not promise."""
    base = free_port_range(n)
    return list(range(base, base + n))


@dataclass
class InfraUrls:
    """The private servers' URLs with the admin's credentials (what the test process uses),
    and each service's NATS URL (its own user and permissions, as deployed)."""

    redis_url: str
    nats_url: str
    state_dir: Path
    nats_urls: dict[str, str] = field(default_factory=dict)
    redis_urls: dict[str, str] = field(default_factory=dict)

    def nats_for(self, service: str) -> str:
        return self.nats_urls.get(service, self.nats_url)

    def redis_for(self, service: str) -> str | None:
        """A service's own Redis URL (its ACL user); None for one that does not use Redis."""
        if not self.redis_urls:
            return self.redis_url
        return self.redis_urls.get(service)


@contextlib.contextmanager
def private_infra(state: Path) -> Iterator[tuple[Infra, InfraUrls]]:
    """A redis-server (AOF, a password) and a nats-server (JetStream on disk, a user per
    service) of our own, on free ports, with their data under `state`; stopped on exit."""
    redis_port, nats_port = free_ports(2)
    settings = Settings(
        state_dir=state,
        redis_url=f"redis://127.0.0.1:{redis_port}",
        nats_url=f"nats://127.0.0.1:{nats_port}",
    )
    manager = Infra(settings)
    manager.up()
    try:
        urls = InfraUrls(
            manager.url_for("redis"),
            manager.url_for("nats"),
            state,
            {service: manager.url_for("nats", service) for service in names.SERVICES},
            {user: manager.url_for("redis", user) for user in infra_auth.REDIS_SERVICES},
        )
        yield manager, urls
        log = redis.Redis.from_url(urls.redis_url).acl_log()  # a refusal a service swallowed
        denied = [e for e in log if e["username"] in infra_auth.REDIS_SERVICES]
        assert denied == [], f"Redis's ACL refused a service: {denied}"
    finally:
        manager.down()


@dataclass
class ServiceProc:
    name: str
    proc: subprocess.Popen
    http: str
    grpc_addr: str | None
    log: Path

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (the service drains and exits), SIGKILL after `timeout_s`; its real exit
        status (Popen reaps it: 0 is a clean drain, -9 a kill)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def tracebacks(self) -> int:
        """Python tracebacks in the service's log (an exception nobody handled or expected)."""
        return self.log.read_text(errors="replace").count(TRACEBACK)

    def stop_checked(self, allow_tracebacks: bool = False) -> None:
        """Stop it and fail the test if it crashed while draining (a non-zero exit of a
        service still running at teardown) or logged a traceback."""
        running = self.proc.poll() is None
        code = self.stop()
        problems = []
        if running and code != 0:
            problems.append(f"exited {code} on SIGTERM")
        if not allow_tracebacks and (n := self.tracebacks()):
            problems.append(f"logged {n} traceback(s)")
        if problems:
            tail = self.log.read_text(errors="replace")[-4000:]
            pytest.fail(f"{self.name}: {'; '.join(problems)}; log {self.log}:\n{tail}")


def start_service(name: str, infra: InfraUrls, tmp: Path, **env: str) -> ServiceProc:
    """Run `python -m treadle_<name>` with TREADLE_* env on free ports; wait for /readyz."""
    http, grpc_port = free_ports(2)
    http = int(env.get("TREADLE_HTTP_PORT", http))  # a restart on the same ports
    grpc_port = int(env.get("TREADLE_GRPC_PORT", grpc_port))
    redis_url = infra.redis_for(name)  # its own ACL user, or no Redis at all
    full_env = {
        **{k: v for k, v in os.environ.items() if k != "TREADLE_REDIS_URL"},
        **({"TREADLE_REDIS_URL": redis_url} if redis_url else {}),
        "TREADLE_NATS_URL": infra.nats_for(name),
        "TREADLE_STATE_DIR": str(tmp),
        "TREADLE_HTTP_PORT": str(http),
        "TREADLE_GRPC_PORT": str(grpc_port),
        "TREADLE_HEARTBEAT_INTERVAL_S": "0.5",
        # the tests' models, data and outputs live in pytest's temporary directories
        "TREADLE_TRAINER_PATH_ROOTS": json.dumps([tempfile.gettempdir()]),
        "TREADLE_TOKEN": TOKENS[auth.SERVICE_ROLES.get(name, auth.Role.read)],
        **env,
    }
    log = tmp / f"{name}.log"
    module = "treadle_" + name.replace("-", "_")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    scheme = "https" if full_env.get("TREADLE_TLS_CERT_FILE") else "http"
    svc = ServiceProc(name, proc, f"{scheme}://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}", log)
    ca = full_env.get("TREADLE_TLS_CA_FILE")
    wait_ready(svc, verify=ssl.create_default_context(cafile=ca) if ca else True)
    return svc


def wait_ready(
    svc: ServiceProc, timeout_s: float = 90.0, verify: ssl.SSLContext | bool = True
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            raise RuntimeError(
                f"{svc.name} exited {svc.proc.returncode}:\n{svc.log.read_text()[-3000:]}"
            )
        try:
            if httpx.get(f"{svc.http}/readyz", timeout=1, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    svc.stop()
    raise RuntimeError(f"{svc.name} not ready in {timeout_s}s:\n{svc.log.read_text()[-3000:]}")


@dataclass
class S3Server:
    endpoint: str
    access_key: str = "treadle-local-secret"
    secret_key: str = "treadle-local-secret"
