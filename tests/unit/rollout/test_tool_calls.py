"""Tool-call parsers: the formats models write, and text that only looks like a call."""

from __future__ import annotations

import json

import pytest

from treadle_rollout import tool_calls
from treadle_rollout.tool_calls import HermesParser, Llama3JsonParser


def test_hermes_reads_calls_after_text_and_a_call_cut_before_its_closing_tag():
    parsed = HermesParser().parse(
        'Let me look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        '<tool_call>{"name": "g", "arguments": "{\\"y\\": [2]}"}'
    )
    assert parsed.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("f", {"x": 1}),
        ("g", {"y": [2]}),
    ]
    assert len({c.id for c in parsed.calls}) == 2
    only = HermesParser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert only.content is None and only.calls[0].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    ],
)
def test_hermes_gives_back_text_that_is_not_a_well_formed_call(text):
    parsed = HermesParser().parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_llama3_json_reads_whole_turn_calls_only():
    parser = Llama3JsonParser()
    parsed = parser.parse('<|python_tag|>{"name": "f", "parameters": {"a": "b"}}; {"name": "g"}')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("f", {"a": "b"}),
        ("g", {}),
    ]
    assert parsed.content is None
    assert parser.parse('The answer is {"name": "f"}').calls == []
    assert parser.parse('{"name": "f", "parameters": {}} and more').calls == []


def test_forced_prefixes_begin_a_call_the_parser_reads():
    for parser in (HermesParser(), Llama3JsonParser()):
        text = parser.forced_prefix("lookup") + '{"q": "x"}}'
        if isinstance(parser, HermesParser):
            text += "\n</tool_call>"
        [call] = parser.parse(text).calls
        assert call.name == "lookup" and json.loads(call.arguments) == {"q": "x"}
        [call] = parser.parse(parser.forced_prefix(None) + 'lookup", "arguments": {}}').calls
        assert call.name == "lookup"


def test_the_parser_is_chosen_from_the_chat_template_or_by_name():
    assert isinstance(tool_calls.for_model("auto", "...<tool_call>..."), HermesParser)
    assert isinstance(tool_calls.for_model("auto", "<|python_tag|>"), Llama3JsonParser)
    assert tool_calls.for_model("auto", "{{ messages }}") is None
    assert tool_calls.for_model("none", "<tool_call>") is None
    assert isinstance(tool_calls.for_model("llama3_json", None), Llama3JsonParser)
    plugged = tool_calls.for_model("treadle_rollout.tool_calls:HermesParser", None)
    assert isinstance(plugged, HermesParser)
    with pytest.raises(ValueError, match="unknown tool parser"):
        tool_calls.for_model("mystery", None)
