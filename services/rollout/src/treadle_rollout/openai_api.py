"""OpenAI-compatible API served from the current policy, with token-exact session recording.

    GET  /v1/models
    POST /v1/chat/completions        tools, streaming (SSE), logprobs + top_logprobs, n
    POST /v1/completions             prompt batches, streaming, logprobs
    GET  /v1/sessions/{id}           what a recorded session holds
    POST /v1/sessions/{id}/finish    score it and push it as a trajectory to Redis
    DELETE /v1/sessions/{id}

A chat request carrying the `X-Treadle-Session` header is recorded: the session keeps the
exact tokens the engine saw and generated (see `transcript.py`). The agent sends the whole
conversation each time, as OpenAI clients do; the new turns are appended as context tokens,
so an unmodified agent written against the OpenAI client produces a trainable trajectory.

Tools (`tools`) go through the model's chat template; the model's text is parsed back into
`tool_calls` by the parser for its format (`tool_calls.py`, `TREADLE_ROLLOUT_TOOL_PARSER`).
`tool_choice`: `none` renders the tools but parses no call; `auto` parses; `required` and a
named function begin the assistant turn with the start of a call (the parser's
`forced_prefix`), which the model completes.

Streaming (`stream: true`) sends server-sent events as the engine produces tokens: `data:`
chunks in OpenAI's format, usage in a last chunk when `stream_options.include_usage`, then
`data: [DONE]`. Text is held back while it may still turn into a stop string or a tool call;
tool calls are sent whole, in one delta, once the turn ends. An error after the stream began
is sent as a `data: {"error": ...}` event.

Every request field is honoured or refused (`openai_types.py`). Errors use OpenAI's error
body: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Path
from pydantic import ValidationError

from treadle_common import names
from treadle_common.api.rollout import (
    ModelCard,
    ModelList,
)
from treadle_common.auth import policy as auth
from treadle_rollout import metrics, tool_calls
from treadle_rollout.agent_sessions import AgentSessions
from treadle_rollout.completions import CompletionsAPI
from treadle_rollout.engines.base import Engine, Generation
from treadle_rollout.errors import OpenAIError, invalid_openai_request
from treadle_rollout.gate import RequestGate
from treadle_rollout.generation import PolicyGenerator
from treadle_rollout.openai_stream import (
    ChunkHeader,
    Chunks,
    Decoder,
    Last,
    cut,
    joined,
    sse,
)
from treadle_rollout.openai_types import (
    ChatRequest,
    CompletionRequest,
    NamedToolChoice,
)
from treadle_rollout.quota_gate import QuotaGate
from treadle_rollout.transcript import TemplateNotPrefixStable, Transcript, encode, opening, render

SESSION_HEADER = "X-Treadle-Session"
SessionId = Annotated[
    str, Path(pattern=names.NAME_PATTERN, max_length=names.NAME_MAX, description="A session id")
]


@dataclass(frozen=True)
class PlayedSampling:
    """The run's sampling, which a played episode's requests are answered with."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None
    model: str | None = None
    """The run's policy when it is an adapter (a LoRA run's); None: the engine's own."""


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


class OpenAIFrontend:
    def __init__(
        self,
        engine: Engine,
        recorder: SessionRecorder,
        redis=None,
        reward=None,
        gate: RequestGate | None = None,
        quota: QuotaGate | None = None,
        tool_parser: str = "auto",
        stream_interval_ms: float = 0.0,
        stream_events_per_s: float = 0.0,
    ):
        self.generator = PolicyGenerator(
            engine,
            recorder.tokenizer,
            gate or RequestGate(1 << 30),
            quota or QuotaGate(),
            stream_interval_ms / 1e3,
            stream_events_per_s,
        )
        """The policy behind both APIs: checks, admission, quotas, generation, streaming."""
        self.completions_api = CompletionsAPI(self.generator)
        self.recorder = recorder
        self.sessions = AgentSessions(recorder, redis, reward)
        """The recorded sessions' own API: issue, finish, info, discard."""
        self.tool_parser = tool_calls.for_model(
            tool_parser, getattr(self.generator.tokenizer, "chat_template", None)
        )

    @property
    def engine(self) -> Engine:
        return self.generator.engine

    async def completions(self, req: CompletionRequest) -> dict | AsyncIterator[str]:
        """`POST /v1/completions` (`completions.py`)."""
        return await self.completions_api.completions(req)

    def _chat_logprobs(self, gen: Generation, finished: bool) -> dict:
        tokens = self.generator.visible(gen.tokens, finished)
        tops = gen.top_logprobs or [[] for _ in gen.tokens]
        return {
            "content": [
                self.generator.token_entry(t, lp, top)
                for t, lp, top in zip(tokens, gen.logprobs, tops, strict=False)
            ]
        }

    # -- chat -----------------------------------------------------------------------------
    def _plan(self, req: ChatRequest) -> ChatPlan:
        tools = req.template_tools()
        choice = req.tool_choice or ("auto" if tools else "none")
        parser = None
        if tools and choice != "none":
            parser = self.tool_parser
            if parser is None:
                raise OpenAIError(
                    400,
                    f"the model {self.engine.model_name}'s chat template shows no tool-call "
                    "format this server can parse; set TREADLE_ROLLOUT_TOOL_PARSER",
                    param="tools",
                )
        prefix = ""
        if parser is not None and choice == "required":
            prefix = parser.forced_prefix(None)
        elif parser is not None and isinstance(choice, NamedToolChoice):
            prefix = parser.forced_prefix(choice.function.name)
        return ChatPlan(
            messages=[m.template() for m in req.messages],
            tools=tools,
            parser=parser,
            prefix=prefix,
            required=bool(prefix),
            parallel=req.parallel_tool_calls is not False,
            stops=req.stop_strings(),
            max_tokens=req.max_completion_tokens or req.max_tokens,
        )

    def _read(self, plan: ChatPlan, text: str, finish: str) -> Reply:
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

    def _session(self, session_id: str, req: ChatRequest) -> RecordedSession:
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

    def _open_turn(self, session: RecordedSession, session_id: str, plan: ChatPlan) -> list[int]:
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

    def _prompt(self, plan: ChatPlan) -> list[int]:
        prompt = list(opening(self.generator.tokenizer, plan.messages, plan.tools, plan.prefix)[1])
        self.generator.check_room(len(prompt))
        return prompt

    def _close_turn(self, session: RecordedSession, plan: ChatPlan, gen: Generation, reply: Reply):
        session.transcript.add_generation(gen, plan.prefix)
        session.transcript.record_reply(reply.message())
        session.turns += 1

    async def chat(self, req: ChatRequest, session_id: str | None) -> dict | AsyncIterator[str]:
        self.generator.check(req)
        plan = self._plan(req)
        if req.stream:
            return await self._chat_stream(req, plan, session_id)
        if session_id:
            session = self._session(session_id, req)
            async with session.lock:
                mark = session.transcript.mark()
                try:
                    prompt = self._open_turn(session, session_id, plan)
                    gens = [
                        await self.generator.generate(
                            prompt, self.generator.sampling(req, plan.max_tokens, 0)
                        )
                    ]
                except BaseException:
                    session.transcript.rollback(mark)
                    raise
                prompt_len = len(prompt)
                reply = self._reply(plan, gens[0], req.skip_special_tokens)
                self._close_turn(session, plan, gens[0], reply)
            replies = [reply]
        else:
            prompt = self._prompt(plan)
            prompt_len = len(prompt)
            gens = await asyncio.gather(
                *(
                    self.generator.generate(
                        prompt, self.generator.sampling(req, plan.max_tokens, i)
                    )
                    for i in range(req.n)
                )
            )
            replies = [self._reply(plan, g, req.skip_special_tokens) for g in gens]
        choices = [
            {
                "index": i,
                "message": reply.message(),
                "finish_reason": reply.finish_reason,
                "logprobs": self._chat_logprobs(gen, True) if req.logprobs else None,
            }
            for i, (gen, reply) in enumerate(zip(gens, replies, strict=True))
        ]
        completion = sum(len(g.tokens) for g in gens)
        return self.generator.envelope("chat.completion", choices, prompt_len, completion)

    def _reply(self, plan: ChatPlan, gen: Generation, skip_special: bool) -> Reply:
        text = plan.prefix + self.generator.decode(
            self.generator.visible(gen.tokens, True), skip_special
        )
        return self._read(plan, cut(text, plan.stops), gen.finish_reason)

    async def _stream_start(
        self, req: ChatRequest, plan: ChatPlan, session_id: str | None
    ) -> tuple[RecordedSession | None, list[int]]:
        """The session a streamed turn records into, its errors found by a dry run (so they
        are HTTP errors, before the first byte); without one, the turn's prompt."""
        if not session_id:
            return None, self._prompt(plan)
        session = self._session(session_id, req)
        async with session.lock:
            mark = session.transcript.mark()
            try:
                self._open_turn(session, session_id, plan)
            finally:
                session.transcript.rollback(mark)
        return session, []

    async def _chat_stream(
        self, req: ChatRequest, plan: ChatPlan, session_id: str | None
    ) -> AsyncIterator[str]:
        """Validate what can fail before the first byte (an HTTP error), then stream."""
        self.generator.check_capacity(req.n)
        session, prompt = await self._stream_start(req, plan, session_id)
        header = ChunkHeader("chat.completion.chunk", self.engine)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def one(index: int, counts: list[tuple[int, int]]) -> AsyncGenerator[Chunks, None]:
            """Choice `index`'s chunks (the role's goes out with the first content, the last
            content with the finish: one write each); its (prompt, completion) tokens into
            `counts` before its last."""
            nonlocal prompt
            decoder = Decoder(
                self.generator, plan.prefix, plan.stops, plan.parser, req.skip_special_tokens
            )
            out = [header.chat(index, {"role": "assistant", "content": ""})]
            lock = session.lock if session else contextlib.nullcontext()
            async with lock:  # type: ignore[attr-defined]
                mark = session.transcript.mark() if session else None
                try:
                    if session is not None:
                        assert session_id is not None
                        prompt = self._open_turn(session, session_id, plan)
                    sampling = self.generator.sampling(req, plan.max_tokens, index)
                    pieces: list[Generation] = []
                    shown = lambda: decoder.sent > 0  # noqa: E731  (the client has some text)
                    async for piece in self.generator.stream(prompt, sampling, shown):
                        pieces.append(piece)
                        final = bool(piece.finish_reason)
                        content = decoder.add(piece.tokens, final)
                        logprobs = None
                        if req.logprobs and piece.tokens:
                            logprobs = self._chat_logprobs(piece, final)
                        if content or logprobs:
                            delta = {"content": content} if content else {}
                            out.append(header.chat(index, delta, logprobs=logprobs))
                        if not final and (content or logprobs):  # the role waits for them
                            yield out
                            out = []
                except BaseException:
                    if session is not None and mark is not None:
                        session.transcript.rollback(mark)
                    raise
                gen = joined(pieces)
                reply = self._read(plan, decoder.text(), gen.finish_reason)
                rest = decoder.rest(reply)
                if rest:
                    out.append(header.chat(index, {"content": rest}))
                if reply.calls:
                    calls = [c.openai(index=k) for k, c in enumerate(reply.calls)]
                    out.append(header.chat(index, {"tool_calls": calls}))
                if session is not None:
                    self._close_turn(session, plan, gen, reply)
            counts.append(((len(prompt) if index == 0 else 0), len(gen.tokens)))  # one prompt
            yield Last([*out, header.chat(index, {}, finish=reply.finish_reason)])

        return sse(one, req.n, header, include_usage)

    def models(self) -> ModelList:
        """The policy (with its version) and every adapter served on it."""
        engine = self.engine
        policy = ModelCard(id=engine.model_name, policy_version=engine.version)
        adapters = [ModelCard(id=name, parent=engine.model_name) for name in engine.adapters()]
        return ModelList(data=[policy, *adapters])

    # -- played episodes (env-gateway `Play`) -------------------------------------------
    def open_played(self, session_id: str, transcript: Transcript) -> None:
        """Record the chat completions of a played episode into its `transcript`."""
        self.recorder.sessions[session_id] = RecordedSession(transcript)

    def close_played(self, session_id: str) -> int:
        """Forget a played episode's session; its number of turns."""
        session = self.recorder.sessions.pop(session_id, None)
        return session.turns if session else 0

    async def played(
        self, session_id: str, method: str, path: str, body: bytes, run: PlayedSampling
    ) -> tuple[int, str, bytes]:
        """One model call of a played episode's env, answered as HTTP would be: (status,
        content type, body). Only chat completions reach the policy (every turn recorded in
        the episode's session); the run's sampling replaces the request's: `temperature`,
        `top_p` and `seed` are the run's, `max_tokens` at most the run's, `model` the
        policy."""
        try:
            if method != "POST" or path.rstrip("/") != "/v1/chat/completions":
                raise OpenAIError(
                    404,
                    f"{method} {path}: a played episode reaches the policy through "
                    "POST /v1/chat/completions only",
                    code="not_found",
                )
            try:
                req = ChatRequest.model_validate_json(body)
            except ValidationError as exc:
                raise invalid_openai_request(exc.errors()) from exc
            asked = req.max_completion_tokens or req.max_tokens or run.max_tokens
            req = req.model_copy(
                update={
                    "model": run.model or self.engine.model_name,
                    "temperature": run.temperature,
                    "top_p": run.top_p,
                    "seed": run.seed,
                    "max_tokens": min(asked, run.max_tokens),
                    "max_completion_tokens": None,
                }
            )
            result = await self.chat(req, session_id)
        except OpenAIError as exc:
            return exc.status, "application/json", json.dumps(exc.body()).encode()
        if isinstance(result, dict):
            return 200, "application/json", json.dumps(result).encode()
        return 200, "text/event-stream", "".join([event async for event in result]).encode()


def session_free_prompt(tokenizer, messages: list[dict]) -> list[int]:
    text = render(tokenizer, messages)
    return encode(tokenizer, text)
