"""Chat turns, recorded token-exactly: the core that the OpenAI chat API (`openai_api.py`) and
played episodes (`played.py`) both call.

A chat request becomes a `ChatPlan`: its messages and tools as the chat template sees them, the
parser that reads tool calls back out of the model's text, what the assistant turn is forced to
begin with (`tool_choice`), its stop strings. A turn of a recorded session appends the request's
new turns to the session's `Transcript` (the exact tokens the engine saw and generated), and the
generation and the reply after it; a failed turn rolls the transcript back. Played episodes
record into the episode's own transcript (`attach`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from treadle_common import names
from treadle_common.auth import policy as auth
from treadle_rollout import metrics, tool_calls
from treadle_rollout import structured as structured_mod
from treadle_rollout.engines.base import Generation
from treadle_rollout.errors import OpenAIError
from treadle_rollout.generation import PolicyGenerator
from treadle_rollout.openai_stream import cut
from treadle_rollout.openai_types import ChatRequest, NamedToolChoice
from treadle_rollout.transcript import TemplateNotPrefixStable, Transcript, encode, opening, render

SESSION_HEADER = "X-Treadle-Session"
"""The header that names a recorded session (the OpenAI API's; played episodes' are internal)."""


@dataclass
class RecordedSession:
    transcript: Transcript
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    turns: int = 0
    tenant: str = auth.DEFAULT_TENANT
    """Its creator's: another tenant's token may not continue, read, finish or delete it."""


class SessionRecorder:
    """Recorded sessions by id; idle ones expire after `ttl_s`."""

    def __init__(self, tokenizer, ttl_s: float = 3600.0, max_sessions: int = 4096):
        self.tokenizer = tokenizer
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.sessions: dict[str, RecordedSession] = {}

    def get(self, session_id: str, create: bool = False) -> RecordedSession:
        now = time.time()
        for sid in [s for s, v in self.sessions.items() if now - v.last_used > self.ttl_s]:
            del self.sessions[sid]
        session = self.sessions.get(session_id)
        if session is None:
            if not create:
                raise OpenAIError(404, f"no recorded session {session_id!r}", code="not_found")
            if len(self.sessions) >= self.max_sessions:
                raise OpenAIError(429, "too many recorded sessions", code="rate_limit_exceeded")
            session = RecordedSession(Transcript(self.tokenizer), tenant=auth.caller().tenant)
            self.sessions[session_id] = session
        if not auth.caller().may_see(session.tenant):
            raise OpenAIError(
                403, f"session {session_id!r} belongs to another tenant", code="permission_denied"
            )
        session.last_used = now
        return session

    def attach(self, session_id: str, transcript: Transcript) -> None:
        """Record a played episode's chat turns into its own `transcript`."""
        self.sessions[session_id] = RecordedSession(transcript)

    def detach(self, session_id: str) -> int:
        """Forget a played episode's session; its number of turns."""
        session = self.sessions.pop(session_id, None)
        return session.turns if session else 0


@dataclass
class ChatPlan:
    """How a chat request's turns are generated and read back."""

    messages: list[dict]
    tools: list[dict] | None
    parser: tool_calls.ToolParser | None
    """Parses the model's text into tool calls (None: tool_choice none, or no tools)."""
    prefix: str
    """What the assistant turn begins with (a call `tool_choice` demands)."""
    required: bool
    parallel: bool
    stops: tuple[str, ...]
    max_tokens: int | None
    grammar: str | None = None
    """What the text must match (`structured.py`): a required call or `response_format`,
    enforced by an engine with `structured_outputs`."""


@dataclass
class Reply:
    """One choice's text, read back: content and tool calls, OpenAI's finish reason."""

    content: str | None
    calls: list[tool_calls.ToolCall]
    finish_reason: str

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [c.openai() for c in self.calls]
        return message


class ChatTurns:
    """Plans a chat request, records its turn into a session, reads the model's text back as a
    reply (content and tool calls)."""

    def __init__(self, generator: PolicyGenerator, recorder: SessionRecorder, tool_parser: str):
        self.generator = generator
        self.recorder = recorder
        self.tool_parser = tool_calls.for_model(
            tool_parser, getattr(generator.tokenizer, "chat_template", None)
        )

    def plan(self, req: ChatRequest) -> ChatPlan:
        tools = req.template_tools()
        choice = req.tool_choice or ("auto" if tools else "none")
        parser = None
        if tools and choice != "none":
            parser = self.tool_parser
            if parser is None:
                raise OpenAIError(
                    400,
                    f"the model {self.generator.engine.model_name}'s chat template shows no "
                    "tool-call format this server can parse; set TREADLE_ROLLOUT_TOOL_PARSER",
                    param="tools",
                )
        function = choice.function.name if isinstance(choice, NamedToolChoice) else None
        required = parser is not None and (choice == "required" or function is not None)
        grammar, prefix = self.constrain(req, parser, tools, function, required)
        return ChatPlan(
            messages=[m.template() for m in req.messages],
            tools=tools,
            parser=parser,
            prefix=prefix,
            grammar=grammar,
            required=required,
            parallel=req.parallel_tool_calls is not False,
            stops=req.stop_strings(),
            max_tokens=req.max_completion_tokens or req.max_tokens,
        )

    def constrain(
        self,
        req: ChatRequest,
        parser: tool_calls.ToolParser | None,
        tools: list[dict] | None,
        function: str | None,
        required: bool,
    ) -> tuple[str | None, str]:
        """(the grammar, the forced prefix) of a request: a required call is a grammar where
        the engine enforces one (else the call's opening, forced), and so is a JSON
        `response_format` (which an engine without structured outputs refuses)."""
        structured = self.generator.engine.structured_outputs
        if required and parser is not None and tools:
            if not structured:
                return None, parser.forced_prefix(function)
            try:
                return structured_mod.tool_grammar(parser, tools, function), ""
            except ValueError as exc:
                raise OpenAIError(400, f"a tool's parameters: {exc}", param="tools") from exc
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return None, ""
        if not structured:
            raise OpenAIError(
                400,
                f"unsupported value for `response_format`: {fmt.type} needs structured outputs, "
                f"which the {self.generator.engine.name} engine does not enforce",
                param="response_format",
            )
        try:
            return structured_mod.response_grammar(fmt.type, fmt.json_schema), ""
        except ValueError as exc:
            raise OpenAIError(400, f"`response_format`: {exc}", param="response_format") from exc

    def read(self, plan: ChatPlan, text: str, finish: str) -> Reply:
        """The assistant text (prefix included, cut at a stop string) as content and calls."""
        if plan.parser is not None:
            parsed = plan.parser.parse(text)
            if parsed.calls:
                calls = parsed.calls if plan.parallel else parsed.calls[:1]
                metrics.TOOL_CALLS.inc(len(calls))
                return Reply(parsed.content, calls, "tool_calls")
            if plan.required:
                metrics.TOOL_CALL_MISSES.inc()
        return Reply(text, [], finish)

    def session(self, session_id: str, req: ChatRequest) -> RecordedSession:
        if not names.valid_name(session_id):
            raise OpenAIError(
                400,
                f"{SESSION_HEADER} must be letters, digits, '_', '-' and single inner dots "
                f"(at most {names.NAME_MAX})",
                param=SESSION_HEADER,
            )
        if req.n != 1:
            raise OpenAIError(400, "recorded sessions need n=1", param="n")
        return self.recorder.get(session_id, create=True)

    def open_turn(self, session: RecordedSession, session_id: str, plan: ChatPlan) -> list[int]:
        """Append the request's new turns (and the forced prefix) to the transcript; the
        prompt the engine continues."""
        t = session.transcript
        if t.tokens and t.tools != plan.tools:
            raise OpenAIError(
                400,
                f"session {session_id}: the tools changed; tokens cannot stay exact, start a "
                "new session",
                param="tools",
                code="session_diverged",
            )
        t.tools = plan.tools
        try:
            t.set_messages(plan.messages)
        except TemplateNotPrefixStable as exc:
            raise OpenAIError(
                400,
                f"session {session_id}: {exc}; send the conversation as recorded, or start a "
                "new session",
                param="messages",
                code="session_diverged",
            ) from exc
        t.add_prefix(plan.prefix)
        self.generator.check_room(len(t.tokens))
        return list(t.tokens)

    def prompt(self, plan: ChatPlan) -> list[int]:
        prompt = list(opening(self.generator.tokenizer, plan.messages, plan.tools, plan.prefix)[1])
        self.generator.check_room(len(prompt))
        return prompt

    def close_turn(self, session: RecordedSession, plan: ChatPlan, gen: Generation, reply: Reply):
        session.transcript.add_generation(gen, plan.prefix, plan.grammar is not None)
        session.transcript.record_reply(reply.message())
        session.turns += 1

    async def complete(
        self, req: ChatRequest, plan: ChatPlan, session_id: str | None
    ) -> tuple[int, list[Generation], list[Reply]]:
        """A whole (not streamed) chat turn: its prompt's length, its generations and replies
        (`n` of them; one in a recorded session, whose transcript records it)."""
        if not session_id:
            prompt = self.prompt(plan)
            gens = await asyncio.gather(
                *(
                    self.generator.generate(
                        prompt, self.generator.sampling(req, plan.max_tokens, i, plan.grammar)
                    )
                    for i in range(req.n)
                )
            )
            return (
                len(prompt),
                list(gens),
                [self.reply(plan, g, req.skip_special_tokens) for g in gens],
            )
        session = self.session(session_id, req)
        async with session.lock:
            mark = session.transcript.mark()
            try:
                prompt = self.open_turn(session, session_id, plan)
                sampling = self.generator.sampling(req, plan.max_tokens, 0, plan.grammar)
                gen = await self.generator.generate(prompt, sampling)
            except BaseException:
                session.transcript.rollback(mark)
                raise
            reply = self.reply(plan, gen, req.skip_special_tokens)
            self.close_turn(session, plan, gen, reply)
        return len(prompt), [gen], [reply]

    def reply(self, plan: ChatPlan, gen: Generation, skip_special: bool) -> Reply:
        text = plan.prefix + self.generator.decode(
            self.generator.visible(gen.tokens, True), skip_special
        )
        return self.read(plan, cut(text, plan.stops), gen.finish_reason)


def session_free_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The tokens of `messages` as the chat template renders them, outside any session."""
    text = render(tokenizer, messages)
    return encode(tokenizer, text)
