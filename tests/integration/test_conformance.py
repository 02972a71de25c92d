"""Both conformance suites through the real CLI (`treadle conformance openai|tinker URL
--json`) against Treadle's own APIs: the rollout's OpenAI API serving the tiny model and the
trainer's Tinker API training LoRA adapters on it. Every check must pass (none skipped:
this stack has keys, tools, logprobs and every loss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.services import TOKENS
from tests.support.tinker_stack import tinker_stack
from treadle_conformance import openai_checks, tinker_checks

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]


def conformance(*args: str) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "treadle_cli.cli", "conformance", *args, "--json"]
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    return done.returncode, json.loads(lines[-1])


def failures(report: dict) -> list[dict]:
    return [c for c in report["checks"] if c["status"] != "passed"]


def test_treadle_passes_both_suites(infra, tmp_path, tiny_model):
    with tinker_stack(infra, tmp_path, tiny_model, max_clients=8) as (trainer, _, rollout):
        openai_rc, openai = conformance(
            "openai", f"{rollout.http}/v1", "--model", "tiny", "--api-key", TOKENS["agent"]
        )
        tinker_rc, tinker = conformance(
            "tinker", trainer.http, "--api-key", "tml-" + TOKENS["trainer"]
        )
    assert not failures(openai), failures(openai)
    assert [c["id"] for c in openai["checks"]] == [c.id for c in openai_checks.suite.checks]
    assert not failures(tinker), failures(tinker)
    assert [c["id"] for c in tinker["checks"]] == [c.id for c in tinker_checks.suite.checks]
    assert openai_rc == tinker_rc == 0
