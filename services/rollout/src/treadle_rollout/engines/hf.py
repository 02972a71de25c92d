"""`hf` engine: transformers `generate` on CPU or GPU.

Generation runs in a worker thread; an asyncio lock makes weight swaps wait for the current
generation to finish (the pause point) and makes generations wait during a swap.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle_common.clients.torch_weights import ChunkCache, apply_fetch
from treadle_common.clients.weights import FetchResult
from treadle_rollout.engines.base import Engine, Generation, Sampling


class HFEngine(Engine):
    def __init__(self, model_dir: Path, model_name: str, device: str | None = None):
        self.model_name = model_name
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(
            self.device
        )
        self.model.eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        )
        self.version = 0
        self.cache = ChunkCache.from_state_dict(self.model.state_dict())
        self._lock = asyncio.Lock()

    async def generate(self, prompt_tokens: list[int], sampling: Sampling) -> Generation:
        async with self._lock:
            version = self.version
            tokens, logprobs = await asyncio.to_thread(self._generate, prompt_tokens, sampling)
        finish = "stop" if tokens and tokens[-1] == self.eos_id else "length"
        return Generation(tokens, logprobs, [version] * len(tokens), finish)

    @torch.no_grad()
    def _generate(
        self, prompt_tokens: list[int], sampling: Sampling
    ) -> tuple[list[int], list[float]]:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        input_ids_1_P = torch.tensor([prompt_tokens], device=self.device)
        greedy = sampling.temperature <= 0
        out = self.model.generate(
            input_ids_1_P,
            attention_mask=torch.ones_like(input_ids_1_P),
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_tokens_T = out.sequences[0, input_ids_1_P.shape[1] :]
        logits_T_V = torch.stack([step[0] for step in out.logits]).float()
        logprobs_T = (
            torch.log_softmax(logits_T_V, dim=-1).gather(1, new_tokens_T[:, None]).squeeze(1)
        )
        return new_tokens_T.tolist(), logprobs_T.tolist()

    async def update_weights(self, fetched: FetchResult) -> float:
        async with self._lock:
            paused = time.perf_counter()
            apply_fetch(fetched, self.model.state_dict(), self.cache)
            self.version = fetched.manifest.version
            return time.perf_counter() - paused

    def held_chunks(self) -> set[str]:
        return self.cache.have()
