"""The engine interface: token-level generation with behaviour logprobs and live weight swaps."""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

from treadle_common.clients.weights import WeightStoreClient


@dataclass
class Sampling:
    """How one request is sampled, and where it stands in the engine's queue."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int | None = None
    priority: float = 0.0
    """When more requests wait than the batch has room for, lower goes first (hf and vllm
    engines; episodes pass their task's creation time, so the oldest groups finish first and
    fewer exceed the staleness bound)."""
    last_turn: bool = False
    """No later request will extend this one (an episode's last possible turn): the hf
    engine does not keep its KV for prefix reuse."""
    adapter: str | None = None
    """The LoRA adapter to sample through (`Engine.load_adapter`); None: the policy itself."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the generation (kept as its last token, like end-of-turn)."""
    stop_strings: tuple[str, ...] = ()
    """Text that ends the generation once the generated tokens decode to contain it (the
    tokens that spell it are kept; the OpenAI API cuts it from the text it shows)."""
    top_logprobs: int = 0
    """Also return this many most likely tokens at each step, with their logprobs
    (`Generation.top_logprobs`; OpenAI's `top_logprobs`)."""
    stream_interval_s: float = 0.0
    """Streamed requests (`Engine.stream`): report new tokens at most this often (the
    first at once, the last with the finish); 0: after every step."""
    grammar: str | None = None
    """The text must match this grammar (llguidance's Lark dialect; `structured.py` writes
    them): each step samples only tokens it allows; once it is complete, only the end of
    text (`stop`). Engines whose `structured_outputs` is False refuse it."""


TopLogprobs = list[tuple[int, float]]
"""The most likely tokens at one step and their logprobs, most likely first."""


@dataclass
class Generation:
    tokens: list[int]
    """Generated token ids (the prompt excluded)."""
    logprobs: list[float]
    """Behaviour logprob of each generated token under the policy that sampled it."""
    versions: list[int]
    """Policy version that generated each token."""
    finish_reason: str
    """`stop` (end-of-turn or stop token/string) or `length`; in a streamed piece that is not
    the last, empty."""
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """Per generated token, when `Sampling.top_logprobs` asked for them (else empty)."""


@dataclass
class SwapStats:
    version: int
    pause_s: float
    """How long generation was stopped for the swap."""
    fetch_s: float
    bytes_fetched: int


class BusyMeter:
    """Requests in flight, and the fraction of wall time with at least one of them."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.busy_s = 0.0
        self.started_at = time.perf_counter()
        self._busy_since = 0.0

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        if self.in_flight == 0:
            self._busy_since = time.perf_counter()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy_s += time.perf_counter() - self._busy_since

    def fraction(self) -> float:
        busy = self.busy_s
        if self.in_flight:
            busy += time.perf_counter() - self._busy_since
        return busy / max(1e-9, time.perf_counter() - self.started_at)


class ContextOverflow(ValueError):
    """The prompt does not fit in the model's context: the episode is truncated, not failed."""


class AdapterUnsupported(ValueError):
    """This engine cannot serve LoRA adapters (a 400 to whoever asked)."""


class Engine(abc.ABC):
    name: str
    """Backend name (`hf`, `vllm`, `openai`)."""
    model_name: str
    tokenizer: Any
    """The model's HF tokenizer (chat template, eos)."""
    version: int = 0
    """Weight-store version of the weights currently loaded (0 = the base model)."""
    structured_outputs: bool = False
    """Whether it enforces `Sampling.grammar` (grammar-constrained decoding)."""

    @abc.abstractmethod
    async def generate(self, prompt_tokens: list[int], sampling: Sampling) -> Generation:
        """Sample a continuation of `prompt_tokens`."""

    async def stream(
        self, prompt_tokens: list[int], sampling: Sampling
    ) -> AsyncGenerator[Generation, None]:
        """Sample like `generate`, yielding the generation as it grows: each piece holds the
        tokens added since the last one; the last piece has the `finish_reason`. Closing the
        iterator early cancels the request. Engines that cannot stream (`openai`) yield the
        whole generation as one piece."""
        yield await self.generate(prompt_tokens, sampling)

    @abc.abstractmethod
    async def update_to(self, store: WeightStoreClient, version: int) -> SwapStats:
        """Fetch `version` from the weight-store (only chunks not held) and apply it at the
        engine's pause point."""

    @abc.abstractmethod
    def held_chunks(self) -> set[str]:
        """Chunk hashes of the loaded weights (what a delta fetch can skip)."""

    async def load_adapter(
        self, name: str, tensors: dict[str, Any], config: Any, version: int = 0
    ) -> None:
        """Serve LoRA adapter `name` (`treadle_common.model.lora` tensors and `AdapterConfig`) on
        the base model, next to the others; replaces an adapter of the same name. Tokens
        sampled through it are tagged with `version` (a run's policy version)."""
        raise AdapterUnsupported(f"the {self.name} engine does not serve LoRA adapters")

    async def unload_adapter(self, name: str) -> None:
        raise AdapterUnsupported(f"the {self.name} engine does not serve LoRA adapters")

    def adapters(self) -> list[str]:
        """The LoRA adapters this engine serves."""
        return []

    meter: BusyMeter
    """Engines that do not schedule themselves wrap each request in `meter.track()`."""

    @property
    def running(self) -> int:
        """Requests in the engine (running or waiting)."""
        return self.meter.in_flight

    def busy_fraction(self) -> float:
        """Fraction of wall time the engine was working (here: had a request in flight)."""
        return self.meter.fraction()

    def stats(self) -> dict[str, float | int]:
        """Engine-specific counters for `/v1/info` (e.g. prefix-cache use)."""
        return {}

    def busy_seconds(self) -> float:
        """Seconds the engine was working since it started."""
        return self.meter.fraction() * (time.perf_counter() - self.meter.started_at)

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""
