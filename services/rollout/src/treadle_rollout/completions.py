"""`POST /v1/completions`: prompts (text or token ids, one or a batch), `n` samples each, all
handed to the engine at once (one prefill per distinct prompt), logprobs in OpenAI's
completions format, streamed or not. Generation goes through `generation.PolicyGenerator`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

from treadle_rollout.engines.base import Generation
from treadle_rollout.errors import OpenAIError
from treadle_rollout.generation import PolicyGenerator
from treadle_rollout.openai_stream import ChunkHeader, Chunks, Decoder, Last, cut, sse
from treadle_rollout.openai_types import CompletionRequest
from treadle_rollout.transcript import encode

MAX_GENERATIONS = 256
"""Generations one completions request may ask for (prompts x n)."""


class CompletionsAPI:
    def __init__(self, generator: PolicyGenerator):
        self.generator = generator

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        """The request's prompts as token ids: a string, token ids, or a batch of either."""
        raw = req.prompt
        batch = raw if isinstance(raw, list) and raw and isinstance(raw[0], list | str) else [raw]
        prompts: list[list[int]] = []
        for p in batch:
            if isinstance(p, str):
                p = encode(self.generator.tokenizer, p)
            prompts.append(cast(list[int], p))
        if not all(prompts):
            raise OpenAIError(400, "prompt is empty", param="prompt")
        vocab = len(self.generator.tokenizer)
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
            tokens = self.generator.visible(gen.tokens, finished)
            shown = [self.generator.tokenizer.decode([t]) for t in tokens]
        top = None
        if req.logprobs:
            top = [
                {
                    (
                        f"token_id:{tid}"
                        if req.return_tokens_as_token_ids
                        else self.generator.tokenizer.decode([tid])
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
        self.generator.check(req)
        prompts = self._prompts(req)
        for p in prompts:
            self.generator.check_room(len(p))
        stops = req.stop_strings()
        if req.stream:
            return self._completions_stream(req, prompts)
        gens = await asyncio.gather(
            *(
                self.generator.generate(prompt, self.generator.sampling(req, req.max_tokens, i))
                for prompt in prompts
                for i in range(req.n)
            )
        )
        choices = []
        for i, gen in enumerate(gens):
            text = self.generator.decode(
                self.generator.visible(gen.tokens, True), req.skip_special_tokens
            )
            choices.append(
                {
                    "index": i,
                    "text": cut(text, stops),
                    "finish_reason": gen.finish_reason,
                    "logprobs": self._completion_logprobs(req, gen, True),
                }
            )
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(g.tokens) for g in gens)
        return self.generator.envelope("text_completion", choices, prompt_tokens, completion)

    def _completions_stream(
        self, req: CompletionRequest, prompts: list[list[int]]
    ) -> AsyncIterator[str]:
        self.generator.check_capacity(len(prompts) * req.n)
        header = ChunkHeader("text_completion", self.generator.engine)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def one(index: int, counts: list[tuple[int, int]]) -> AsyncGenerator[Chunks, None]:
            prompt = prompts[index // req.n]
            decoder = Decoder(self.generator, "", req.stop_strings(), None, req.skip_special_tokens)
            sampling = self.generator.sampling(req, req.max_tokens, index % req.n)
            finish, count = "length", 0
            out: list[str] = []
            shown = lambda: decoder.sent > 0  # noqa: E731  (the client has some text)
            async for piece in self.generator.stream(prompt, sampling, shown):
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
            yield Last([*out, header.text(index, "", None, finish=finish)])

        return sse(one, len(prompts) * req.n, header, include_usage)
