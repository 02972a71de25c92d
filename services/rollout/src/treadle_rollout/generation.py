"""The policy as the OpenAI-compatible API reaches it (`PolicyGenerator`): which model a
request may name, room in the context, admission (`gate.py`) and tenants' quotas
(`quota_gate.py`), one generation or a stream of pieces paced for the client, and the pieces
every answer shares (logprob entries, the envelope). The chat API (`openai_api.py`) and the
completions API (`completions.py`) both generate through it."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

from treadle_rollout.engines.base import ContextOverflow, Engine, Generation, Sampling
from treadle_rollout.errors import OpenAIError
from treadle_rollout.gate import Busy, RequestGate
from treadle_rollout.openai_stream import joined, usage
from treadle_rollout.openai_types import ChatRequest, CompletionRequest, SamplingFields
from treadle_rollout.quota_gate import QuotaGate

DEFAULT_MAX_TOKENS = 1024


@contextlib.contextmanager
def refusals_as_openai_errors() -> Iterator[None]:
    """The engine's and the gate's refusals as OpenAI answers them: too busy (429), a prompt
    with no room left in the context (400)."""
    try:
        yield
    except Busy as exc:
        raise OpenAIError(429, str(exc), code="rate_limit_exceeded") from exc
    except ContextOverflow as exc:
        raise OpenAIError(400, str(exc), param="messages", code="context_length_exceeded") from exc


class PolicyGenerator:
    def __init__(
        self,
        engine: Engine,
        tokenizer,
        gate: RequestGate,
        quota: QuotaGate,
        stream_interval_s: float = 0.0,
        stream_events_per_s: float = 0.0,
    ):
        self.engine, self.tokenizer, self.gate, self.quota = engine, tokenizer, gate, quota
        self.stream_interval_s = stream_interval_s
        self.stream_events_per_s = stream_events_per_s
        self.open_streams = 0
        self.eos_id = tokenizer.eos_token_id

    # -- checks ---------------------------------------------------------------------------
    def check(self, req: SamplingFields) -> None:
        if req.model != self.engine.model_name and req.model not in self.engine.adapters():
            raise OpenAIError(
                404,
                f"The model `{req.model}` does not exist; this server serves "
                f"`{self.engine.model_name}` and its adapters {self.engine.adapters()}",
                param="model",
                code="model_not_found",
            )
        req.unsupported()

    def check_room(self, prompt_len: int) -> None:
        limit = getattr(self.engine, "max_context", None)
        if isinstance(limit, int) and prompt_len >= limit:
            raise OpenAIError(
                400,
                f"prompt of {prompt_len} tokens leaves no room in the {limit}-token context",
                param="messages",
                code="context_length_exceeded",
            )

    def check_capacity(self, requests: int) -> None:
        try:
            self.gate.check(requests)
        except Busy as exc:
            raise OpenAIError(429, str(exc), code="rate_limit_exceeded") from exc

    def sampling(
        self, req: SamplingFields, max_tokens: int | None, index: int, grammar: str | None = None
    ) -> Sampling:
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
            stream_interval_s=self.interval(1) if req.stream else 0.0,
            grammar=grammar,
        )

    # -- generation -----------------------------------------------------------------------
    async def generate(self, prompt: list[int], sampling: Sampling) -> Generation:
        with refusals_as_openai_errors():
            async with self.quota.generation() as counted:
                with self.gate.admit():
                    gen = await self.engine.generate(prompt, sampling)
                counted[0] = len(gen.tokens)
                return gen

    def interval(self, starting: int = 0) -> float:
        """A stream's interval now: the configured one, longer when so many streams are open
        (with `starting` about to open) that together they would send more than
        `stream_events_per_s` events a second."""
        if self.stream_events_per_s <= 0:
            return self.stream_interval_s
        return max(
            self.stream_interval_s, (self.open_streams + starting) / self.stream_events_per_s
        )

    async def stream(
        self, prompt: list[int], sampling: Sampling, shown: Callable[[], bool]
    ) -> AsyncIterator[Generation]:
        """The engine's pieces, joined so that at most one goes out per stream interval
        (the last at once, and every piece until `shown()`: the client has some text)."""
        self.open_streams += 1
        try:
            with refusals_as_openai_errors():
                async with self.quota.generation() as counted, contextlib.AsyncExitStack() as stack:
                    stack.enter_context(self.gate.admit())
                    held: list[Generation] = []
                    last = -1e9
                    async with contextlib.aclosing(self.engine.stream(prompt, sampling)) as pieces:
                        async for piece in pieces:
                            counted[0] += len(piece.tokens)
                            held.append(piece)
                            now = time.monotonic()
                            interval = self.interval() if shown() else 0.0
                            if piece.finish_reason or now - last >= interval:
                                yield held[0] if len(held) == 1 else joined(held)
                                held, last = [], now
        finally:
            self.open_streams -= 1

    def visible(self, tokens: list[int], finished: bool) -> list[int]:
        """Generated tokens without the end-of-turn token (what the client sees)."""
        if finished and tokens and tokens[-1] == self.eos_id:
            return tokens[:-1]
        return tokens

    def decode(self, tokens: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special)

    def token_entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
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

    def envelope(self, kind: str, choices: list[dict], prompt_len: int, completion: int) -> dict:
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.engine.model_name,
            "system_fingerprint": f"treadle-v{self.engine.version}",
            "choices": choices,
            "usage": usage(prompt_len, completion),
        }
