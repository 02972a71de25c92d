"""Structured outputs on the vllm engine (vLLM's own, its `guidance` backend), the same checks
as the hf engine's (`tests/support/structured_checks.py`), through rollout's OpenAI routes."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import openai  # noqa: E402

from tests.support import structured_checks as checks  # noqa: E402
from tests.support.openai_server import serve  # noqa: E402
from treadle_cli.tiny_model import init_tiny  # noqa: E402
from treadle_rollout.engines.vllm import VLLMEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


async def test_vllm_enforces_calls_and_schemas(tmp_path):
    model_dir = init_tiny(tmp_path / "tiny")
    engine = VLLMEngine(model_dir, "tiny", max_context=1536, dtype="float32")
    await engine.start()
    async with serve(model_dir, engine=engine) as served:
        client = openai.AsyncOpenAI(base_url=served.url, api_key="unused", max_retries=0)
        await checks.required_calls_parse_and_validate(client)
        await checks.named_calls_are_that_function(client)
        await checks.json_responses_validate(client)
        await checks.streamed_outputs_are_whole(client)
        await checks.bad_schemas_are_refused(client)
        await client.close()
