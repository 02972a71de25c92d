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

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated

from fastapi import Path

from treadle_common import names
from treadle_common.api.rollout import ModelCard, ModelList
from treadle_rollout.agent_sessions import AgentSessions
from treadle_rollout.chat import (
    SESSION_HEADER,
    ChatPlan,
    ChatTurns,
    RecordedSession,
    SessionRecorder,
)
from treadle_rollout.completions import CompletionsAPI
from treadle_rollout.engines.base import Engine, Generation
from treadle_rollout.gate import RequestGate
from treadle_rollout.generation import PolicyGenerator
from treadle_rollout.openai_stream import ChunkHeader, Chunks, Decoder, Last, joined, sse
from treadle_rollout.openai_types import ChatRequest, CompletionRequest
from treadle_rollout.quota_gate import QuotaGate

__all__ = ["SESSION_HEADER", "OpenAIFrontend", "SessionId"]

SessionId = Annotated[
    str, Path(pattern=names.NAME_PATTERN, max_length=names.NAME_MAX, description="A session id")
]


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
        self.turns = ChatTurns(self.generator, recorder, tool_parser)
        """The chat core: plans, records and reads back every chat turn."""

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

    async def chat(self, req: ChatRequest, session_id: str | None) -> dict | AsyncIterator[str]:
        """`POST /v1/chat/completions`: a chat turn (recorded when `session_id` names a
        session) as OpenAI's chat completion, or its stream of chunks."""
        self.generator.check(req)
        plan = self.turns.plan(req)
        if req.stream:
            return await self._chat_stream(req, plan, session_id)
        prompt_len, gens, replies = await self.turns.complete(req, plan, session_id)
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

    async def _stream_start(
        self, req: ChatRequest, plan: ChatPlan, session_id: str | None
    ) -> tuple[RecordedSession | None, list[int]]:
        """The session a streamed turn records into, its errors found by a dry run (so they
        are HTTP errors, before the first byte); without one, the turn's prompt."""
        if not session_id:
            return None, self.turns.prompt(plan)
        session = self.turns.session(session_id, req)
        async with session.lock:
            mark = session.transcript.mark()
            try:
                self.turns.open_turn(session, session_id, plan)
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
                        prompt = self.turns.open_turn(session, session_id, plan)
                    sampling = self.generator.sampling(req, plan.max_tokens, index, plan.grammar)
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
                reply = self.turns.read(plan, decoder.text(), gen.finish_reason)
                rest = decoder.rest(reply)
                if rest:
                    out.append(header.chat(index, {"content": rest}))
                if reply.calls:
                    calls = [c.openai(index=k) for k, c in enumerate(reply.calls)]
                    out.append(header.chat(index, {"tool_calls": calls}))
                if session is not None:
                    self.turns.close_turn(session, plan, gen, reply)
            counts.append(((len(prompt) if index == 0 else 0), len(gen.tokens)))  # one prompt
            yield Last([*out, header.chat(index, {}, finish=reply.finish_reason)])

        return sse(one, req.n, header, include_usage)

    def models(self) -> ModelList:
        """The policy (with its version) and every adapter served on it."""
        engine = self.engine
        policy = ModelCard(id=engine.model_name, policy_version=engine.version)
        adapters = [ModelCard(id=name, parent=engine.model_name) for name in engine.adapters()]
        return ModelList(data=[policy, *adapters])
