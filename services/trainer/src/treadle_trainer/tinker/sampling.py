"""Tinker sampling through rollout: a sampling client samples the base model or a published
adapter, and the trainer forwards its requests to rollout's OpenAI-compatible API, naming the
adapter as the `model` (rollout serves adapters on its one base model, `/v1/adapters`).

    save_weights_for_sampler --> weight-store version (adapter tensors only)
    sample --> ensure rollout serves that version (POST /v1/adapters, at most `MAX_LOADED`
               per trainer, least recently used unloaded first) --> POST /v1/completions
               {model: adapter, prompt: [token ids, ...], n, ...} --> tokens + behaviour
               logprobs (requests arriving together are batched: `COALESCE_S`)

Rollout must serve the same base model under the Tinker name (`TREADLE_ROLLOUT_MODEL_NAME`);
`treadle up` wires both.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import httpx
from tinker import types

from treadle_common.auth import policy as auth
from treadle_trainer.errors import InvalidInput

MAX_LOADED = 16
"""Adapters this trainer keeps loaded in rollout."""
MAX_N_PER_CALL = 16
"""Rollout's `n` limit: more samples are split over several calls."""
MAX_BATCH_PROMPTS = 64
"""Prompts per batched rollout call (rollout's limit)."""
MAX_GENERATIONS = 256
"""Prompts x n per batched rollout call (rollout's limit)."""
COALESCE_S = 0.003
"""Unseeded sample requests with the same model and parameters that arrive within this
window go to rollout as one batched completions call: the engine then prefills them in one
pass and decodes them together. Sent one by one, they reach the engine a few milliseconds
apart and each joins at a later decode step with a prefill of its own (measured with
`treadle bench tinker`: 16 concurrent requests sampled at 0.72x rollout's own rate)."""
Sequence = tuple[list[int], list[float], str]
"""One sample: tokens, their behaviour logprobs, the stop reason (`stop` | `length`)."""


@dataclass
class _Batch:
    body: dict[str, Any]
    prompts: list[list[int]] = field(default_factory=list)
    futures: list[asyncio.Future[list[Sequence]]] = field(default_factory=list)


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
        self.pending: dict[str, _Batch] = {}
        self.flushes: set[asyncio.Task[None]] = set()

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

    async def sample(self, sampler: Sampler, request: types.SampleRequest) -> list[Sequence]:
        """(tokens, logprobs, stop reason) per sample."""
        params = request.sampling_params
        if sampler.weights is not None:
            await self.ensure(sampler.weights)
            model = sampler.weights.adapter_name
        else:
            model = await self.model_name() or sampler.base_model
        prompt = request.prompt.to_ints()
        out: list[Sequence] = []
        remaining, call = request.num_samples, 0
        while remaining > 0:
            n = min(remaining, MAX_N_PER_CALL)
            body: dict[str, Any] = {
                "model": model,
                "n": n,
                "max_tokens": params.max_tokens or 16,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                **stop_fields(params.stop),
            }
            if params.seed is not None:  # seeded: alone (a batch shares one seed)
                body["seed"] = params.seed + call * MAX_N_PER_CALL
                out += (await self._completions(body, [prompt]))[0]
            else:
                out += await self._coalesced(body, prompt)
            remaining -= n
            call += 1
        return out

    async def _coalesced(self, body: dict[str, Any], prompt: list[int]) -> list[Sequence]:
        """This prompt's samples, from one rollout call shared with the other prompts that
        arrive for the same model and parameters within `COALESCE_S`."""
        key = json.dumps(body, sort_keys=True)
        batch = self.pending.get(key)
        if batch is None:
            batch = self.pending[key] = _Batch(body)
            asyncio.get_running_loop().call_later(COALESCE_S, self._flush_soon, key, batch)
        future: asyncio.Future[list[Sequence]] = asyncio.get_running_loop().create_future()
        batch.prompts.append(prompt)
        batch.futures.append(future)
        full = (len(batch.prompts) + 1) * body["n"] > MAX_GENERATIONS
        if len(batch.prompts) >= MAX_BATCH_PROMPTS or full:
            self._flush_soon(key, batch)
        return await future

    def _flush_soon(self, key: str, batch: _Batch) -> None:
        if self.pending.get(key) is batch:
            del self.pending[key]
            self.flushes.add(task := asyncio.create_task(self._flush(batch)))
            task.add_done_callback(self.flushes.discard)

    async def _flush(self, batch: _Batch) -> None:
        try:
            results = await self._completions(batch.body, batch.prompts)
        except InvalidInput as exc:
            if len(batch.prompts) == 1:
                batch.futures[0].set_exception(exc)
                return
            # one bad prompt (too long for the context) must not fail the others
            for prompt, future in zip(batch.prompts, batch.futures, strict=True):
                try:
                    future.set_result((await self._completions(batch.body, [prompt]))[0])
                except Exception as exc:
                    future.set_exception(exc)
            return
        except Exception as exc:
            for future in batch.futures:
                future.set_exception(exc)
            return
        for future, result in zip(batch.futures, results, strict=True):
            future.set_result(result)

    async def _completions(
        self, body: dict[str, Any], prompts: list[list[int]]
    ) -> list[list[Sequence]]:
        """One rollout completions call for a batch of prompts; the samples of each."""
        response = await self.client.post("/v1/completions", json={**body, "prompt": prompts})
        if 400 <= response.status_code < 500:
            raise InvalidInput(f"rollout: {response.text}")
        response.raise_for_status()
        choices = response.json()["choices"]
        n = body["n"]
        samples: list[Sequence] = []
        for choice in choices:
            logprobs = choice["logprobs"]
            tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
            reason = "stop" if choice["finish_reason"] == "stop" else "length"
            samples.append((tokens, logprobs["token_logprobs"], reason))
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]


def stop_fields(stop: str | list[str] | list[int] | Any) -> dict[str, Any]:
    """Tinker's `stop` as rollout's `stop_token_ids` or `stop` strings (end-of-turn always
    stops too)."""
    if stop is None:
        return {}
    if isinstance(stop, str):
        stop = [stop]
    if len(stop) == 0:
        raise InvalidInput("stop=[] (no end-of-turn stop) is not served")
    strings = [s for s in stop if isinstance(s, str)]
    if len(strings) == len(stop):
        if len(strings) > 4 or not all(0 < len(s) <= 256 for s in strings):
            raise InvalidInput("at most 4 stop strings of 1..256 characters")
        return {"stop": strings}
    if strings:
        raise InvalidInput("stop mixes strings and token ids")
    return {"stop_token_ids": [int(s) for s in stop]}


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
        raise InvalidInput(f"not served here: {', '.join(named)}")
    params = request.sampling_params
    if params.top_k not in (-1, 0):
        raise InvalidInput("sampling_params.top_k is not served (top_p is)")
    if not 1 <= request.num_samples <= 256:
        raise InvalidInput("num_samples must be in 1..256")
    if params.max_tokens is not None and params.max_tokens < 1:
        raise InvalidInput("sampling_params.max_tokens must be >= 1")
    if not 0 <= params.temperature <= 2 or not 0 < params.top_p <= 1:
        raise InvalidInput("temperature must be in [0, 2] and top_p in (0, 1]")
    stop_fields(params.stop)
    try:
        if not request.prompt.to_ints():
            raise InvalidInput("the prompt is empty")
    except ValueError as exc:
        raise InvalidInput(f"prompt: {exc}") from exc


def sequence_ids(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]
