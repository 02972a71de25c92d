"""Every service's OpenAPI, fuzzed by schemathesis (from PyPI) with a valid admin token: no
request it generates, valid or not, gets a 5xx, and every answer matches the schema.

Each service runs as its own process over real Redis and NATS; the trainer and rollout load
the tiny model. Schemathesis runs as its CLI (`st run`), one service at a time, with its
examples, coverage and fuzzing phases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.services import TOKENS, start_service

pytestmark = pytest.mark.integration
CHECKS = "not_a_server_error,response_schema_conformance"
MAX_EXAMPLES = "12"
OPENAPI_DIR = Path(__file__).resolve().parents[2] / "docs/reference/openapi"
AUTH = {"Authorization": f"Bearer {TOKENS['admin']}"}


@pytest.fixture(scope="module")
def stack(infra, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    started = {}
    try:
        started["weight-store"] = start_service(
            "weight-store", infra, tmp, TREADLE_WEIGHT_STORE_DIR=str(tmp / "ws")
        )
        started["env-gateway"] = start_service("env-gateway", infra, tmp)
        started["reward"] = start_service("reward", infra, tmp, TREADLE_REWARD_TIMEOUT_S="5")
        peers = {
            "TREADLE_WEIGHT_STORE_ADDR": started["weight-store"].grpc_addr or "",
            "TREADLE_ENV_GATEWAY_ADDR": started["env-gateway"].grpc_addr or "",
            "TREADLE_TRAINER_PATH_ROOTS": json.dumps([str(tmp / "allowed")]),
        }
        started["trainer"] = start_service("trainer", infra, tmp, **peers)
        started["rollout"] = start_service(
            "rollout", infra, tmp, TREADLE_ROLLOUT_MODEL=str(tiny_model), **peers
        )
        yield tmp, started
    finally:
        for proc in reversed(started.values()):
            proc.stop_checked()


@pytest.mark.parametrize("service", ["weight-store", "env-gateway", "reward", "trainer", "rollout"])
def test_fuzzed_requests_get_no_5xx_and_conform_to_the_schema(stack, service):
    tmp, started = stack
    svc = started[service]
    report = tmp / f"st-{service}"
    st = Path(sys.executable).with_name("st")
    command = [
        str(st),
        "run",
        f"{svc.http}/openapi.json",
        "-H",
        f"Authorization: Bearer {TOKENS['admin']}",
        "--checks",
        CHECKS,
        "--max-examples",
        MAX_EXAMPLES,
        "--phases",
        "examples,coverage,fuzzing",
        "--workers",
        "1",
        "--request-timeout",
        "60",
        "--seed",
        "1",
        "--suppress-health-check",
        "all",
        "--no-color",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp)
    output = done.stdout + done.stderr
    (report.with_suffix(".txt")).write_text(output)
    assert done.returncode == 0, output[-8000:] + "\n" + svc.log.read_text()[-4000:]
    assert "passed" in output or "No issues found" in output, output[-4000:]
    assert svc.proc.poll() is None, "the service died under fuzzing"


def test_the_docs_openapi_snapshots_match_the_running_services(stack):
    """`docs/reference/openapi/<service>.json` (which `scripts/gen_docs.py` renders into the
    docs' HTTP reference) is what each running service serves; `TREADLE_WRITE_OPENAPI=1`
    rewrites the snapshots. Every route names typed JSON models: no bare `object` body."""
    _, started = stack
    stale = []
    for service, svc in started.items():
        live = httpx.get(f"{svc.http}/openapi.json", headers=AUTH, timeout=30).json()
        snapshot = OPENAPI_DIR / f"{service}.json"
        text = json.dumps(live, indent=1, sort_keys=True) + "\n"
        if os.environ.get("TREADLE_WRITE_OPENAPI") == "1":
            snapshot.write_text(text)
        elif not snapshot.exists() or snapshot.read_text() != text:
            stale.append(service)
    assert not stale, f"stale OpenAPI snapshots {stale}: run with TREADLE_WRITE_OPENAPI=1"
