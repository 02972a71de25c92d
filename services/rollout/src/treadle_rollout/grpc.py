"""gRPC `treadle.v1.Generation`: token-level generation with the current policy (tools,
benchmarks; episodes go through the task stream)."""

from __future__ import annotations

import grpc

from treadle_common.auth import policy as auth
from treadle_common.proto.treadle.v1 import generation_pb2 as gpb
from treadle_common.proto.treadle.v1 import generation_pb2_grpc
from treadle_rollout.engines.base import ContextOverflow, Engine, Sampling
from treadle_rollout.gate import Busy, RequestGate

POLICY = auth.grpc_policy(gpb, "Generation", Generate=auth.WORKERS | {auth.Role.agent})
"""Raw generation with the current policy: the loop's services and agents."""


def bad_prompt(tokens: list[int], vocab_size: int) -> str | None:
    """Why `tokens` cannot be a prompt (empty, or an id outside the vocabulary), or None."""
    if not tokens:
        return "prompt_tokens is empty"
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})"
    return None


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine, gate: RequestGate | None = None):
        self.engine = engine
        self.gate = gate or RequestGate(1 << 30)

    async def Generate(self, request: gpb.GenerateRequest, context):
        problem = bad_prompt(list(request.prompt_tokens), len(self.engine.tokenizer))
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        s = request.sampling
        sampling = Sampling(
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            max_new_tokens=s.max_new_tokens or 16,
            seed=s.seed or None,  # proto3: 0 = unseeded
        )
        try:
            with self.gate.admit():
                gen = await self.engine.generate(list(request.prompt_tokens), sampling)
        except ContextOverflow as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Busy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return gpb.GenerateResult(
            request_id=request.request_id,
            tokens=gen.tokens,
            logprobs=gen.logprobs,
            token_versions=gen.versions,
            finish_reason=gen.finish_reason,
        )
