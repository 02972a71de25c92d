"""A tiny model trained, in a few seconds, to call a tool: tests of tool calling then parse
tokens a real model generated, not scripted text.

The conversation is the OpenAI Agents SDK's own shape for a weather agent (its system
instructions, its tool schema): the user asks for a city's weather, the assistant calls
`get_weather`, the tool answers, the assistant answers in words. Trained on the chat
template's rendering, loss on the assistant turns, until greedy decoding reproduces them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

INSTRUCTIONS = "You answer questions about the weather."
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "properties": {"city": {"title": "City", "type": "string"}},
            "required": ["city"],
            "title": "get_weather_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
CITIES = ("Paris", "Rome", "Oslo")


def weather(city: str) -> str:
    return f"sunny in {city}"


def answer(city: str) -> str:
    return f"It is sunny in {city}."


def conversation(city: str) -> list[dict]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": city}},
    }
    return [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": weather(city)},
        {"role": "assistant", "content": answer(city)},
    ]


def call_text(city: str) -> str:
    """The assistant's tool-call turn as the template writes it."""
    args = json.dumps({"city": city})
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'


def _segments(
    tokenizer, messages: list[dict], tools: list[dict] | None
) -> list[tuple[list[int], int]]:
    """(tokens, trained) pieces: context up to each assistant turn, then the turn."""
    pieces, done = [], ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(
            messages[:k], tools=tools, tokenize=False, add_generation_prompt=True
        )
        full = tokenizer.apply_chat_template(messages[: k + 1], tools=tools, tokenize=False)
        turn = full[len(prompt) :].rstrip("\n")  # ends with <|im_end|>
        pieces.append((tokenizer.encode(prompt[len(done) :], add_special_tokens=False), 0))
        pieces.append((tokenizer.encode(turn, add_special_tokens=False), 1))
        done = prompt + turn
    return pieces


def train_tool_model(base: Path, out: Path, steps: int = 500) -> Path:
    return train_conversations(base, out, [conversation(c) for c in CITIES], [TOOL], steps)


def train_conversations(
    base: Path,
    out: Path,
    conversations: list[list[dict]],
    tools: list[dict] | None = None,
    steps: int = 500,
) -> Path:
    """The tiny model at `base`, trained until greedy decoding reproduces the assistant turns
    of `conversations` (rendered with `tools`), saved at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = []
    for messages in conversations:
        tokens, mask = [], []
        for piece, trained in _segments(tokenizer, messages, tools):
            tokens += piece
            mask += [trained] * len(piece)
        rows.append((tokens, mask))
    length = max(len(t) for t, _ in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    labels = torch.full((len(rows), length), -100)
    for i, (tokens, mask) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        labels[i, : len(tokens)] = torch.tensor(
            [t if m else -100 for t, m in zip(tokens, mask, strict=True)]
        )
    attention = (labels != -100) | (ids != tokenizer.pad_token_id)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention.long(), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.004:
            break
    assert loss.item() < 0.02, f"the tool model did not learn its conversations: {loss.item()}"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in base.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, out / name.name)
    return out
