"""The server under test of the OpenAI suite and what its checks share: the request they
ask (`ASK`), the tools and schemas they offer, and readers of the answers (usage, error
shapes, tool calls) that fail the running check with what they saw."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema

from treadle_conformance.report import expect

ASK = [{"role": "user", "content": "Weather in Paris for 3 days, then the time?"}]
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
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": -999, "maximum": 999},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
STRUCTURED_MAX_TOKENS = 120


@dataclass
class OpenAIServer:
    """The server under test: `base_url` ends in `/v1`."""

    http: httpx.Client
    model: str
    repeats: int = 3
    keyed: bool = True
    """Whether requests carry a key (the auth check is skipped without one)."""

    def post(self, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kwargs)

    def chat(self, **fields: Any) -> dict[str, Any]:
        """A chat completion that must succeed: `ASK` to the model unless `fields` say else."""
        body = {"model": self.model, "messages": ASK, "max_tokens": 8, **fields}
        body = {k: v for k, v in body.items() if v is not None}  # None: leave the field out
        response = self.post("/chat/completions", body)
        expect(response.status_code == 200, f"HTTP {response.status_code}: {response.text[:300]}")
        return response.json()

    def stream(self, path: str = "/chat/completions", **fields: Any) -> tuple[list[dict], bool]:
        """A streamed request's chunks, and whether `data: [DONE]` ended it."""
        body = {"model": self.model, "messages": ASK, "max_tokens": 8, "stream": True, **fields}
        chunks: list[dict] = []
        done = False
        with self.http.stream("POST", path, json=body) as response:
            expect(response.status_code == 200, f"HTTP {response.status_code}")
            kind = response.headers.get("content-type", "")
            expect(kind.startswith("text/event-stream"), f"content-type {kind!r}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                expect(not done, "an event after data: [DONE]")
                if data == "[DONE]":
                    done = True
                else:
                    chunks.append(json.loads(data))
        return chunks, done


def reply_text(body: dict) -> str:
    return body["choices"][0]["message"].get("content") or ""


def streamed_text(chunks: list[dict], index: int = 0) -> str:
    return "".join(
        c["delta"].get("content") or ""
        for chunk in chunks
        for c in chunk["choices"]
        if c["index"] == index
    )


def check_usage(usage: Any, max_completion: int | None = None) -> None:
    expect(isinstance(usage, dict), f"no usage: {usage!r}")
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    expect(isinstance(prompt, int) and prompt > 0, f"prompt_tokens {prompt!r}")
    expect(isinstance(completion, int) and completion >= 0, f"completion_tokens {completion!r}")
    expect(usage.get("total_tokens") == prompt + completion, f"total_tokens of {usage}")
    if max_completion is not None:
        expect(completion <= max_completion, f"{completion} completion tokens > {max_completion}")


def openai_error(response: httpx.Response, status: int) -> dict:
    """The body's `error` object, after checking the status and OpenAI's error shape."""
    expect(response.status_code == status, f"HTTP {response.status_code}, not {status}")
    try:
        error = response.json().get("error")
    except ValueError:
        error = None
    expect(
        isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error,
        f"not OpenAI's error shape ({{error: {{message, type, ...}}}}): {response.text[:200]}",
    )
    return error  # type: ignore[return-value]


def valid_call(call: dict, names: set[str]) -> str:
    """A tool call of one of `names` whose arguments validate; its name."""
    expect(call.get("type") == "function", f"tool call type {call.get('type')!r}")
    expect(isinstance(call.get("id"), str) and call["id"], "a tool call without an id")
    name = call["function"]["name"]
    expect(name in names, f"called {name!r}, not one of {sorted(names)}")
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMAS[name])
    return name
