"""Tinker sampling through rollout: a sampling client samples the base model or a published
adapter, and the trainer forwards its requests to rollout's OpenAI-compatible API, naming the
adapter as the `model` (rollout serves adapters on its one base model, `/v1/adapters`).

    save_weights_for_sampler --> weight-store version (adapter tensors only)
    sample --> ensure rollout serves that version (POST /v1/adapters, at most `MAX_LOADED`
               per trainer, least recently used unloaded first) --> POST /v1/completions
               {model: adapter, prompt: token ids, n, ...} --> tokens + behaviour logprobs

Rollout must serve the same base model under the Tinker name (`TREADLE_ROLLOUT_MODEL_NAME`);
`treadle up` wires both.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import httpx
from tinker import types

from treadle_common import auth
from treadle_trainer.tinker.adapters import BadRequest

MAX_LOADED = 16
"""Adapters this trainer keeps loaded in rollout."""
MAX_N_PER_CALL = 16
"""Rollout's `n` limit: more samples are split over several calls."""


@dataclass(frozen=True)
class SamplerWeights:
    """An adapter published for sampling: where it lives in the weight-store."""

    base_model: str
    store_model: str
    version: int

    @property
    def adapter_name(self) -> str:
        return f"{self.store_model}.v{self.version}"


@dataclass(frozen=True)
class Sampler:
    """A sampling session: the base model, through an adapter or not."""

    base_model: str
    weights: SamplerWeights | None
    model_path: str | None


class RolloutSampler:
    def __init__(self, url: str, token: str | None):
        self.client = httpx.AsyncClient(base_url=url, headers=auth.bearer(token), timeout=600)
        self.loaded: OrderedDict[str, None] = OrderedDict()
        self.lock = asyncio.Lock()
        self.served_model: str | None = None

    async def close(self) -> None:
        await self.client.aclose()

    async def model_name(self) -> str | None:
        """The base model rollout serves (None while it cannot be reached)."""
        if self.served_model is None:
            try:
                response = await self.client.get("/v1/models")
                response.raise_for_status()
                self.served_model = response.json()["data"][0]["id"]
            except httpx.HTTPError:
                return None
        return self.served_model

    async def ensure(self, weights: SamplerWeights) -> None:
        async with self.lock:
            name = weights.adapter_name
            if name in self.loaded:
                self.loaded.move_to_end(name)
                return
            while len(self.loaded) >= MAX_LOADED:
                old, _ = self.loaded.popitem(last=False)
                response = await self.client.delete(f"/v1/adapters/{old}")
                if response.status_code not in (204, 404):
                    response.raise_for_status()
            body = {"name": name, "model": weights.store_model, "version": weights.version}
            response = await self.client.post("/v1/adapters", json=body)
            if response.status_code >= 400:
                raise RuntimeError(f"rollout refused adapter {name}: {response.text}")
            self.loaded[name] = None

    async def sample(self, sampler: Sampler, request: types.SampleRequest) -> list[Any]:
        """(tokens, logprobs, stop reason) per sample."""
        params = request.sampling_params
        if sampler.weights is not None:
            await self.ensure(sampler.weights)
            model = sampler.weights.adapter_name
        else:
            model = await self.model_name() or sampler.base_model
        prompt = request.prompt.to_ints()
        stop = stop_token_ids(params.stop)
        out: list[Any] = []
        remaining, call = request.num_samples, 0
        while remaining > 0:
            n = min(remaining, MAX_N_PER_CALL)
            body: dict[str, Any] = {
                "model": model,
                "prompt": prompt,
                "n": n,
                "max_tokens": params.max_tokens or 16,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                "stop_token_ids": stop,
            }
            if params.seed is not None:
                body["seed"] = params.seed + call * MAX_N_PER_CALL
            response = await self.client.post("/v1/completions", json=body)
            if 400 <= response.status_code < 500:
                raise BadRequest(f"rollout: {response.text}")
            response.raise_for_status()
            for choice in response.json()["choices"]:
                logprobs = choice["logprobs"]
                tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
                reason = "stop" if choice["finish_reason"] == "stop" else "length"
                out.append((tokens, logprobs["token_logprobs"], reason))
            remaining -= n
            call += 1
        return out


def stop_token_ids(stop: str | list[str] | list[int] | Any) -> list[int]:
    """Tinker's `stop` as token ids (end-of-turn always stops too)."""
    if stop is None:
        return []
    if isinstance(stop, str) or any(isinstance(s, str) for s in stop):
        raise BadRequest("stop strings are not served yet; pass stop token ids")
    if len(stop) == 0:
        raise BadRequest("stop=[] (no end-of-turn stop) is not served")
    return [int(s) for s in stop]


def check_sample_request(request: types.SampleRequest) -> None:
    """Refuse what this server does not compute (never silently ignored)."""
    unsupported = {
        "prompt_logprobs": bool(request.prompt_logprobs),
        "topk_prompt_logprobs": request.topk_prompt_logprobs > 0,
        "topk_sample_logprobs": request.topk_sample_logprobs > 0,
        "target_prompt_logprobs": request.target_prompt_logprobs is not None,
        "prompt_alt_tokens_k": request.prompt_alt_tokens_k > 0,
        "record_stability_info": bool(request.record_stability_info),
    }
    named = [k for k, v in unsupported.items() if v]
    if named:
        raise BadRequest(f"not served here: {', '.join(named)}")
    params = request.sampling_params
    if params.top_k not in (-1, 0):
        raise BadRequest("sampling_params.top_k is not served (top_p is)")
    if not 1 <= request.num_samples <= 256:
        raise BadRequest("num_samples must be in 1..256")
    if params.max_tokens is not None and params.max_tokens < 1:
        raise BadRequest("sampling_params.max_tokens must be >= 1")
    if not 0 <= params.temperature <= 2 or not 0 < params.top_p <= 1:
        raise BadRequest("temperature must be in [0, 2] and top_p in (0, 1]")
    stop_token_ids(params.stop)
    try:
        if not request.prompt.to_ints():
            raise BadRequest("the prompt is empty")
    except ValueError as exc:
        raise BadRequest(f"prompt: {exc}") from exc


def sequence_ids(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]
