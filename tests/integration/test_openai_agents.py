"""An OpenAI Agents SDK agent (`openai-agents`, pinned) with one function tool runs against
rollout's OpenAI API, unchanged but for its client's base URL and a session header; the
finished session is a trajectory of exactly the engine's tokens, the tool's turn masked out
of the loss. Once with `Runner.run`, once streamed with `Runner.run_streamed`."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.support.openai_server import serve
from tests.support.tool_model import INSTRUCTIONS, TOOL, answer, weather
from treadle_common import names
from treadle_common.clients import streams
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout import openai_api

pytestmark = pytest.mark.integration


def _agent(client: openai.AsyncOpenAI, tool_calls: list[str]):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        tool_calls.append(city)
        return weather(city)

    from agents.models.chatcmpl_converter import Converter

    # the tool schema the SDK sends is the one the tiny model was trained on
    assert Converter.tool_to_openai(get_weather) == TOOL
    return Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=80),
    )


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_agents_sdk_agent_becomes_a_token_exact_trajectory(
    tool_model, redis_client, streamed
):
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export to OpenAI's servers
    session, run = uuid.uuid4().hex, uuid.uuid4().hex
    async with serve(tool_model, redis=redis_client) as served:
        client = openai.AsyncOpenAI(
            base_url=served.url,
            api_key="unused",
            default_headers={openai_api.SESSION_HEADER: session},
        )
        called: list[str] = []
        agent = _agent(client, called)
        question = "What is the weather in Oslo?"
        if streamed:
            result = Runner.run_streamed(agent, question)
            kinds = [event.type async for event in result.stream_events()]
            assert "raw_response_event" in kinds  # the SDK consumed our SSE stream
        else:
            result = await Runner.run(agent, question)
        assert called == ["Oslo"]
        assert result.final_output == answer("Oslo")

        await redis_client.sadd(names.RUNS_KEY, run)
        done = await client.post(
            f"/sessions/{session}/finish", body={"run_id": run, "reward": 1.0}, cast_to=dict
        )
        await client.close()
        tokenizer = served.engine.tokenizer
        calls = list(served.calls)

    entries = await redis_client.xrange(names.trajectories_stream(run))
    traj = streams.decode(entries[0][1], tpb.Trajectory)
    assert traj.trajectory_id == done["trajectory_id"] and traj.num_turns == 2
    (first_prompt, first_gen), (last_prompt, last_gen) = calls
    # the trajectory is exactly what the engine saw and produced
    assert list(traj.tokens) == last_prompt + last_gen
    assert last_prompt[: len(first_prompt) + len(first_gen)] == first_prompt + first_gen
    mask = list(traj.loss_mask)
    assert [t for t, m in zip(traj.tokens, mask, strict=True) if m] == first_gen + last_gen
    tool_turn = slice(len(first_prompt) + len(first_gen), len(last_prompt))
    assert not any(mask[tool_turn])  # the tool's answer is not trained on
    assert weather("Oslo") in tokenizer.decode(traj.tokens[tool_turn])
    assert "get_weather" in tokenizer.decode(first_gen)
