"""Rollout client: token-level generation over gRPC (`treadle.v1.Generation`)."""

from __future__ import annotations

import grpc

from treadle_common.proto.treadle.v1 import common_pb2, generation_pb2, generation_pb2_grpc


class GenerationClient:
    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self,
        prompt_tokens: list[int],
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> generation_pb2.GenerateResult:
        """Generate; `seed` 0 means unseeded."""
        sampling = common_pb2.SamplingParams(
            temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed
        )
        request = generation_pb2.GenerateRequest(prompt_tokens=prompt_tokens, sampling=sampling)
        return await self.stub.Generate(request, timeout=120)
