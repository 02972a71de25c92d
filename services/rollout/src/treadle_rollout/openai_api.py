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
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, cast

from fastapi import Path
from pydantic import ValidationError

from treadle_common import auth, names
from treadle_common.api.rollout import (
    ModelCard,
    ModelList,
)
from treadle_rollout import metrics, tool_calls
from treadle_rollout.agent_sessions import AgentSessions
from treadle_rollout.engines.base import ContextOverflow, Engine, Generation, Sampling
from treadle_rollout.errors import OpenAIError, invalid_openai_request
from treadle_rollout.gate import Busy, RequestGate
from treadle_rollout.openai_types import (
    ChatRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from treadle_rollout.quota_gate import QuotaGate
from treadle_rollout.sse import Final
from treadle_rollout.transcript import TemplateNotPrefixStable, Transcript, encode, opening, render

SESSION_HEADER = "X-Treadle-Session"
MAX_GENERATIONS = 256
"""Generations one completions request may ask for (prompts x n)."""
SessionId = Annotated[
    str, Path(pattern=names.NAME_PATTERN, max_length=names.NAME_MAX, description="A session id")
]
DEFAULT_MAX_TOKENS = 1024


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


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


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
        self.stream_interval_s = stream_interval_ms / 1e3
        self.stream_events_per_s = stream_events_per_s
        self.open_streams = 0
        self.engine = engine
        self.gate = gate or RequestGate(1 << 30)
        self.quota = quota or QuotaGate()
        self.tokenizer = recorder.tokenizer
        self.recorder = recorder
        self.sessions = AgentSessions(recorder, redis, reward)
        """The recorded sessions' own API: issue, finish, info, discard."""
        self.eos_id = self.tokenizer.eos_token_id
        self.tool_parser = tool_calls.for_model(
            tool_parser, getattr(self.tokenizer, "chat_template", None)
        )

    # -- checks ---------------------------------------------------------------------------
    def _check(self, req: SamplingFields) -> None:
        if req.model != self.engine.model_name and req.model not in self.engine.adapters():
            raise OpenAIError(
                404,
                f"The model `{req.model}` does not exist; this server serves "
                f"`{self.engine.model_name}` and its adapters {self.engine.adapters()}",
                param="model",
                code="model_not_found",
            )
        req.unsupported()

    def _check_room(self, prompt_len: int) -> None:
        limit = getattr(self.engine, "max_context", None)
        if isinstance(limit, int) and prompt_len >= limit:
            raise OpenAIError(
                400,
                f"prompt of {prompt_len} tokens leaves no room in the {limit}-token context",
                param="messages",
                code="context_length_exceeded",
            )

    def _check_capacity(self, requests: int) -> None:
        try:
            self.gate.check(requests)
        except Busy as exc:
            raise OpenAIError(429, str(exc), code="rate_limit_exceeded") from exc

    def _sampling(self, req: SamplingFields, max_tokens: int | None, index: int) -> Sampling:
        seed = None if req.seed is None else req.seed + index
        top = 0
        if isinstance(req, ChatRequest) and req.logprobs:
            top = req.top_logprobs or 0
        elif isinstance(req, CompletionRequest) and req.logprobs:
            top = req.logprobs
        return Sampling(
            req.temperature,
            req.top_p,
            max_tokens or DEFAULT_MAX_TOKENS,
            seed,
            adapter=None if req.model == self.engine.model_name else req.model,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            stop_strings=req.stop_strings(),
            top_logprobs=top,
            stream_interval_s=self._interval(1) if req.stream else 0.0,
        )

    # -- generation -----------------------------------------------------------------------
    async def _generate(self, prompt: list[int], sampling: Sampling) -> Generation:
        try:
            async with self.quota.generation() as counted:
                with self.gate.admit():
                    gen = await self.engine.generate(prompt, sampling)
                counted[0] = len(gen.tokens)
                return gen
        except Busy as exc:
            raise OpenAIError(429, str(exc), code="rate_limit_exceeded") from exc
        except ContextOverflow as exc:
            raise OpenAIError(
                400, str(exc), param="messages", code="context_length_exceeded"
            ) from exc

    def _interval(self, starting: int = 0) -> float:
        """A stream's interval now: the configured one, longer when so many streams are open
        (with `starting` about to open) that together they would send more than
        `stream_events_per_s` events a second."""
        if self.stream_events_per_s <= 0:
            return self.stream_interval_s
        return max(
            self.stream_interval_s, (self.open_streams + starting) / self.stream_events_per_s
        )

    async def _stream(
        self, prompt: list[int], sampling: Sampling, shown: Callable[[], bool]
    ) -> AsyncIterator[Generation]:
        """The engine's pieces, joined so that at most one goes out per stream interval
        (the last at once, and every piece until `shown()`: the client has some text)."""
        self.open_streams += 1
        try:
            async with self.quota.generation() as counted, contextlib.AsyncExitStack() as stack:
                stack.enter_context(self.gate.admit())
                held: list[Generation] = []
                last = -1e9
                async with contextlib.aclosing(self.engine.stream(prompt, sampling)) as pieces:
                    async for piece in pieces:
                        counted[0] += len(piece.tokens)
                        held.append(piece)
                        now = time.monotonic()
                        interval = self._interval() if shown() else 0.0
                        if piece.finish_reason or now - last >= interval:
                            yield held[0] if len(held) == 1 else _joined(held)
                            held, last = [], now
        except Busy as exc:
            raise OpenAIError(429, str(exc), code="rate_limit_exceeded") from exc
        except ContextOverflow as exc:
            raise OpenAIError(
                400, str(exc), param="messages", code="context_length_exceeded"
            ) from exc
        finally:
            self.open_streams -= 1

    def _visible(self, tokens: list[int], finished: bool) -> list[int]:
        """Generated tokens without the end-of-turn token (what the client sees)."""
        if finished and tokens and tokens[-1] == self.eos_id:
            return tokens[:-1]
        return tokens

    def _decode(self, tokens: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special)

    def _token_entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        text = self.tokenizer.decode([token])
        return {
            "token": text,
            "logprob": logprob,
            "bytes": list(text.encode()),
            "top_logprobs": [
                {
                    "token": (t := self.tokenizer.decode([tid])),
                    "logprob": lp,
                    "bytes": list(t.encode()),
                }
                for tid, lp in top
            ],
        }

    def _chat_logprobs(self, gen: Generation, finished: bool) -> dict:
        tokens = self._visible(gen.tokens, finished)
        tops = gen.top_logprobs or [[] for _ in gen.tokens]
        return {
            "content": [
                self._token_entry(t, lp, top)
                for t, lp, top in zip(tokens, gen.logprobs, tops, strict=False)
            ]
        }

    def _envelope(self, kind: str, choices: list[dict], prompt_len: int, completion: int) -> dict:
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.engine.model_name,
            "system_fingerprint": f"treadle-v{self.engine.version}",
            "choices": choices,
            "usage": _usage(prompt_len, completion),
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
        self._check_room(len(t.tokens))
        return list(t.tokens)

    def _prompt(self, plan: ChatPlan) -> list[int]:
        prompt = list(opening(self.tokenizer, plan.messages, plan.tools, plan.prefix)[1])
        self._check_room(len(prompt))
        return prompt

    def _close_turn(self, session: RecordedSession, plan: ChatPlan, gen: Generation, reply: Reply):
        session.transcript.add_generation(gen, plan.prefix)
        session.transcript.record_reply(reply.message())
        session.turns += 1

    async def chat(self, req: ChatRequest, session_id: str | None) -> dict | AsyncIterator[str]:
        self._check(req)
        plan = self._plan(req)
        if req.stream:
            return await self._chat_stream(req, plan, session_id)
        if session_id:
            session = self._session(session_id, req)
            async with session.lock:
                mark = session.transcript.mark()
                try:
                    prompt = self._open_turn(session, session_id, plan)
                    gens = [await self._generate(prompt, self._sampling(req, plan.max_tokens, 0))]
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
                    self._generate(prompt, self._sampling(req, plan.max_tokens, i))
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
        return self._envelope("chat.completion", choices, prompt_len, completion)

    def _reply(self, plan: ChatPlan, gen: Generation, skip_special: bool) -> Reply:
        text = plan.prefix + self._decode(self._visible(gen.tokens, True), skip_special)
        return self._read(plan, _cut(text, plan.stops), gen.finish_reason)

    async def _chat_stream(
        self, req: ChatRequest, plan: ChatPlan, session_id: str | None
    ) -> AsyncIterator[str]:
        """Validate what can fail before the first byte (an HTTP error), then stream."""
        self._check_capacity(req.n)
        session = None
        if session_id:
            session = self._session(session_id, req)
            async with session.lock:  # a dry run: the session's errors as HTTP errors
                mark = session.transcript.mark()
                try:
                    self._open_turn(session, session_id, plan)
                finally:
                    session.transcript.rollback(mark)
            prompt: list[int] = []
        else:
            prompt = self._prompt(plan)
        header = _ChunkHeader("chat.completion.chunk", self.engine)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def one(index: int, counts: list[tuple[int, int]]) -> AsyncGenerator[_Chunks, None]:
            """Choice `index`'s chunks (the role's goes out with the first content, the last
            content with the finish: one write each); its (prompt, completion) tokens into
            `counts` before its last."""
            nonlocal prompt
            decoder = _Decoder(self, plan.prefix, plan.stops, plan.parser, req.skip_special_tokens)
            out = [header.chat(index, {"role": "assistant", "content": ""})]
            lock = session.lock if session else contextlib.nullcontext()
            async with lock:  # type: ignore[attr-defined]
                mark = session.transcript.mark() if session else None
                try:
                    if session is not None:
                        assert session_id is not None
                        prompt = self._open_turn(session, session_id, plan)
                    sampling = self._sampling(req, plan.max_tokens, index)
                    pieces: list[Generation] = []
                    shown = lambda: decoder.sent > 0  # noqa: E731  (the client has some text)
                    async for piece in self._stream(prompt, sampling, shown):
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
                gen = _joined(pieces)
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
            yield _Last([*out, header.chat(index, {}, finish=reply.finish_reason)])

        return _sse(one, req.n, header, include_usage)

    # -- completions ----------------------------------------------------------------------
    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        """The request's prompts as token ids: a string, token ids, or a batch of either."""
        raw = req.prompt
        batch = raw if isinstance(raw, list) and raw and isinstance(raw[0], list | str) else [raw]
        prompts: list[list[int]] = []
        for p in batch:
            if isinstance(p, str):
                p = encode(self.tokenizer, p)
            prompts.append(cast(list[int], p))
        if not all(prompts):
            raise OpenAIError(400, "prompt is empty", param="prompt")
        vocab = len(self.tokenizer)
        if any(t >= vocab for p in prompts for t in p):
            raise OpenAIError(400, f"prompt: token ids must be in 0..{vocab - 1}", param="prompt")
        if len(prompts) * req.n > MAX_GENERATIONS:
            raise OpenAIError(
                400,
                f"{len(prompts)} prompts x n={req.n} asks for more than {MAX_GENERATIONS} "
                "generations in one request",
                param="n",
            )
        return prompts

    def _completion_logprobs(self, req: CompletionRequest, gen: Generation, finished: bool):
        if req.logprobs is None:
            return None
        if req.return_tokens_as_token_ids:  # every token, end-of-turn included
            tokens = gen.tokens
            shown = [f"token_id:{t}" for t in tokens]
        else:
            tokens = self._visible(gen.tokens, finished)
            shown = [self.tokenizer.decode([t]) for t in tokens]
        top = None
        if req.logprobs:
            top = [
                {
                    (
                        f"token_id:{tid}"
                        if req.return_tokens_as_token_ids
                        else self.tokenizer.decode([tid])
                    ): lp
                    for tid, lp in step
                }
                for step in gen.top_logprobs[: len(tokens)]
            ]
        return {
            "tokens": shown,
            "token_logprobs": gen.logprobs[: len(tokens)],
            "top_logprobs": top,
            "text_offset": None,
        }

    async def completions(self, req: CompletionRequest) -> dict | AsyncIterator[str]:
        """Every prompt of the batch `n` times, all handed to the engine at once (one prefill
        per distinct prompt); choice `index` = prompt index x n + sample index, as OpenAI."""
        self._check(req)
        prompts = self._prompts(req)
        for p in prompts:
            self._check_room(len(p))
        stops = req.stop_strings()
        if req.stream:
            return self._completions_stream(req, prompts)
        gens = await asyncio.gather(
            *(
                self._generate(prompt, self._sampling(req, req.max_tokens, i))
                for prompt in prompts
                for i in range(req.n)
            )
        )
        choices = []
        for i, gen in enumerate(gens):
            text = self._decode(self._visible(gen.tokens, True), req.skip_special_tokens)
            choices.append(
                {
                    "index": i,
                    "text": _cut(text, stops),
                    "finish_reason": gen.finish_reason,
                    "logprobs": self._completion_logprobs(req, gen, True),
                }
            )
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(g.tokens) for g in gens)
        return self._envelope("text_completion", choices, prompt_tokens, completion)

    def _completions_stream(
        self, req: CompletionRequest, prompts: list[list[int]]
    ) -> AsyncIterator[str]:
        self._check_capacity(len(prompts) * req.n)
        header = _ChunkHeader("text_completion", self.engine)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def one(index: int, counts: list[tuple[int, int]]) -> AsyncGenerator[_Chunks, None]:
            prompt = prompts[index // req.n]
            decoder = _Decoder(self, "", req.stop_strings(), None, req.skip_special_tokens)
            sampling = self._sampling(req, req.max_tokens, index % req.n)
            finish, count = "length", 0
            out: list[str] = []
            shown = lambda: decoder.sent > 0  # noqa: E731  (the client has some text)
            async for piece in self._stream(prompt, sampling, shown):
                final = bool(piece.finish_reason)
                count += len(piece.tokens)
                text = decoder.add(piece.tokens, final)
                if final:
                    text += decoder.rest(None)
                    finish = piece.finish_reason
                logprobs = self._completion_logprobs(req, piece, final)
                if text or logprobs:
                    out.append(header.text(index, text, logprobs))
                if not final and out:
                    yield out
                    out = []
            counts.append(((len(prompt) if index % req.n == 0 else 0), count))
            yield _Last([*out, header.text(index, "", None, finish=finish)])

        return _sse(one, len(prompts) * req.n, header, include_usage)

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


def _cut(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first stop string (OpenAI returns the text before it)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def session_free_prompt(tokenizer, messages: list[dict]) -> list[int]:
    text = render(tokenizer, messages)
    return encode(tokenizer, text)


def _joined(pieces: list[Generation]) -> Generation:
    return Generation(
        [t for p in pieces for t in p.tokens],
        [x for p in pieces for x in p.logprobs],
        [v for p in pieces for v in p.versions],
        pieces[-1].finish_reason if pieces else "length",
        [t for p in pieces for t in p.top_logprobs],
    )


class _Decoder:
    """One streamed choice's text: what may be sent so far, and the rest at the end.

    Held back: an incomplete UTF-8 character, the last characters that may begin a stop
    string, and everything from where a tool call may begin (sent, parsed, at the end)."""

    def __init__(self, frontend: OpenAIFrontend, prefix: str, stops, parser, skip_special):
        self.frontend, self.prefix, self.stops, self.parser = frontend, prefix, stops, parser
        self.skip_special = skip_special
        self.tokens: list[int] = []
        self.final = False
        self.sent = 0
        """Characters of the text already sent."""

    def text(self) -> str:
        """The whole text so far (after the prefix), cut at a stop string."""
        body = self.frontend._decode(
            self.frontend._visible(self.tokens, self.final), self.skip_special
        )
        return _cut(self.prefix + body, self.stops)

    def add(self, tokens: list[int], final: bool) -> str:
        """Take new tokens; the text that may be sent now."""
        self.tokens += tokens
        self.final = final
        text = self.text()
        limit = len(text)
        if not final:
            limit = len(text.rstrip("\ufffd"))
            if self.stops:
                limit = min(limit, len(text) - max(len(s) for s in self.stops) + 1)
        if self.parser is not None:
            start = self.parser.start
            at = text.find(start)
            if at >= 0:
                limit = min(limit, at)
            elif not final:
                for k in range(len(start) - 1, 0, -1):
                    if text.endswith(start[:k]):
                        limit = min(limit, len(text) - k)
                        break
            if final:
                return ""  # the end is read as a whole (`rest`)
        if limit <= self.sent:
            return ""
        out, self.sent = text[self.sent : limit], limit
        return out

    def rest(self, reply: Reply | None) -> str:
        """At the end: the text not yet sent (with tool calls: their content only)."""
        text = self.text()
        if reply is not None and reply.calls:
            text = reply.content or ""
        if len(text) <= self.sent:
            return ""
        out, self.sent = text[self.sent :], len(text)
        return out


class _ChunkHeader:
    """Chunks of one streamed response: one id and creation time for all."""

    def __init__(self, kind: str, engine: Engine):
        prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
        self.base = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": engine.model_name,
            "system_fingerprint": f"treadle-v{engine.version}",
        }

        self._head = json.dumps(self.base)[:-1] + ', "choices": '
        """The fields every chunk shares, serialized once."""

    def _chunk(self, choices: list[dict], tail: str = "") -> str:
        return f"{self._head}{json.dumps(choices)}{tail}}}"

    def chat(self, index: int, delta: dict, *, logprobs=None, finish: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk([choice])

    def text(self, index: int, text: str, logprobs, *, finish: str | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._chunk([choice])

    def usage(self, prompt: int, completion: int) -> str:
        return self._chunk([], f', "usage": {json.dumps(_usage(prompt, completion))}')


def _event(data: dict | str) -> str:
    """One server-sent event (`data` as JSON, unless already serialized)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


_Chunks = list[str]
"""Chunks (serialized JSON) ready at the same time: they go out in one write."""


class _Last(list[str]):
    """A choice's last chunks (the one with its finish reason last)."""


async def _sse(one, count: int, header: _ChunkHeader, include_usage: bool) -> AsyncIterator[str]:
    """The chunks of `one(index, counts)` for each choice (several at once) as SSE events,
    then the usage chunk (if asked) and `[DONE]`; an error after the first event is sent as
    an error event. Chunks ready together go out together, and with one choice its last
    chunks, the usage and `[DONE]` too: each write costs the serving event loop (and the
    engine, which shares its interpreter) about as much as building the chunk. Closing the
    stream cancels the generations."""
    counts: list[tuple[int, int]] = []
    chunks: AsyncGenerator[_Chunks, None] = (
        one(0, counts) if count == 1 else _merge([one(i, counts) for i in range(count)])
    )
    held = ""
    try:
        async with contextlib.aclosing(chunks):
            async for group in chunks:
                events = "".join(_event(chunk) for chunk in group)
                if count == 1 and isinstance(group, _Last):
                    held = events  # the last: it goes out with the usage and [DONE]
                elif events:
                    yield events
    except OpenAIError as exc:
        held += _event(exc.body())
    except Exception as exc:  # the stream has begun: the error goes in it
        held += _event(OpenAIError(500, f"generation failed: {exc}", type_="server_error").body())
    else:
        if include_usage:
            held += _event(header.usage(sum(p for p, _ in counts), sum(c for _, c in counts)))
    yield Final(held + _event("[DONE]"))


async def _merge(
    generators: list[AsyncGenerator[_Chunks, None]],
) -> AsyncGenerator[_Chunks, None]:
    """Items of several async generators as they come; the first error ends it."""
    out: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(gen: AsyncGenerator[_Chunks, None]) -> None:
        try:
            async for item in gen:
                await out.put((item, None))
            await out.put((end, None))
        except Exception as exc:
            await out.put((end, exc))

    tasks = [asyncio.create_task(pump(g)) for g in generators]
    try:
        left = len(tasks)
        while left:
            item, exc = await out.get()
            if exc is not None:
                raise exc
            if item is end:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
