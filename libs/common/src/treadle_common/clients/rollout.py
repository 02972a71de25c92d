"""Rollout clients: token-level generation over gRPC (`treadle.v1.Generation`) and the
HTTP API (`/v1/info`, `/v1/evaluate`, `/v1/swaps`)."""

from __future__ import annotations

import httpx

from treadle_common.api.rollout import EvaluateRequest, EvaluateResult, RolloutInfo, Swaps
from treadle_common.auth import tls
from treadle_common.auth.policy import bearer, token_from_env
from treadle_common.clients.http import parse
from treadle_common.proto.treadle.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from treadle_common.runtime import grpc_options


class GenerationClient:
    def __init__(self, address: str, token: str | None = None):
        self.channel = grpc_options.channel(address, token)
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


class RolloutClient:
    """The rollout service's HTTP API (synchronous: the CLI's calls), as `api.rollout`'s
    models."""

    def __init__(self, base_url: str, http: httpx.Client | None = None, timeout_s: float = 10.0):
        """`http`: a shared client (it carries the caller's token); without one, a client
        presenting `TREADLE_TOKEN`."""
        self.base_url = base_url.rstrip("/")
        self.http = http or httpx.Client(
            timeout=timeout_s, headers=bearer(token_from_env()), verify=tls.httpx_verify()
        )
        self.timeout_s = timeout_s

    def info(self) -> RolloutInfo:
        response = self.http.get(f"{self.base_url}/v1/info", timeout=self.timeout_s)
        return parse(response, RolloutInfo)

    def evaluate(self, request: EvaluateRequest, timeout_s: float = 600.0) -> EvaluateResult:
        """Score the current policy on `request.tasks` (greedy by default)."""
        response = self.http.post(
            f"{self.base_url}/v1/evaluate", json=request.model_dump(), timeout=timeout_s
        )
        return parse(response, EvaluateResult)

    def swaps(self) -> Swaps:
        response = self.http.get(f"{self.base_url}/v1/swaps", timeout=self.timeout_s)
        return parse(response, Swaps)
