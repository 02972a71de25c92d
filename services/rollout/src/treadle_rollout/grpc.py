"""gRPC `treadle.v1.Generation`: token-level generation with the current policy (tools,
benchmarks; episodes go through the task stream)."""

from __future__ import annotations

import grpc

from treadle_common.proto.treadle.v1 import generation_pb2 as gpb
from treadle_common.proto.treadle.v1 import generation_pb2_grpc
from treadle_rollout.engines.base import ContextOverflow, Engine, Sampling


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Generate(self, request: gpb.GenerateRequest, context):
        s = request.sampling
        sampling = Sampling(
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            max_new_tokens=s.max_new_tokens or 16,
            seed=s.seed or None,  # proto3: 0 = unseeded
        )
        try:
            gen = await self.engine.generate(list(request.prompt_tokens), sampling)
        except ContextOverflow as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return gpb.GenerateResult(
            request_id=request.request_id,
            tokens=gen.tokens,
            logprobs=gen.logprobs,
            token_versions=gen.versions,
            finish_reason=gen.finish_reason,
        )
