"""`openai` engine: any OpenAI-compatible server as a fixed policy (evaluation, teachers).

Prompts are sent as token ids to `POST {base_url}/completions` with `logprobs: 1` and
`return_tokens_as_token_ids: true` (vLLM's and Treadle's servers answer with `token_id:N`,
which keeps trajectories token-exact). A server that ignores that option returns token
strings; they are re-tokenized, which is exact only when the tokenizer round-trips them.
This engine does not take weight updates: the policy is whatever the server serves.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from transformers import AutoTokenizer

from treadle_common.clients.weights import WeightStoreClient
from treadle_rollout import metrics
from treadle_rollout.engines.base import (
    BusyMeter,
    ContextOverflow,
    Engine,
    Generation,
    Sampling,
    SwapStats,
)

TOKEN_ID_PREFIX = "token_id:"


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(
        self,
        model_dir: Path,
        model_name: str,
        *,
        base_url: str,
        served_model: str | None = None,
        api_key: str = "",
        timeout_s: float = 300.0,
    ):
        self.model_name = model_name
        self.served_model = served_model or model_name
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_id = self.tokenizer.eos_token_id
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s
        )
        self.meter = BusyMeter()

    def _token_ids(self, tokens: list[str]) -> list[int]:
        if all(t.startswith(TOKEN_ID_PREFIX) for t in tokens):
            return [int(t[len(TOKEN_ID_PREFIX) :]) for t in tokens]
        return self.tokenizer("".join(tokens), add_special_tokens=False)["input_ids"]

    async def generate(self, prompt_tokens: list[int], sampling: Sampling) -> Generation:
        body = {
            "model": self.served_model,
            "prompt": list(prompt_tokens),
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        with self.meter.track():
            response = await self.http.post("/completions", json=body)
        if response.status_code == 400 and "context_length" in response.text:
            raise ContextOverflow(response.json().get("error", {}).get("message", response.text))
        if response.status_code != 200:
            raise RuntimeError(f"openai engine: HTTP {response.status_code}: {response.text}")
        choice = response.json()["choices"][0]
        lp = choice.get("logprobs") or {}
        tokens = self._token_ids(lp.get("tokens") or [])
        logprobs = [float(x) for x in lp.get("token_logprobs") or [0.0] * len(tokens)]
        if len(logprobs) != len(tokens):  # re-tokenized text: logprobs no longer line up
            logprobs = [0.0] * len(tokens)
        if choice.get("finish_reason") == "stop" and (not tokens or tokens[-1] != self.eos_id):
            tokens.append(self.eos_id)  # the server dropped the end-of-turn token
            logprobs.append(0.0)
        metrics.TOKENS.inc(len(tokens))
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Generation(tokens, logprobs, [self.version] * len(tokens), finish)

    async def update_to(self, store: WeightStoreClient, version: int) -> SwapStats:
        raise NotImplementedError("the openai engine serves a fixed policy; it takes no weights")

    def held_chunks(self) -> set[str]:
        return set()

    async def close(self) -> None:
        await self.http.aclose()
