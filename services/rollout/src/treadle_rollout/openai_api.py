"""OpenAI-compatible API served from the current policy, with token-exact session recording.

    GET  /v1/models
    POST /v1/chat/completions        (stream is not supported: 400)
    POST /v1/completions
    GET  /v1/sessions/{id}           what a recorded session holds
    POST /v1/sessions/{id}/finish    score it and push it as a trajectory to Redis
    DELETE /v1/sessions/{id}

A chat request carrying the `X-Treadle-Session` header is recorded: the session keeps the
exact tokens the engine saw and generated (see `transcript.py`). The agent sends the whole
conversation each time, as OpenAI clients do; the new turns are appended as context tokens,
so an unmodified agent written against the OpenAI client produces a trainable trajectory.
Errors use OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from treadle_common import auth, names
from treadle_common.clients import streams
from treadle_common.proto.treadle.v1 import reward_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout.engines.base import ContextOverflow, Engine, Generation, Sampling
from treadle_rollout.gate import Busy, RequestGate
from treadle_rollout.transcript import TemplateNotPrefixStable, Transcript

SESSION_HEADER = "X-Treadle-Session"
MAX_MESSAGES = 1024
MAX_PROMPT_CHARS = 1_000_000
MAX_BATCH_PROMPTS = 64
"""Prompts one completions request may batch (OpenAI's array `prompt`)."""
MAX_GENERATIONS = 256
"""Generations one completions request may ask for (prompts x n)."""
"""Text a request may bring (a prompt, one message's content): far past any context, and
short enough that tokenizing it cannot stall the server."""
SessionId = Annotated[
    str, Path(pattern=names.NAME_PATTERN, max_length=names.NAME_MAX, description="A session id")
]
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
DEFAULT_MAX_TOKENS = 1024


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: (
        Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)]
        | None
    ) = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we ignore
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    seed: int | None = None
    stream: bool = False
    stop_token_ids: list[int] | None = Field(
        None, max_length=64, description="Tokens that also end the generation (vLLM's field)"
    )
    stop: (
        Annotated[str, Field(min_length=1, max_length=256)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=4)]
        | None
    ) = Field(None, description="Text that ends the generation; cut from the text returned")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[list[int], Field(max_length=MAX_PROMPT_CHARS)]
        | Annotated[
            list[Annotated[list[int], Field(max_length=MAX_PROMPT_CHARS)]],
            Field(min_length=1, max_length=MAX_BATCH_PROMPTS),
        ]
        | Annotated[
            list[Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]],
            Field(min_length=1, max_length=MAX_BATCH_PROMPTS),
        ]
    )
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    return_tokens_as_token_ids: bool = Field(
        False, description="Logprob tokens as `token_id:N`, end-of-turn included (token-exact)"
    )


class FinishSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_id: str = Field(
        pattern=names.ID_PATTERN,
        description="Active run whose trajectory stream receives it (names.ID_PATTERN)",
    )
    reward: float | None = Field(
        None,
        allow_inf_nan=False,
        description="The reward, if the caller computed it (not the `agent` role: an agent "
        "does not grade itself; it names a scorer)",
    )
    scorer: str | None = Field(None, description="Or: a reward-service scorer to ask")
    task_json: str = Field("{}", description="Task payload passed to the scorer")
    group_id: str | None = Field(None, description="GRPO group (defaults to the session id)")
    task_id: str | None = None


@dataclass
class RecordedSession:
    transcript: Transcript
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    turns: int = 0


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
            session = self.sessions[session_id] = RecordedSession(Transcript(self.tokenizer))
        session.last_used = now
        return session


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class OpenAIFrontend:
    def __init__(
        self,
        engine: Engine,
        recorder: SessionRecorder,
        redis=None,
        reward=None,
        gate: RequestGate | None = None,
    ):
        self.engine = engine
        self.gate = gate or RequestGate(1 << 30)
        self.tokenizer = recorder.tokenizer
        self.recorder = recorder
        self.redis = redis
        self.reward = reward
        self.eos_id = self.tokenizer.eos_token_id

    def _check(self, req: SamplingFields) -> None:
        if req.model != self.engine.model_name and req.model not in self.engine.adapters():
            raise OpenAIError(
                404,
                f"The model `{req.model}` does not exist; this server serves "
                f"`{self.engine.model_name}` and its adapters {self.engine.adapters()}",
                param="model",
                code="model_not_found",
            )
        if req.stream:
            raise OpenAIError(400, "stream=true is not supported", param="stream")

    def _sampling(self, req: SamplingFields, max_tokens: int | None, index: int) -> Sampling:
        seed = None if req.seed is None else req.seed + index
        return Sampling(
            req.temperature,
            req.top_p,
            max_tokens or DEFAULT_MAX_TOKENS,
            seed,
            adapter=None if req.model == self.engine.model_name else req.model,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            stop_strings=req.stop_strings(),
        )

    async def _generate(self, prompt: list[int], sampling: Sampling) -> Generation:
        try:
            with self.gate.admit():
                return await self.engine.generate(prompt, sampling)
        except Busy as exc:
            raise OpenAIError(429, str(exc), code="rate_limit_exceeded") from exc
        except ContextOverflow as exc:
            raise OpenAIError(
                400, str(exc), param="messages", code="context_length_exceeded"
            ) from exc

    def _visible(self, gen: Generation) -> tuple[list[int], list[float]]:
        """Generated tokens without the end-of-turn token (what the client sees)."""
        if gen.tokens and gen.tokens[-1] == self.eos_id:
            return gen.tokens[:-1], gen.logprobs[:-1]
        return gen.tokens, gen.logprobs

    def _logprobs(self, gen: Generation) -> dict:
        tokens, logprobs = self._visible(gen)
        content = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            text = self.tokenizer.decode([token])
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [],
                }
            )
        return {"content": content}

    def _envelope(self, kind: str, choices: list[dict], prompt_len: int, gens) -> dict:
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.engine.model_name,
            "system_fingerprint": f"treadle-v{self.engine.version}",
            "choices": choices,
            "usage": _usage(prompt_len, sum(len(g.tokens) for g in gens)),
        }

    async def chat(self, req: ChatRequest, session_id: str | None) -> dict:
        self._check(req)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        max_tokens = req.max_completion_tokens or req.max_tokens
        if session_id:
            if not names.valid_name(session_id):
                raise OpenAIError(
                    400,
                    f"{SESSION_HEADER} must be letters, digits, '_', '-' and single inner dots "
                    f"(at most {names.NAME_MAX})",
                    param=SESSION_HEADER,
                )
            if req.n != 1:
                raise OpenAIError(400, "recorded sessions need n=1", param="n")
            session = self.recorder.get(session_id, create=True)
            async with session.lock:
                try:
                    session.transcript.set_messages(messages)
                except TemplateNotPrefixStable as exc:
                    raise OpenAIError(
                        400,
                        f"session {session_id}: {exc}; send the conversation as recorded, or "
                        "start a new session",
                        param="messages",
                        code="session_diverged",
                    ) from exc
                prompt_len = len(session.transcript.tokens)
                gen = await self._generate(
                    session.transcript.tokens, self._sampling(req, max_tokens, 0)
                )
                session.transcript.add_generation(gen)
                session.turns += 1
            gens = [gen]
        else:
            prompt = session_free_prompt(self.tokenizer, messages)
            prompt_len = len(prompt)
            gens = await asyncio.gather(
                *(self._generate(prompt, self._sampling(req, max_tokens, i)) for i in range(req.n))
            )
        choices = []
        for i, gen in enumerate(gens):
            visible, _ = self._visible(gen)
            choices.append(
                {
                    "index": i,
                    "message": {
                        "role": "assistant",
                        "content": _cut(self.tokenizer.decode(visible), req.stop_strings()),
                    },
                    "finish_reason": gen.finish_reason,
                    "logprobs": self._logprobs(gen) if req.logprobs else None,
                }
            )
        return self._envelope("chat.completion", choices, prompt_len, gens)

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        """The request's prompts as token ids: a string, token ids, or a batch of either."""
        raw = req.prompt
        batch = raw if isinstance(raw, list) and raw and isinstance(raw[0], list | str) else [raw]
        prompts: list[list[int]] = []
        for p in batch:
            if isinstance(p, str):
                p = self.tokenizer(p, add_special_tokens=False)["input_ids"]
            prompts.append(cast(list[int], p))
        if not all(prompts):
            raise OpenAIError(400, "prompt is empty", param="prompt")
        return prompts

    async def completions(self, req: CompletionRequest) -> dict:
        """Every prompt of the batch `n` times, all handed to the engine at once (one prefill
        per distinct prompt); choice `index` = prompt index x n + sample index, as OpenAI."""
        self._check(req)
        prompts = self._prompts(req)
        if len(prompts) * req.n > MAX_GENERATIONS:
            raise OpenAIError(
                400,
                f"{len(prompts)} prompts x n={req.n} asks for more than {MAX_GENERATIONS} "
                "generations in one request",
                param="n",
            )
        gens = await asyncio.gather(
            *(
                self._generate(prompt, self._sampling(req, req.max_tokens, i))
                for prompt in prompts
                for i in range(req.n)
            )
        )
        choices = []
        for i, gen in enumerate(gens):
            visible, logprobs = self._visible(gen)
            entry: dict[str, Any] = {
                "index": i,
                "text": _cut(self.tokenizer.decode(visible), req.stop_strings()),
                "finish_reason": gen.finish_reason,
                "logprobs": None,
            }
            if req.logprobs is not None:
                if req.return_tokens_as_token_ids:  # every token, end-of-turn included
                    logprobs = gen.logprobs
                    shown = [f"token_id:{t}" for t in gen.tokens]
                else:
                    shown = [self.tokenizer.decode([t]) for t in visible]
                entry["logprobs"] = {
                    "tokens": shown,
                    "token_logprobs": logprobs,
                    "top_logprobs": None,
                    "text_offset": None,
                }
            choices.append(entry)
        prompt_tokens = sum(len(p) for p in prompts)
        return self._envelope("text_completion", choices, prompt_tokens, gens)

    async def finish(
        self, session_id: str, body: FinishSession, role: auth.Role | None = None
    ) -> dict:
        """Turn a recorded session into a trajectory in `treadle:{run}:trajectories` of an
        active run. `role`: the caller's; an `agent` must name a scorer, not a reward."""
        if body.reward is None and not body.scorer:
            raise OpenAIError(400, "give a reward or a scorer", param="reward")
        if body.reward is not None and role is auth.Role.agent:
            raise OpenAIError(
                403, "the agent role may not set its own reward: name a scorer", param="reward"
            )
        if self.redis is None:
            raise OpenAIError(503, "this replica has no Redis connection", type_="server_error")
        if not await self.redis.sismember(names.RUNS_KEY, body.run_id):
            raise OpenAIError(404, f"no active run {body.run_id!r}", param="run_id")
        session = self.recorder.get(session_id)
        async with session.lock:
            t = session.transcript
            traj = tpb.Trajectory(
                trajectory_id=uuid.uuid4().hex,
                group_id=body.group_id or session_id,
                task_id=body.task_id or session_id,
                run_id=body.run_id,
                env="openai-session",
                num_turns=session.turns,
                status=tpb.TRAJECTORY_STATUS_OK,
            )
            t.fill(traj)
            traj.timings.total_s = time.time() - session.created
            if body.reward is not None:
                traj.reward = body.reward
            else:
                traj.reward = await self._score(body, t)
            async with self.redis.pipeline(transaction=True) as pipe:
                await streams.add(pipe, names.trajectories_stream(body.run_id), traj)
                pipe.hincrby(names.run_state(body.run_id), "trajectories_produced", 1)
                await pipe.execute()
            del self.recorder.sessions[session_id]
        return {
            "trajectory_id": traj.trajectory_id,
            "run_id": body.run_id,
            "num_tokens": len(traj.tokens),
            "num_generated": sum(traj.loss_mask),
            "reward": traj.reward,
        }

    async def _score(self, body: FinishSession, t: Transcript) -> float:
        if self.reward is None:
            raise OpenAIError(503, "this replica has no reward client", type_="server_error")
        assert body.scorer is not None
        result = await self.reward.score(t.score_request(body.scorer, body.task_json))
        if result.status != reward_pb2.SCORE_STATUS_OK:
            raise OpenAIError(
                502,
                f"scorer {body.scorer}: {reward_pb2.ScoreStatus.Name(result.status)}: "
                f"{result.message}",
                type_="server_error",
            )
        return result.reward

    def info(self, session_id: str) -> dict:
        session = self.recorder.get(session_id)
        t = session.transcript
        return {
            "session_id": session_id,
            "turns": session.turns,
            "num_tokens": len(t.tokens),
            "num_generated": sum(t.loss_mask),
            "versions": sorted({v for v in t.versions if v >= 0}),
            "messages": t.messages,
        }


def _cut(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first stop string (OpenAI returns the text before it)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def session_free_prompt(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def mount(app: FastAPI, frontend: OpenAIFrontend) -> None:
    """Add the OpenAI routes and OpenAI-format errors for them to `app`."""
    router = APIRouter(tags=["openai"])

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    default_handler = app.exception_handlers.get(RequestValidationError)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        if request.url.path.startswith(OPENAI_PATHS):
            first = exc.errors()[0] if exc.errors() else {}
            param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
            return OpenAIError(
                400, f"invalid request: {first.get('msg', exc)}", param=param
            ).response()
        if default_handler is not None:
            response = default_handler(request, exc)
            return await response if inspect.isawaitable(response) else response
        return JSONResponse({"detail": exc.errors()}, status_code=422)

    @router.get("/v1/models", openapi_extra=auth.roles(auth.ANY))
    async def models() -> dict:
        engine = frontend.engine
        policy = {
            "id": engine.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "treadle",
            "policy_version": engine.version,
        }
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "treadle",
                "parent": engine.model_name,
            }
            for name in engine.adapters()
        ]
        return {"object": "list", "data": [policy, *adapters]}

    @router.post("/v1/chat/completions", openapi_extra=auth.roles(auth.AGENT))
    async def chat(req: ChatRequest, request: Request) -> dict:
        return await frontend.chat(req, request.headers.get(SESSION_HEADER))

    @router.post("/v1/completions", openapi_extra=auth.roles(auth.AGENT, auth.TRAINER))
    async def completions(req: CompletionRequest) -> dict:
        return await frontend.completions(req)

    @router.get("/v1/sessions/{session_id}", openapi_extra=auth.roles(auth.AGENT))
    async def session_info(session_id: SessionId) -> dict:
        return frontend.info(session_id)

    @router.post(
        "/v1/sessions/{session_id}/finish", openapi_extra=auth.roles(auth.AGENT | auth.WORKERS)
    )
    async def finish(session_id: SessionId, body: FinishSession, request: Request) -> dict:
        # the caller's role, as the service runtime's auth found it (none without auth)
        return await frontend.finish(session_id, body, getattr(request.state, "role", None))

    @router.delete("/v1/sessions/{session_id}", openapi_extra=auth.roles(auth.AGENT))
    async def discard(session_id: SessionId) -> dict:
        frontend.recorder.get(session_id)
        del frontend.recorder.sessions[session_id]
        return {"deleted": session_id}

    app.include_router(router)
