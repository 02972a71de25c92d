"""Structured outputs on the hf engine (`tests/support/structured_checks.py` says what each
check asserts; `tests/vllm/test_vllm_structured.py` runs the same on the vllm engine)."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.support import structured_checks as checks
from tests.support.openai_server import serve
from treadle_common import names
from treadle_common.clients import streams
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout import openai_api

pytestmark = pytest.mark.integration


@pytest.fixture
async def tiny(tiny_model):
    async with serve(tiny_model) as served:
        client = openai.AsyncOpenAI(base_url=served.url, api_key="unused", max_retries=0)
        yield client
        await client.close()


async def test_required_calls_always_parse_and_validate(tiny):
    await checks.required_calls_parse_and_validate(tiny)


async def test_a_named_function_is_the_call_every_time(tiny):
    await checks.named_calls_are_that_function(tiny)


async def test_json_schema_responses_validate_and_json_object_is_an_object(tiny):
    await checks.json_responses_validate(tiny)


async def test_streamed_calls_and_json_are_whole(tiny):
    await checks.streamed_outputs_are_whole(tiny)


async def test_bad_schemas_are_refused_and_the_server_stays_up(tiny):
    await checks.bad_schemas_are_refused(tiny)


async def test_a_recorded_session_marks_the_constrained_tokens(tiny_model, redis_client):
    """A session's constrained turn (a required call) and free turn (plain text): the
    trajectory's `constrained_mask` is 1 on exactly the constrained turn's generated tokens."""
    session, run = uuid.uuid4().hex, uuid.uuid4().hex
    headers = {openai_api.SESSION_HEADER: session}
    async with serve(tiny_model, redis=redis_client) as served:
        client = openai.AsyncOpenAI(base_url=served.url, api_key="unused", max_retries=0)
        args = dict(model="tiny", tools=checks.TOOLS, seed=3, extra_headers=headers)
        forced = await client.chat.completions.create(
            messages=checks.ASK, tool_choice="required", max_tokens=120, **args
        )
        [call] = forced.choices[0].message.tool_calls
        follow = [
            *checks.ASK,
            forced.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        await client.chat.completions.create(
            messages=follow, tool_choice="none", max_tokens=10, **args
        )
        await redis_client.sadd(names.RUNS_KEY, run)
        await client.post(
            f"/sessions/{session}/finish", body={"run_id": run, "reward": 1.0}, cast_to=dict
        )
        await client.close()
        (first_prompt, first_gen), (last_prompt, last_gen) = served.calls
    entry = (await redis_client.xrange(names.trajectories_stream(run)))[0][1]
    traj = streams.decode(entry, tpb.Trajectory)
    assert list(traj.tokens) == last_prompt + last_gen
    expected = [0] * len(traj.tokens)
    expected[len(first_prompt) : len(first_prompt) + len(first_gen)] = [1] * len(first_gen)
    assert list(traj.constrained_mask) == expected
    assert sum(traj.loss_mask) == len(first_gen) + len(last_gen)  # both are trained on
