"""`reward_model`: an HF sequence-classification model scores (task, answer) pairs, batched.

The model directory comes from `TREADLE_REWARD_MODEL_DIR` (any `AutoModelForSequenceClassification`
with one label); it is loaded on first use, so replicas without it still serve other scorers.
The reward is sigmoid(logit) unless option `activation` is `none`. Needs the `hf` extra
(`pip install treadle-reward[hf]`): torch stays out of the default install.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

from treadle_reward.scorers import register
from treadle_reward.scorers.base import Score, ScoreInput, Scorer
from treadle_reward.settings import RewardSettings


@register("reward_model")
class RewardModel(Scorer):
    deterministic = True

    def __init__(self, model_dir: str | Path = "", max_length: int = 1024, max_batch: int = 32):
        self.model_dir = model_dir
        self.max_length = max_length
        self.max_batch = max_batch
        self._loaded: tuple[Any, Any, Any] | None = None
        self._waiting: list[tuple[ScoreInput, asyncio.Future[Score]]] = []
        self._flushing: asyncio.Task | None = None

    @classmethod
    def from_settings(cls, settings: RewardSettings) -> RewardModel:
        return cls(settings.reward_model_dir)

    def _load(self):
        if self._loaded is None:
            if not self.model_dir:
                raise ValueError(
                    "reward_model needs TREADLE_REWARD_MODEL_DIR (an HF classifier directory)"
                )
            try:
                import torch
                from transformers import AutoModelForSequenceClassification, AutoTokenizer
            except ImportError as exc:
                raise ValueError(
                    "reward_model needs the hf extra: pip install treadle-reward[hf]"
                ) from exc
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            model = AutoModelForSequenceClassification.from_pretrained(self.model_dir).eval()
            self._loaded = (torch, tokenizer, model)
        return self._loaded

    def _forward(self, requests: list[ScoreInput]) -> list[float]:
        torch, tokenizer, model = self._load()
        texts = [f"{json.dumps(r.task, sort_keys=True)}\n{r.answer}" for r in requests]
        batch = tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        with torch.no_grad():
            logits_B = model(**batch).logits[:, 0].float()
        return logits_B.tolist()

    async def score_batch(self, requests: list[ScoreInput]) -> list[Score]:
        logits = await asyncio.to_thread(self._forward, requests)
        scores = []
        for request, logit in zip(requests, logits, strict=True):
            raw = (
                logit if request.options.get("activation") == "none" else 1 / (1 + math.exp(-logit))
            )
            scores.append(Score(reward=raw, breakdown={"reward_model_logit": logit}))
        return scores

    async def score(self, request: ScoreInput) -> Score:
        """Concurrent requests are gathered into one forward pass (micro-batching)."""
        future: asyncio.Future[Score] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let the requests that arrive together join
        while self._waiting:
            batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
            try:
                scores = await self.score_batch([request for request, _ in batch])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), score in zip(batch, scores, strict=True):
                if not future.done():
                    future.set_result(score)
