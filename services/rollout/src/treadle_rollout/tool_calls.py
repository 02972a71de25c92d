"""Tool-call parsers: a model's generated text -> OpenAI `tool_calls`.

A model writes a tool call in the format its chat template taught it; the parser for that
format turns the text back into calls. Parsers are chosen per model
(`TREADLE_ROLLOUT_TOOL_PARSER`): `auto` reads the chat template (`<tool_call>` -> `hermes`,
`<|python_tag|>` or Llama's `"parameters"` -> `llama3_json`), a registered name picks one, and
`package.module:Class` loads another (pluggable: any class with this module's `ToolParser`
shape).

Each parser also knows how a call starts (`start`), which the streaming API uses to hold
back text that may be a call, and what to put in front of the generation when `tool_choice`
demands a call (`forced_prefix`): the model then continues a call already begun. That
prefix is part of the prompt the engine sees (context tokens, not trained on).
"""

from __future__ import annotations

import importlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON object's text (what OpenAI returns)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


@dataclass
class Parsed:
    content: str | None
    """Text outside the calls (None when there is none)."""
    calls: list[ToolCall]


class ToolParser(Protocol):
    name: str
    arguments_key: str
    """The key of a call's arguments in its JSON object."""
    start: str
    """Text that begins a call (streamed text is held back from where it may begin)."""

    def parse(self, text: str) -> Parsed: ...

    def forced_prefix(self, function: str | None) -> str:
        """What the assistant turn starts with when a call is required (`function`: that
        one)."""
        ...

    def grammar(self, call: str) -> str:
        """A Lark grammar (llguidance's dialect) of exactly one call in this format, whose
        JSON object is the rule `call`'s text (`structured.call_rule`: `%json {...}` over
        `arguments_key`)."""
        ...


def _call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesParser:
    """Hermes / Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any
    number of them, after optional text. A last call cut off before its closing tag (a stop
    string, the token limit) still counts if its JSON is whole."""

    name = "hermes"
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        at = text.find(self.start)
        if at < 0:
            return Parsed(text, [])
        calls = []
        for body in self._CALL.findall(text[at:]):
            try:
                call = _call(json.loads(body), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a well-formed call: the whole text is content
                return Parsed(text, [])
            calls.append(call)
        content = text[:at]
        return Parsed(content if content.strip() else None, calls)

    def forced_prefix(self, function: str | None) -> str:
        if function is None:
            return '<tool_call>\n{"name": "'
        return f'<tool_call>\n{{"name": {json.dumps(function)}, "arguments": '

    arguments_key = "arguments"

    def grammar(self, call: str) -> str:
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}'


class Llama3JsonParser:
    """Llama 3.x JSON tool calls: the whole turn is `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`; several separated by `;`)."""

    name = "llama3_json"
    start = "{"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith(self._TAG):
            body = body[len(self._TAG) :].strip()
        if not body.startswith("{"):
            return Parsed(text, [])
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return Parsed(text, [])
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return Parsed(text, [])
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return Parsed(None, calls)

    def forced_prefix(self, function: str | None) -> str:
        if function is None:
            return '{"name": "'
        return f'{{"name": {json.dumps(function)}, "parameters": '

    arguments_key = "parameters"

    def grammar(self, call: str) -> str:
        return f"start: call\ncall: {call}"


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def register(name: str, parser: type) -> None:
    """Make a parser class available by name."""
    PARSERS[name] = parser


class NoToolFormat(ValueError):
    """The model's chat template shows no tool-call format this server can parse."""


def detect(chat_template: str | None) -> str | None:
    """The parser a chat template's tool format calls for, or None."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return None


def for_model(setting: str, chat_template: str | None) -> ToolParser | None:
    """The parser `setting` (`auto`, `none`, a registered name, or `module:Class`) picks
    for a model with this chat template; None when the model gets none."""
    if setting == "none":
        return None
    if setting == "auto":
        name = detect(chat_template)
        return PARSERS[name]() if name else None
    if setting in PARSERS:
        return PARSERS[setting]()
    if ":" in setting:
        module, _, attr = setting.partition(":")
        return getattr(importlib.import_module(module), attr)()
    raise ValueError(
        f"unknown tool parser {setting!r}: auto, none, {', '.join(sorted(PARSERS))} or "
        "package.module:Class"
    )
