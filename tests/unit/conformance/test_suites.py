"""The conformance suites' own behaviour: a check passes, fails with what was seen, or is
skipped with why; a server that breaks a behaviour fails exactly that check (a scripted fake
OpenAI server on httpx's mock transport, each response broken in one way)."""

from __future__ import annotations

import json

import httpx
import pytest

from treadle_conformance import openai_checks, openai_server, tinker_checks
from treadle_conformance.report import Skip, Status, Suite, expect

pytestmark = pytest.mark.unit


def test_a_suite_reports_each_outcome_with_its_reason():
    suite: Suite[list[str]] = Suite("demo")

    @suite.check("a.ok", "holds")
    def ok(seen: list[str]) -> None:
        seen.append("a")

    @suite.check("a.broken", "does not hold")
    def broken(seen: list[str]) -> None:
        expect(1 == 2, "one is not two")

    @suite.check("b.error", "raises")
    def error(seen: list[str]) -> None:
        {}["missing"]

    @suite.check("b.skipped", "does not apply")
    def skipped(seen: list[str]) -> None:
        raise Skip("no such feature here")

    with pytest.raises(ValueError, match="twice"):
        suite.check("a.ok", "again")(ok)
    seen: list[str] = []
    report = suite.run(seen, "server")
    got = {o.check: (o.status, o.detail) for o in report.outcomes}
    assert got["a.ok"] == (Status.passed, "") and seen == ["a"]
    assert got["a.broken"] == (Status.failed, "one is not two")
    assert got["b.error"][0] is Status.failed and got["b.error"][1].startswith("KeyError")
    assert got["b.skipped"] == (Status.skipped, "no such feature here")
    assert not report.ok
    assert report.to_json()["failed"] == 2 and report.to_json()["skipped"] == 1
    assert [o.check for o in suite.run([], "server", only=["a."]).outcomes] == ["a.ok", "a.broken"]
    with pytest.raises(ValueError, match="no check"):
        suite.select(["zzz"])


def test_check_ids_are_area_dot_behaviour_and_documented():
    for suite in (openai_checks.suite, tinker_checks.suite):
        for check in suite.checks:
            area, _, name = check.id.partition(".")
            assert area and name, check.id
            assert len(check.behaviour) > 20, check.id


CHOICE = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
USAGE = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def fake(broken: str) -> openai_server.OpenAIServer:
    """A scripted OpenAI server, right in every way but `broken`."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if not request.headers.get("authorization"):
            if broken == "auth_shape":
                return httpx.Response(401, json={"detail": "no key"})
            return httpx.Response(401, json={"error": {"message": "no key", "type": "x"}})
        if body.get("stream"):
            chunk = {"id": "c1", "object": "chat.completion.chunk", "choices": []}
            events = [
                {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            ]
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
            text += "" if broken == "no_done" else "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        choice = CHOICE
        if body.get("tool_choice") == "required":
            call = {"name": "get_time", "arguments": '{"zone": "UTC"}'}
            message = {
                "role": "assistant",
                "tool_calls": [{"id": "1", "type": "function", "function": call}],
            }
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
            if broken == "tool_as_text":
                choice = {**CHOICE, "message": {"role": "assistant", "content": '<tool_call>{"na'}}
        return httpx.Response(
            200,
            json={
                "id": "x",
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [choice],
                "usage": USAGE,
            },
        )

    client = httpx.Client(
        base_url="http://fake/v1",
        transport=httpx.MockTransport(handle),
        headers={"Authorization": "Bearer k"},
    )
    return openai_server.OpenAIServer(client, "m", repeats=1)


@pytest.mark.parametrize(
    ("broken", "check", "seen"),
    [
        ("no_done", "stream.chunks", "did not end with data: [DONE]"),
        ("auth_shape", "errors.auth", "not OpenAI's error shape"),
        ("tool_as_text", "tools.required", "finish 'stop'"),
    ],
)
def test_a_broken_behaviour_fails_its_check(broken, check, seen):
    [right] = openai_checks.suite.run(fake("none"), "fake", only=[check]).outcomes
    assert right.status is Status.passed, right.detail
    [wrong] = openai_checks.suite.run(fake(broken), "fake", only=[check]).outcomes
    assert wrong.status is Status.failed and seen in wrong.detail, wrong.detail
