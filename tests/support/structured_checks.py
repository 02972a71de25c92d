"""Structured-output checks run against a served engine (hf in `tests/integration`, vllm in
`tests/vllm`) through the official `openai` client: a required tool call, a named one and a
`json_schema` response format each parse and validate against their schema in 50 of 50
requests from the tiny random model (which writes neither unaided), sampled at temperature
1; streamed too; schemas llguidance cannot compile are refused by name."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

REQUESTS = 50
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": -999, "maximum": 999},
        "sure": {"type": "boolean"},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["answer", "sure", "steps"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days, then the time?"}]


def valid_call(call, names: set[str]) -> str:
    assert call.type == "function" and call.function.name in names
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    return call.function.name


async def many(client, **kwargs) -> list:
    """`REQUESTS` completions, 10 at a time, each its own seed."""
    replies = []
    for start in range(0, REQUESTS, 10):
        batch = [
            client.chat.completions.create(
                model="tiny", messages=ASK, temperature=1.0, max_tokens=120, seed=i, **kwargs
            )
            for i in range(start, start + 10)
        ]
        replies += await asyncio.gather(*batch)
    return replies


async def required_calls_parse_and_validate(tiny) -> None:
    replies = await many(tiny, tools=TOOLS, tool_choice="required")
    called = set()
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        [call] = choice.message.tool_calls
        called.add(valid_call(call, {"get_weather", "get_time"}))
    assert called == {"get_weather", "get_time"}  # the model chose; the grammar let it


async def named_calls_are_that_function(tiny) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    replies = await many(tiny, tools=TOOLS, tool_choice=named)
    for reply in replies:
        assert reply.choices[0].finish_reason == "tool_calls"
        [call] = reply.choices[0].message.tool_calls
        assert valid_call(call, {"get_time"}) == "get_time"


async def json_responses_validate(tiny) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for reply in await many(tiny, response_format=fmt):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
    reply = await tiny.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=60, seed=1, response_format={"type": "json_object"}
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


async def streamed_outputs_are_whole(tiny) -> None:
    stream = await tiny.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        seed=7,
        stream=True,
    )
    arguments, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and isinstance(json.loads(arguments), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    stream = await tiny.chat.completions.create(
        model="tiny", messages=ASK, response_format=fmt, max_tokens=120, seed=7, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), ANSWER)


async def bad_schemas_are_refused(tiny) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await tiny.chat.completions.create(
            model="tiny", messages=ASK, response_format={"type": "json_schema", "json_schema": {}}
        )
    assert bad.value.param == "response_format"
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    with pytest.raises(openai.BadRequestError) as bad:
        await tiny.chat.completions.create(model="tiny", messages=ASK, response_format=fmt)
    assert bad.value.param == "response_format" and "type must be" in bad.value.message
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}]
    with pytest.raises(openai.BadRequestError) as bad:
        await tiny.chat.completions.create(
            model="tiny", messages=ASK, tools=broken, tool_choice="required"
        )
    assert bad.value.param == "tools"
    ok = await tiny.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"  # the server is still up
