"""Token-exact chat transcripts, shared by env episodes and recorded OpenAI-API sessions.

The trajectory's tokens are exactly the tokens the engine saw and produced. Generated tokens
get loss_mask 1, their behaviour logprob and the policy version that produced them; prompt,
env and user tokens get mask 0 and version -1. New messages are tokenized as the text the
chat template adds after what is already recorded, so earlier tokens are never re-tokenized.

Tool turns stay exact too: a client sends back the assistant turns it was given in OpenAI's
form (`tool_calls`, text cut at a stop string), which the template would render differently
from what the model wrote. Each such turn is checked against the reply it was given
(`reply_key`) and rendered as what the model actually generated.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from treadle_common.proto.treadle.v1 import reward_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout.engines.base import Generation

_OPENINGS: OrderedDict[tuple[int, str, str], tuple[str, tuple[int, ...]]] = OrderedDict()
"""Rendered and tokenized openings, by tokenizer, messages (and tools) and what follows
them (`opening`)."""
MAX_OPENINGS = 4096
MAX_OPENING_TOKENS = 1 << 20
"""The openings kept hold at most this many tokens together (tens of MB)."""
_opening_tokens = 0


def encode(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer(text, add_special_tokens=False)["input_ids"]`, through a fast tokenizer's
    own (Rust) encoder when it has one: the same ids at about half the cost, most of which
    is transformers' per-call Python (a tenth of the serving loop's time per streamed
    request)."""
    fast = getattr(tokenizer, "backend_tokenizer", None)
    if fast is not None:
        return fast.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def opening(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, suffix: str = ""
) -> tuple[str, tuple[int, ...]]:
    """`render(tokenizer, messages, tools) + suffix` and its tokens. The episodes of a group,
    and the requests of a group that a client sends one by one, open with the same messages:
    only the first of them renders and tokenizes them (about a fifth of the serving loop's
    time per streamed chat request, measured on the bench's tiny model)."""
    global _opening_tokens
    key = (id(tokenizer), json.dumps([messages, tools], sort_keys=True), suffix)
    known = _OPENINGS.get(key)
    if known is not None:
        _OPENINGS.move_to_end(key)
        return known
    text = render(tokenizer, messages, tools) + suffix
    known = (text, tuple(encode(tokenizer, text)))
    if len(known[1]) <= MAX_OPENING_TOKENS // 8:  # a long one would push out many others
        _OPENINGS[key] = known
        _opening_tokens += len(known[1])
        while len(_OPENINGS) > MAX_OPENINGS or _opening_tokens > MAX_OPENING_TOKENS:
            _opening_tokens -= len(_OPENINGS.popitem(last=False)[1][1])
    return known


class TemplateNotPrefixStable(RuntimeError):
    """The chat template rendered earlier turns differently: tokens cannot stay exact."""


@dataclass
class Transcript:
    tokenizer: Any
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    constrained: list[int] = field(default_factory=list)
    """1 on generated tokens a grammar constrained (`Trajectory.constrained_mask`)."""
    messages: list[dict] = field(default_factory=list)
    text: str = ""
    """The text the tokens stand for (the chat template's rendering so far)."""
    tools: list[dict] | None = None
    """The tool definitions the template renders (OpenAI's `tools`), fixed for a transcript."""
    replies: dict[int, tuple] = field(default_factory=dict)
    """Recorded assistant turns (index in `messages`) -> `reply_key` of what the client got."""

    def render(self, messages: list[dict]) -> str:
        return render(self.tokenizer, messages, self.tools)

    def mark(self) -> tuple:
        """The transcript's state, to `rollback` to if a turn fails."""
        return (
            len(self.tokens),
            self.text,
            list(self.messages),
            dict(self.replies),
        )

    def rollback(self, mark: tuple) -> None:
        length, self.text, self.messages, self.replies = mark
        for seq in (self.tokens, self.loss_mask, self.logprobs, self.versions, self.constrained):
            del seq[length:]

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def add_context(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.loss_mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)
        self.constrained += [0] * len(tokens)

    def set_messages(self, messages: list[dict]) -> None:
        """The conversation is now `messages` (what is recorded, plus new turns); append the
        new turns and the generation prompt as context tokens. Assistant turns this
        transcript recorded are rendered as generated (after checking the client sent back
        what it was given)."""
        messages = list(messages)
        for i, reply in self.replies.items():
            if i >= len(messages):
                break
            if reply_key(messages[i]) != reply:
                raise TemplateNotPrefixStable(
                    f"message {i} is not the assistant turn this session replied with"
                )
            messages[i] = self.messages[i]
        if not self.text and not self.tokens:  # the opening: maybe rendered before
            text, tokens = opening(self.tokenizer, messages, self.tools)
            self.add_context(list(tokens))
            self.text = text
            self.messages = list(messages)
            return
        after = self.render(messages)
        if not after.startswith(self.text):
            raise TemplateNotPrefixStable(
                "the conversation no longer starts with the recorded turns; tokens cannot stay "
                "exact"
            )
        self.add_context(self.encode(after[len(self.text) :]))
        self.text = after
        self.messages = list(messages)

    def add_messages(self, messages: list[dict]) -> None:
        self.set_messages([*self.messages, *messages])

    def add_prefix(self, prefix: str) -> list[int]:
        """Begin the assistant turn with `prefix` (a tool call `tool_choice` demands), as
        context tokens; return them (what the engine continues after the prompt)."""
        tokens = self.encode(prefix) if prefix else []
        self.add_context(tokens)
        self.text += prefix
        return tokens

    def add_generation(self, gen: Generation, prefix: str = "", constrained: bool = False) -> str:
        """Record a generated turn; return the assistant text (without its stop token),
        after `prefix` (what `add_prefix` began the turn with). `constrained`: a grammar
        constrained every token of it (structured outputs).

        Special tokens generated inside the turn stay in the text: the chat template then
        renders the turn exactly as the tokens read, so later turns stay prefix-stable.
        """
        self.tokens += gen.tokens
        self.loss_mask += [1] * len(gen.tokens)
        self.logprobs += gen.logprobs
        self.versions += gen.versions
        self.constrained += [int(constrained)] * len(gen.tokens)
        self.text += self.tokenizer.decode(gen.tokens, skip_special_tokens=False)
        body = gen.tokens
        if gen.finish_reason == "stop" and body and body[-1] in self.tokenizer.all_special_ids:
            body = body[:-1]
        content = prefix + self.tokenizer.decode(body, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": content})
        return content

    def record_reply(self, message: dict) -> None:
        """What the client was given for the last generated turn (OpenAI's form)."""
        self.replies[len(self.messages) - 1] = reply_key(message)

    def close_turn(self, gen: Generation) -> None:
        """End an assistant turn cut at the token limit with the end-of-turn token."""
        if gen.finish_reason != "stop":
            eos = self.tokenizer.eos_token_id
            self.add_context([eos])
            self.text += self.tokenizer.eos_token

    def score_request(
        self, scorer: str, task_json: str, info: dict | None = None, options_json: str = ""
    ) -> reward_pb2.ScoreRequest:
        """What the reward service scores: the final assistant message (empty if the
        conversation did not end on one) and the whole transcript."""
        last = self.messages[-1] if self.messages else {}
        return reward_pb2.ScoreRequest(
            scorer=scorer,
            task_json=task_json,
            answer=last.get("content", "") if last.get("role") == "assistant" else "",
            transcript_json=json.dumps(self.messages),
            info_json=json.dumps(info or {}),
            options_json=options_json,
        )

    def fill(self, traj: tpb.Trajectory) -> None:
        traj.tokens.extend(self.tokens)
        traj.loss_mask.extend(self.loss_mask)
        traj.logprobs.extend(self.logprobs)
        traj.token_versions.extend(self.versions)
        if any(self.constrained):
            traj.constrained_mask.extend(self.constrained)


def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The chat template's text for `messages` (and `tools`), ready for the assistant."""
    if tools:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def reply_key(message: dict) -> tuple:
    """An assistant message's content and tool calls, as comparable values (arguments as
    parsed JSON: a client may re-serialize them)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append((function.get("name"), json.dumps(args, sort_keys=True)))
    return (message.get("role"), message.get("content") or "", tuple(calls))
