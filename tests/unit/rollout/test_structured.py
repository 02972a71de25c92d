"""Structured outputs' grammars (`structured.py`) and the hf engine's constraint
(`engines/grammar.py`), on the tiny model's tokenizer: a grammar admits exactly the texts
it should, in each tool-call format."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from treadle_rollout import structured
from treadle_rollout.engines import grammar
from treadle_rollout.tool_calls import HermesParser, Llama3JsonParser

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def llg(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    return tok, grammar.llg_tokenizer(tok, len(tok), [tok.eos_token_id])


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def accepts(llg, grammar_text: str, text: str) -> bool:
    """Whether the constraint takes `text`'s tokens and is then complete (or may end)."""
    tok, llg_tokenizer = llg
    constraint = grammar.Constraint(llg_tokenizer, grammar_text)
    matcher = constraint.matcher
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
def test_a_required_call_is_one_valid_call_in_the_parsers_format(llg, parser):
    g = structured.tool_grammar(parser, TOOLS, None)
    key = parser.arguments_key
    call = {"name": "weather", key: {"city": "Oslo"}}
    body = compact(call)
    text = f"<tool_call>\n{body}\n</tool_call>" if parser.name == "hermes" else body
    assert accepts(llg, g, text)
    assert parser.parse(text).calls[0].name == "weather"
    wrong = {"name": "weather", key: {"town": "Oslo"}}  # not the tool's parameters
    assert not accepts(llg, g, text.replace(body, compact(wrong)))
    assert not accepts(llg, g, text.replace(body, json.dumps(call)))  # compact only
    named = structured.tool_grammar(parser, TOOLS, "clock")
    assert not accepts(llg, named, text)  # only the named function


def test_response_formats_admit_their_json_only(llg):
    schema = {"schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    g = structured.response_grammar("json_schema", schema)
    assert accepts(llg, g, '{"n":3}') and not accepts(llg, g, '{"n":"x"}')
    assert not accepts(llg, g, '{"n": 3}')  # compact: no free whitespace
    obj = structured.response_grammar("json_object", None)
    assert accepts(llg, obj, '{"a":[1]}') and not accepts(llg, obj, "[1]")
    assert structured.response_grammar("text", None) is None
    with pytest.raises(ValueError, match="type must be"):
        structured.response_grammar("json_schema", {"schema": {"type": 5}})


def test_masks_leave_only_allowed_tokens_and_unconstrained_rows_alone(llg):
    tok, llg_tokenizer = llg
    g = structured.response_grammar("json_object", None)
    constraint = grammar.Constraint(llg_tokenizer, g)
    logits_B_V = torch.zeros(2, len(tok) + 3)  # a model's padded vocabulary
    grammar.apply_masks(logits_B_V, [(1, constraint)])
    assert bool((logits_B_V[0] == 0).all())
    allowed = (logits_B_V[1] == 0).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).startswith("{") for t in allowed)
    assert bool(torch.isinf(logits_B_V[1, len(tok) :]).all())
