"""The engine interface: token-level generation with behaviour logprobs and live weight swaps."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from treadle_common.clients.weights import FetchResult


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


class Engine(abc.ABC):
    model_name: str
    version: int = 0
    """Weight-store version of the weights currently loaded (0 = the base model)."""

    @abc.abstractmethod
    async def generate(self, prompt_tokens: list[int], sampling: Sampling) -> Generation:
        """Sample a continuation of `prompt_tokens`."""

    @abc.abstractmethod
    async def update_weights(self, fetched: FetchResult) -> float:
        """Apply a fetched version at a safe point; return the generation pause in seconds."""

    @abc.abstractmethod
    def held_chunks(self) -> set[str]:
        """Chunk hashes of the loaded weights (what a delta fetch can skip)."""
