"""Rollout's OpenAI API as OpenAI clients use it, driven by the official `openai` client over
real HTTP: streaming (SSE) chat and completions, `n`, stop strings, top logprobs, refusals
that name the field, and tool calls parsed from tokens a (tiny, trained) model generated,
through a recorded session that stays token-exact across the tool turn."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest
from prometheus_client import REGISTRY

from tests.support.openai_server import serve
from tests.support.tool_model import TOOL, answer, conversation
from treadle_common import names
from treadle_common.clients import streams
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout import openai_api

pytestmark = pytest.mark.integration
USER = [{"role": "user", "content": "12+7="}]


@pytest.fixture
async def tiny(tiny_model):
    async with serve(tiny_model) as served:
        client = openai.AsyncOpenAI(base_url=served.url, api_key="unused")
        yield client
        await client.close()


@pytest.fixture
async def tool(tool_model, redis_client):
    async with serve(tool_model, redis=redis_client) as served:
        client = openai.AsyncOpenAI(base_url=served.url, api_key="unused")
        yield client, served
        await client.close()


async def _chat_stream(client, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    """Content and finish reason per choice index, and every chunk."""
    content: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = []
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return content, finish, chunks


async def test_streamed_chat_is_the_reply_in_pieces_with_usage_last(tiny):
    args = dict(model="tiny", messages=USER, max_tokens=12, seed=3, n=4)
    whole = await tiny.chat.completions.create(**args)
    content, finish, chunks = await _chat_stream(
        tiny, stream_options={"include_usage": True}, **args
    )
    assert content == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 4  # token by token, not one piece per choice
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    # the first chunk of each choice names the role
    firsts = {}
    for c in chunks[:-1]:
        firsts.setdefault(c.choices[0].index, c.choices[0].delta.role)
    assert firsts == {i: "assistant" for i in range(4)}


async def test_streamed_completions_with_n_and_logprobs(tiny):
    args = dict(model="tiny", prompt="1+2=", max_tokens=8, seed=5, n=4, logprobs=2)
    # token ids, not text: two tokens that are parts of one character would share a key
    args["extra_body"] = {"return_tokens_as_token_ids": True}
    whole = await tiny.completions.create(**args)
    text: dict[int, str] = {}
    tokens: dict[int, list] = {}
    async for chunk in await tiny.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + choice.text
            if choice.logprobs:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
                assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert text == {c.index: c.text for c in whole.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in whole.choices}
    for choice in whole.choices:
        for lp, top in zip(
            choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True
        ):
            assert len(top) == 2 and max(top.values()) >= lp


async def test_stop_strings_cut_the_text_streamed_or_not(tiny):
    args = dict(model="tiny", messages=USER, max_tokens=16, seed=11, temperature=1.0)
    free = (await tiny.chat.completions.create(**args)).choices[0].message.content
    assert len(free) >= 4, free
    stop = free[2:4]
    cut = free[: free.find(stop)]
    stopped = await tiny.chat.completions.create(stop=[stop], **args)
    assert stopped.choices[0].message.content == cut
    assert stopped.choices[0].finish_reason == "stop"
    content, finish, _ = await _chat_stream(tiny, stop=stop, **args)
    assert content == {0: cut} and finish == {0: "stop"}
    text = await tiny.completions.create(model="tiny", prompt="3+4=", max_tokens=16, seed=2)
    if len(text.choices[0].text) >= 3:
        stop = text.choices[0].text[1:3]
        again = await tiny.completions.create(
            model="tiny", prompt="3+4=", max_tokens=16, seed=2, stop=stop
        )
        assert again.choices[0].text == text.choices[0].text[: text.choices[0].text.find(stop)]


async def test_top_logprobs_rank_the_alternatives(tiny):
    reply = await tiny.chat.completions.create(
        model="tiny", messages=USER, max_tokens=6, logprobs=True, top_logprobs=3, seed=1
    )
    entries = reply.choices[0].logprobs.content
    assert entries
    for entry in entries:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.logprob <= values[0] + 1e-6
        shown = [t.token for t in entry.top_logprobs]
        if "\ufffd" not in entry.token and entry.token in shown:  # (not part of a character)
            same = next(t for t in entry.top_logprobs if t.token == entry.token)
            assert same.logprob == pytest.approx(entry.logprob, abs=1e-5)


async def test_unsupported_fields_are_refused_by_name(tiny):
    with pytest.raises(openai.NotFoundError) as missing:
        await tiny.chat.completions.create(model="gpt-9", messages=USER)
    assert missing.value.code == "model_not_found"
    refusals = {
        "presence_penalty": dict(presence_penalty=0.5),
        "frequency_penalty": dict(frequency_penalty=-1.0),
        "logit_bias": dict(logit_bias={"5": 10}),
        "response_format": dict(response_format={"type": "json_schema", "json_schema": {}}),
        "tool_choice": dict(tool_choice="required"),  # without tools
        "top_logprobs": dict(top_logprobs=2),  # without logprobs
        "reasoning_effort": dict(reasoning_effort="high"),
        "brand_new_option": dict(extra_body={"brand_new_option": 1}),
    }
    for field, kwargs in refusals.items():
        with pytest.raises(openai.BadRequestError) as bad:
            await tiny.chat.completions.create(model="tiny", messages=USER, **kwargs)
        assert bad.value.param == field, (field, bad.value.message)
        assert field in bad.value.message
    with pytest.raises(openai.BadRequestError) as image:
        await tiny.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        )
    assert "messages.0.content" in (image.value.param or "")
    with pytest.raises(openai.BadRequestError) as echo:
        await tiny.completions.create(model="tiny", prompt="1", echo=True)
    assert echo.value.param == "echo"
    # neutral values are accepted: they change nothing
    ok = await tiny.chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, presence_penalty=0, user="u1", store=False
    )
    assert ok.choices[0].message.role == "assistant"


async def _tool_stream(client, **kwargs) -> tuple[str, list[dict], str]:
    """Content, tool calls (accumulated from their deltas) and finish reason of choice 0."""
    content, calls, finish = "", {}, ""
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += call.id or ""
                slot["name"] += (call.function.name or "") if call.function else ""
                slot["arguments"] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


async def test_a_model_that_calls_a_tool_gets_tool_calls_back(tool):
    client, _ = tool
    messages = conversation("Paris")[:2]
    args = dict(model="tiny", messages=messages, tools=[TOOL], temperature=0, max_tokens=80)
    reply = await client.chat.completions.create(**args)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    content, calls, finish = await _tool_stream(client, **args)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]

    # the tool's answer goes back; the model answers in words
    follow = [
        *messages,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny in Paris"},
    ]
    final = await client.chat.completions.create(**{**args, "messages": follow})
    assert final.choices[0].message.content == answer("Paris")
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls

    # tool_choice none: the tools are shown, no call is parsed
    plain = await client.chat.completions.create(tool_choice="none", **args)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content.startswith("<tool_call>")
    # a named function: the turn begins with its call, which the model completes
    for choice_arg in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = await client.chat.completions.create(tool_choice=choice_arg, **args)
        assert forced.choices[0].finish_reason == "tool_calls"
        assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError) as unknown:
        await client.chat.completions.create(
            tool_choice={"type": "function", "function": {"name": "nope"}}, **args
        )
    assert unknown.value.param == "tool_choice"


async def test_a_recorded_tool_session_is_token_exact(tool, redis_client):
    """Two turns around a tool call, streamed, in a recorded session: the trajectory is the
    engine's last prompt plus its last generation; generated tokens are trained, the tool's
    answer is not."""
    client, served = tool
    session, run = uuid.uuid4().hex, uuid.uuid4().hex
    headers = {openai_api.SESSION_HEADER: session}
    messages = conversation("Rome")[:2]
    args = dict(model="tiny", tools=[TOOL], temperature=0, max_tokens=80, extra_headers=headers)
    served.calls.clear()
    content, calls, finish = await _tool_stream(client, messages=messages, **args)
    assert finish == "tool_calls"
    # the client sends the call back as OpenAI objects (re-serialized arguments)
    arguments = json.dumps(json.loads(calls[0]["arguments"]), indent=2)
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0]["id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny in Rome"},
    ]
    final = await client.chat.completions.create(messages=messages, **args)
    assert final.choices[0].message.content == answer("Rome")
    # a changed tool call is not the turn the session recorded
    tampered = json.loads(json.dumps(messages))
    tampered[2]["tool_calls"][0]["function"]["arguments"] = '{"city": "Oslo"}'
    with pytest.raises(openai.BadRequestError) as diverged:
        await client.chat.completions.create(messages=tampered, **args)
    assert diverged.value.code == "session_diverged"

    await redis_client.sadd(names.RUNS_KEY, run)
    done = await client.post(
        f"/sessions/{session}/finish", body={"run_id": run, "reward": 1.0}, cast_to=dict
    )
    traj = streams.decode(
        (await redis_client.xrange(names.trajectories_stream(run)))[0][1], tpb.Trajectory
    )
    assert traj.trajectory_id == done["trajectory_id"] and traj.num_turns == 2
    (first_prompt, first_gen), (last_prompt, last_gen) = served.calls
    assert list(traj.tokens) == last_prompt + last_gen
    assert last_prompt[: len(first_prompt) + len(first_gen)] == first_prompt + first_gen
    mask = list(traj.loss_mask)
    generated = [t for t, m in zip(traj.tokens, mask, strict=True) if m]
    assert generated == first_gen + last_gen
    between = traj.tokens[len(first_prompt) + len(first_gen) : len(last_prompt)]
    assert not any(mask[len(first_prompt) + len(first_gen) : len(last_prompt)])
    tok = served.engine.tokenizer
    assert "<tool_response>\nsunny in Rome\n</tool_response>" in tok.decode(between)
    assert '"city": "Rome"' in tok.decode(first_gen)


async def test_a_client_that_closes_its_stream_cancels_the_generation(tiny_model):
    """Over real HTTP: the connection closes mid-stream, and the engine drops the request
    (the SSE response notices the disconnect and cancels the events it was sending)."""
    async with serve(tiny_model) as served:
        client = openai.AsyncOpenAI(base_url=served.url, api_key="unused")
        args = dict(model="tiny", messages=USER, max_tokens=1000, temperature=1.0)
        runs = [await client.chat.completions.create(seed=s, **args) for s in range(12)]
        await client.close()
        length, seed = max((r.usage.completion_tokens, s) for s, r in enumerate(runs))
        assert length >= 300
        finished = len(served.calls)
        before = REGISTRY.get_sample_value("treadle_rollout_tokens_total") or 0.0
        async with httpx.AsyncClient(base_url=served.url) as http:
            body = {**args, "seed": seed, "stream": True}
            async with http.stream("POST", "/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        break  # the first content: the generation is running
                assert served.engine.running == 1
        for _ in range(250):  # the connection is closed
            if served.engine.running == 0:
                break
            await asyncio.sleep(0.02)
        assert served.engine.running == 0
        await asyncio.sleep(1.0)
        assert len(served.calls) == finished  # the stream never finished
        generated = (REGISTRY.get_sample_value("treadle_rollout_tokens_total") or 0.0) - before
        assert generated < length / 2
