"""The OpenAI suite: behaviours of `/v1/models`, `/v1/chat/completions` and `/v1/completions`
that the official clients and agent frameworks rely on, checked over plain HTTP (so the
wire is seen as it is: the SSE framing, the error bodies) against any server.

Every check asks for a few tokens of a short prompt, so it runs against a tiny random model
as well as a real one: nothing checks what a reply says, only its shape and how the fields
that shape it (`max_tokens`, `stop`, `n`, `logprobs`, tools, response formats) act on it.
The structured-output checks ask `repeats` times, at temperature 1 with a seed each, since
a grammar that holds once may not hold every time.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from treadle_conformance.openai_server import (
    ANSWER,
    ASK,
    SCHEMAS,
    STRUCTURED_MAX_TOKENS,
    TOOLS,
    OpenAIServer,
    check_usage,
    openai_error,
    reply_text,
    streamed_text,
    valid_call,
)
from treadle_conformance.report import Skip, Suite, expect

suite: Suite[OpenAIServer] = Suite("openai")


# --- models, plain completions ----------------------------------------------------------------
@suite.check("models.list", "`GET /models` is a `list` of `model` objects that names the model")
def models_list(s: OpenAIServer) -> None:
    response = s.http.get("/models")
    expect(response.status_code == 200, f"HTTP {response.status_code}")
    body = response.json()
    expect(body.get("object") == "list", f"object {body.get('object')!r}")
    ids = [m.get("id") for m in body.get("data", [])]
    expect(s.model in ids, f"{s.model!r} is not in {ids}")
    expect(all(m.get("object") == "model" for m in body["data"]), "an entry is not a model")


@suite.check(
    "chat.shape",
    "A chat completion has an id, object `chat.completion`, `created`, the model, and per "
    "choice an index, an assistant message and a finish reason",
)
def chat_shape(s: OpenAIServer) -> None:
    body = s.chat()
    expect(isinstance(body.get("id"), str) and body["id"], "no id")
    expect(body.get("object") == "chat.completion", f"object {body.get('object')!r}")
    expect(isinstance(body.get("created"), int), "created is not an int")
    expect(body.get("model") == s.model, f"model {body.get('model')!r}")
    [choice] = body["choices"]
    expect(choice["index"] == 0, f"index {choice['index']}")
    expect(choice["message"]["role"] == "assistant", f"role {choice['message']['role']!r}")
    expect(isinstance(choice["message"].get("content"), str), "content is not text")
    expect(choice["finish_reason"] in ("stop", "length"), f"finish {choice['finish_reason']!r}")


@suite.check("chat.usage", "`usage` counts prompt and completion tokens; total is their sum")
def chat_usage(s: OpenAIServer) -> None:
    check_usage(s.chat().get("usage"), max_completion=8)


@suite.check(
    "chat.max_tokens",
    "`max_tokens` and `max_completion_tokens` cap the completion; a reply they cut ends "
    "with finish reason `length` at exactly that many tokens",
)
def chat_max_tokens(s: OpenAIServer) -> None:
    for field, cap in (("max_tokens", 3), ("max_completion_tokens", 2)):
        body = s.chat(temperature=0, **{"max_tokens": None, field: cap})
        used = body["usage"]["completion_tokens"]
        expect(used <= cap, f"{field}={cap}: {used} completion tokens")
        if body["choices"][0]["finish_reason"] == "length":
            expect(used == cap, f"{field}={cap}: cut at {used} tokens")


@suite.check(
    "chat.n",
    "`n` returns that many choices, indexed 0 to n-1, and usage counts the tokens of all",
)
def chat_n(s: OpenAIServer) -> None:
    body = s.chat(n=3, temperature=1.0, seed=1, max_tokens=4)
    expect([c["index"] for c in body["choices"]] == [0, 1, 2], "indexes are not 0, 1, 2")
    check_usage(body["usage"], max_completion=12)


@suite.check("chat.seed", "The same `seed` at temperature 1 gives the same reply")
def chat_seed(s: OpenAIServer) -> None:
    first, second = (reply_text(s.chat(temperature=1.0, seed=7, max_tokens=12)) for _ in "ab")
    expect(first == second, f"{first!r} != {second!r}")


@suite.check(
    "completions.shape",
    "`POST /completions` returns `text_completion` choices with text, a finish reason and usage",
)
def completions_shape(s: OpenAIServer) -> None:
    body = {"model": s.model, "prompt": "The sea is", "max_tokens": 5, "temperature": 0}
    response = s.post("/completions", body)
    expect(response.status_code == 200, f"HTTP {response.status_code}: {response.text[:300]}")
    out = response.json()
    expect(out.get("object") == "text_completion", f"object {out.get('object')!r}")
    [choice] = out["choices"]
    expect(isinstance(choice.get("text"), str), "text is not a string")
    expect(choice["finish_reason"] in ("stop", "length"), f"finish {choice['finish_reason']!r}")
    check_usage(out.get("usage"), max_completion=5)


# --- streaming --------------------------------------------------------------------------------
@suite.check(
    "stream.chunks",
    "A stream is `chat.completion.chunk` events sharing one id, the role in the first delta, "
    "exactly one finish reason, and `data: [DONE]` last",
)
def stream_chunks(s: OpenAIServer) -> None:
    chunks, done = s.stream()
    expect(done, "the stream did not end with data: [DONE]")
    expect(chunks, "no chunks")
    expect({c.get("object") for c in chunks} == {"chat.completion.chunk"}, "a chunk's object")
    expect(len({c.get("id") for c in chunks}) == 1, "chunks carry different ids")
    first = chunks[0]["choices"][0]["delta"]
    expect(first.get("role") == "assistant", f"first delta {first}")
    finishes = [c.get("finish_reason") for ch in chunks for c in ch["choices"]]
    finishes = [f for f in finishes if f]
    expect(len(finishes) == 1, f"finish reasons {finishes}")


@suite.check("stream.same_text", "At temperature 0 the streamed text is the non-streamed reply")
def stream_same_text(s: OpenAIServer) -> None:
    whole = reply_text(s.chat(temperature=0, max_tokens=12))
    chunks, _ = s.stream(temperature=0, max_tokens=12)
    expect(streamed_text(chunks) == whole, f"{streamed_text(chunks)!r} != {whole!r}")


@suite.check(
    "stream.usage",
    "`stream_options: {include_usage: true}` adds a last chunk with no choices and the usage "
    "(`null` in the others); without it no chunk carries usage",
)
def stream_usage(s: OpenAIServer) -> None:
    chunks, _ = s.stream(stream_options={"include_usage": True})
    last = chunks[-1]
    expect(last["choices"] == [], f"the usage chunk has choices: {last['choices']}")
    check_usage(last.get("usage"), max_completion=8)
    expect(all(c.get("usage") is None for c in chunks[:-1]), "usage before the last chunk")
    chunks, _ = s.stream()
    expect(all(c.get("usage") is None for c in chunks), "usage without include_usage")


# --- logprobs, stop -----------------------------------------------------------------------------
@suite.check(
    "logprobs.content",
    "`logprobs: true` gives one entry per completion token, with the token and a logprob <= 0",
)
def logprobs_content(s: OpenAIServer) -> None:
    body = s.chat(logprobs=True, max_tokens=6)
    entries: Any = (body["choices"][0].get("logprobs") or {}).get("content")
    expect(isinstance(entries, list), "no logprobs.content")
    used = body["usage"]["completion_tokens"]
    # a last token the server hides (an end-of-turn token) may have no entry
    expect(used - 1 <= len(entries) <= used, f"{len(entries)} entries for {used} tokens")
    for entry in entries:
        expect(isinstance(entry.get("token"), str), f"token {entry.get('token')!r}")
        expect(entry["logprob"] <= 0, f"logprob {entry['logprob']}")


@suite.check(
    "logprobs.top",
    "`top_logprobs: k` ranks k alternatives per token, most likely first; at temperature 0 "
    "the chosen token is the first",
)
def logprobs_top(s: OpenAIServer) -> None:
    body = s.chat(logprobs=True, top_logprobs=3, temperature=0, max_tokens=6)
    for entry in body["choices"][0]["logprobs"]["content"]:
        top = entry["top_logprobs"]
        expect(len(top) == 3, f"{len(top)} alternatives, not 3")
        ranked = [t["logprob"] for t in top]
        expect(ranked == sorted(ranked, reverse=True), f"not ranked: {ranked}")
        expect(abs(entry["logprob"] - ranked[0]) < 1e-3, f"chose {entry} over {top[0]}")


@suite.check(
    "stop.cut",
    "A stop string ends the reply before its first occurrence (the string not included) with "
    "finish reason `stop`, streamed and not",
)
def stop_cut(s: OpenAIServer) -> None:
    whole = reply_text(s.chat(temperature=0, max_tokens=16))
    if len(whole) < 2:
        raise Skip(f"the greedy reply {whole!r} is too short to pick a stop string from")
    # two characters from its second third, first seen past its start where the reply allows
    picks = [whole[i : i + 2] for i in range(len(whole) // 3, len(whole) - 1)]
    stop = next((p for p in picks if whole.index(p) > 0), picks[0] if picks else whole[:2])
    want = whole[: whole.index(stop)]
    body = s.chat(temperature=0, max_tokens=16, stop=[stop])
    expect(reply_text(body) == want, f"stop {stop!r}: {reply_text(body)!r}, not {want!r}")
    expect(body["choices"][0]["finish_reason"] == "stop", "finish reason is not stop")
    chunks, _ = s.stream(temperature=0, max_tokens=16, stop=[stop])
    expect(streamed_text(chunks) == want, f"streamed {streamed_text(chunks)!r}, not {want!r}")


# --- tools and structured outputs ----------------------------------------------------------------
@suite.check("tools.none", "`tool_choice: none` never returns tool calls")
def tools_none(s: OpenAIServer) -> None:
    body = s.chat(tools=TOOLS, tool_choice="none", max_tokens=24)
    choice = body["choices"][0]
    expect(not choice["message"].get("tool_calls"), "tool calls under tool_choice none")
    expect(choice["finish_reason"] != "tool_calls", "finish reason tool_calls")


def structured(s: OpenAIServer, **fields: Any) -> list[dict]:
    """`repeats` replies at temperature 1, a seed each."""
    return [
        s.chat(temperature=1.0, seed=seed, max_tokens=STRUCTURED_MAX_TOKENS, **fields)["choices"][0]
        for seed in range(s.repeats)
    ]


@suite.check(
    "tools.required",
    "`tool_choice: required` returns a call of an offered tool whose arguments parse and "
    "validate against its schema, with finish reason `tool_calls`, every time",
)
def tools_required(s: OpenAIServer) -> None:
    for choice in structured(s, tools=TOOLS, tool_choice="required"):
        expect(choice["finish_reason"] == "tool_calls", f"finish {choice['finish_reason']!r}")
        calls = choice["message"].get("tool_calls") or []
        expect(calls, f"no tool calls; content {choice['message'].get('content')!r}")
        for call in calls:
            valid_call(call, set(SCHEMAS))


@suite.check(
    "tools.named",
    "A named `tool_choice` calls exactly that function, with valid arguments, every time",
)
def tools_named(s: OpenAIServer) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in structured(s, tools=TOOLS, tool_choice=named):
        calls = choice["message"].get("tool_calls") or []
        expect(len(calls) == 1, f"{len(calls)} tool calls")
        valid_call(calls[0], {"get_time"})


@suite.check(
    "tools.streamed",
    "A streamed required call arrives as `tool_calls` deltas whose arguments join into valid "
    "JSON, with finish reason `tool_calls`",
)
def tools_streamed(s: OpenAIServer) -> None:
    chunks, _ = s.stream(
        tools=TOOLS, tool_choice="required", seed=3, max_tokens=STRUCTURED_MAX_TOKENS
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            finish = choice.get("finish_reason") or finish
            for delta in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(delta["index"], {"name": "", "arguments": "", "id": ""})
                call["id"] = delta.get("id") or call["id"]
                function = delta.get("function") or {}
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
    expect(finish == "tool_calls", f"finish {finish!r}")
    expect(calls, "no tool_calls deltas")
    for call in calls.values():
        valid_call({"type": "function", "id": call["id"], "function": call}, set(SCHEMAS))


@suite.check(
    "format.json_schema",
    "`response_format: json_schema` returns content that parses and validates against the "
    "schema, every time",
)
def format_json_schema(s: OpenAIServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for choice in structured(s, response_format=fmt):
        expect(choice["finish_reason"] == "stop", f"finish {choice['finish_reason']!r}")
        jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER)


@suite.check(
    "format.json_object",
    "`response_format: json_object` returns a JSON object whenever max_tokens does not cut it",
)
def format_json_object(s: OpenAIServer) -> None:
    for choice in structured(s, response_format={"type": "json_object"}):
        if choice["finish_reason"] == "stop":
            parsed = json.loads(choice["message"]["content"])
            expect(isinstance(parsed, dict), f"not an object: {parsed!r}")


# --- errors -----------------------------------------------------------------------------------
@suite.check(
    "errors.unknown_model",
    "A model the server does not serve is a 404 in OpenAI's error shape "
    "(`error.message`, `error.type`)",
)
def errors_unknown_model(s: OpenAIServer) -> None:
    body = {"model": "no-such-model-here", "messages": ASK, "max_tokens": 2}
    openai_error(s.post("/chat/completions", body), 404)


@suite.check(
    "errors.bad_request",
    "An invalid field value is a 400 in OpenAI's error shape whose `error.param` names it; "
    "the server answers the next request",
)
def errors_bad_request(s: OpenAIServer) -> None:
    body = {"model": s.model, "messages": ASK, "temperature": 7}
    error = openai_error(s.post("/chat/completions", body), 400)
    expect(error.get("param") == "temperature", f"param {error.get('param')!r}")
    s.chat(max_tokens=1)


@suite.check(
    "errors.auth",
    "A request without a key is a 401 in OpenAI's error shape (skipped where no key is used)",
)
def errors_auth(s: OpenAIServer) -> None:
    if not s.keyed:
        raise Skip("run without a key")
    body = {"model": s.model, "messages": ASK, "max_tokens": 2}
    openai_error(s.post("/chat/completions", body, headers={"Authorization": ""}), 401)
