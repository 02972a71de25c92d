"""Structured outputs: what a chat request demands of its text, as one grammar that the engine
enforces token by token (grammar-constrained decoding), so even a model that would not write
it unaided returns text that parses and validates.

    tool_choice "required"        one call, in the model's tool-call format, of any tool,
                                  its arguments valid against that tool's `parameters`
    tool_choice {function: NAME}  the same, of that tool only
    response_format json_schema   a JSON value valid against `json_schema.schema`
    response_format json_object   a JSON object

The grammar is llguidance's Lark dialect (`%json {schema}` embeds a JSON schema), a string
`Sampling.grammar` carries to the engine (across the hf engine's process boundary too). The
hf engine compiles it with llguidance (`engines/grammar.py`: the token mask before each
sample and the token after it); the vllm engine hands it to vLLM's structured outputs (its
`guidance` backend: the same library). JSON is compact (`,` and `:`, no whitespace), so a
model cannot pad it forever. A constrained token's behaviour logprob is under the masked
distribution it was sampled from; a recorded session marks those tokens in its trajectory
(`Trajectory.constrained_mask`).
"""

from __future__ import annotations

import json
from typing import Any

from treadle_rollout.tool_calls import ToolParser

COMPACT = {"whitespace_flexible": False}
"""llguidance's JSON options: `,` and `:` between items, no whitespace."""


def check(grammar: str) -> str:
    """`grammar`, if it compiles (llguidance, without a tokenizer); else ValueError saying
    where it does not (a schema llguidance cannot enforce, a bad `$ref`)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error.strip())
    return grammar


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark expansion matching JSON valid against `schema`."""
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT})


def tool_grammar(parser: ToolParser, tools: list[dict], function: str | None) -> str:
    """One call of `function` (None: of any of `tools`) in `parser`'s format."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                parser.arguments_key: tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", parser.arguments_key],
            "additionalProperties": False,
        }
        for tool in tools
        if function is None or tool["function"]["name"] == function
    ]
    return check(parser.grammar(json_rule(calls[0] if len(calls) == 1 else {"anyOf": calls})))


def response_grammar(kind: str, json_schema: dict[str, Any] | None) -> str | None:
    """`response_format`'s grammar (None for `text`)."""
    if kind == "json_object":
        return check(f"start: {json_rule({'type': 'object'})}")
    if kind == "json_schema":
        schema = (json_schema or {}).get("schema") or {}
        return check(f"start: {json_rule(schema)}")
    return None
