"""The engine interface: token-level generation with behaviour logprobs and live weight swaps."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from treadle_common.clients.weights import WeightStoreClient


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int | None = None


@dataclass
class Generation:
    tokens: list[int]
    """Generated token ids (the prompt excluded)."""
    logprobs: list[float]
    """Behaviour logprob of each generated token under the policy that sampled it."""
    versions: list[int]
    """Policy version that generated each token."""
    finish_reason: str
    """`stop` (end-of-turn token) or `length`."""


@dataclass
class SwapStats:
    version: int
    pause_s: float
    """How long generation was stopped for the swap."""
    fetch_s: float
    bytes_fetched: int


class ContextOverflow(ValueError):
    """The prompt does not fit in the model's context: the episode is truncated, not failed."""


class Engine(abc.ABC):
    name: str
    """Backend name (`hf`, `vllm`, `openai`)."""
    model_name: str
    tokenizer: Any
    """The model's HF tokenizer (chat template, eos)."""
    version: int = 0
    """Weight-store version of the weights currently loaded (0 = the base model)."""

    @abc.abstractmethod
    async def generate(self, prompt_tokens: list[int], sampling: Sampling) -> Generation:
        """Sample a continuation of `prompt_tokens`."""

    @abc.abstractmethod
    async def update_to(self, store: WeightStoreClient, version: int) -> SwapStats:
        """Fetch `version` from the weight-store (only chunks not held) and apply it at the
        engine's pause point."""

    @abc.abstractmethod
    def held_chunks(self) -> set[str]:
        """Chunk hashes of the loaded weights (what a delta fetch can skip)."""

    @property
    def running(self) -> int:
        """Requests in the engine (running or waiting)."""
        return 0

    def busy_fraction(self) -> float:
        """Fraction of wall time spent computing since start."""
        return 0.0

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""
