"""`hf` engine: a transformers causal LM with continuous batching, on CPU or GPU.

One scheduler task owns the model. Going from idle to busy it first waits a few event-loop
turns, so that requests released together join one prefill (`_gather`). Each iteration (a
*step*):

1. applies pending weight swaps: this is the pause point. Policy `continue` keeps the
   running sequences and their KV cache (later tokens carry the new version); `abort`
   restarts their current turn from its prompt under the new weights;
2. prefills the requests that arrived since the last step (left-padded, one forward) and
   copies their KV into the running batch's slab (`kv_slab.py`), so new requests join
   between decode steps.
   A request whose prompt starts with a finished sequence's tokens (the next turn of an
   episode, a sibling of its group) reuses that sequence's KV from the prefix cache and
   prefills only the rest (`prefix_cache.py`);
3. runs one batched decode step for every running sequence, sampling per sequence
   (temperature, top-p, seed) and recording each token's logprob and policy version.

Finished sequences leave the batch after every step; their KV goes to the prefix cache. A
swap clears the prefix cache, and a sequence that ran across a swap (policy `continue`) is
not cached: reused KV always comes from the weights that serve the request.

Steps run in a worker thread, back to back (`_burst`): between steps the thread takes the
requests that arrived and hands each step's results and stream progress to the event loop
in one call, without waiting for the loop to turn. A burst ends when the batch empties or a
swap or adapter change waits for the pause point; the event loop keeps serving meanwhile.

LoRA adapters (`load_adapter`, from the Tinker API's sampler weights; and the policy itself
when a run trains one: `policy_adapter`) sit on the one base model: a request names its
adapter (`Sampling.adapter`) and each forward pass routes every row through its own
(`treadle_common.model.lora.using`), so requests on different adapters and on the policy share a
batch. Rows of a named adapter neither use nor fill the prefix cache (their KV is not the
policy's). Loading one happens at the pause point, like a swap.

Logprobs are those of the distribution the token was sampled from: `log_softmax(logits / T)`
(raw logits when greedy), renormalized over the top-p nucleus when top_p < 1 (vLLM's
`processed_logprobs`). A trainer recomputing them must use the same temperature.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from treadle_common.clients.torch_weights import ChunkCache, apply_fetch, tensors_of
from treadle_common.clients.weights import FetchResult, WeightStoreClient
from treadle_common.model import lora
from treadle_rollout import metrics
from treadle_rollout.engines import cpus as cpus_mod
from treadle_rollout.engines import prefix_cache
from treadle_rollout.engines.base import (
    ContextOverflow,
    Engine,
    Generation,
    Sampling,
    SwapStats,
    TopLogprobs,
)
from treadle_rollout.engines.kv_slab import KVSlab

SwapPolicy = Literal["continue", "abort"]
POLICY_ADAPTER = "__policy__"
"""The adapter name a LoRA run's policy version is loaded under (not a valid adapter name
for `/v1/adapters`, so the two never collide)."""
GATHER_TURNS = 32
"""At most this many event-loop turns to gather requests when the engine wakes (`_gather`)."""
QUIET_TURNS = 3
"""Turns in a row without a new request that end the gathering."""


@dataclass(eq=False)
class _Seq:
    """One request: its prompt, sampling and what has been generated for it so far."""

    prompt: list[int]
    sampling: Sampling
    future: asyncio.Future[Generation]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[TopLogprobs] = field(default_factory=list)
    finish: str | None = None
    hit: prefix_cache.Hit | None = None
    kv_version: int = -1
    """The policy version that computed this row's KV (at its prefill)."""
    progress: asyncio.Event | None = None
    """Streamed requests: set on the event loop after each step that added tokens."""
    ready: int = 0
    """Streamed requests: tokens complete as of the last `progress` (the worker thread
    may be appending past it)."""
    reported_at: float = 0.0
    shown: bool = False
    """Streamed requests: the reported tokens form some text (`HFEngine._hand_over`)."""
    on_piece: Callable[[Generation], None] | None = None
    """`HFEngine.submit`'s callback: the tokens added since its last call."""
    on_finish: Callable[[Generation], None] | None = None
    """`HFEngine.submit`'s callback: the finished generation, in the call that delivers it."""
    sent: int = 0
    """Tokens passed to `on_piece` so far."""

    @property
    def streamed(self) -> bool:
        return self.progress is not None or self.on_piece is not None

    def restart(self) -> None:
        self.tokens, self.logprobs, self.versions, self.top = [], [], [], []


class _Batch:
    """The running sequences; row i of the KV slab belongs to `seqs[i]`."""

    def __init__(self, slab: KVSlab) -> None:
        self.seqs: list[_Seq] = []
        self.slab = slab

    def add(self, seqs: list[_Seq], cache: DynamicCache, mask_B_T: torch.Tensor) -> None:
        """Append prefilled sequences (their cache right-aligned, as `mask_B_T` says)."""
        self.slab.add(
            [layer.keys for layer in _layers(cache)],
            [layer.values for layer in _layers(cache)],
            mask_B_T,
        )
        self.seqs += seqs

    def drop(self, rows: list[int]) -> None:
        """Remove `rows`; the last rows move into the gaps, as in the slab."""
        self.slab.remove(rows)
        for row in sorted(rows, reverse=True):
            last = self.seqs.pop()
            if row < len(self.seqs):
                self.seqs[row] = last

    def clear(self) -> None:
        self.seqs = []
        self.slab.clear()


class _KV(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


def _layers(cache: DynamicCache) -> list[_KV]:
    """The cache's per-layer keys and values (full-attention layers: both always set)."""
    return cast(list[_KV], cache.layers)


def _right_align(cache: DynamicCache, mask_B_T: torch.Tensor) -> torch.Tensor:
    """Move every row's cached columns to the right end, in order, dropping the padding
    between a reused prefix and the prefilled rest; return the new mask."""
    length = int(mask_B_T.sum(1).max())
    # a stable sort puts each row's padding columns first and keeps its tokens in order
    index_B_T = torch.sort(mask_B_T, dim=1, stable=True).indices[:, -length:]
    for layer in _layers(cache):
        index = index_B_T[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
        layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
    return mask_B_T.gather(1, index_B_T)


class HFEngine(Engine):
    name = "hf"

    def __init__(
        self,
        model_dir: Path,
        model_name: str,
        device: str | None = None,
        *,
        swap_policy: SwapPolicy = "continue",
        max_batch: int = 64,
        max_context: int | None = None,
        prefix_cache_mb: int = 256,
        cpus: list[int] | None = None,
    ):
        """`cpus`: the CPUs the engine's thread (all its model work) runs on (`cpus.py`)."""
        self.model_name = model_name
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        fast = getattr(self.tokenizer, "backend_tokenizer", None)
        # the worker thread's own copy (`_forms_text`): never borrowed by the event loop's
        # tokenizer calls
        self._text_decoder = Tokenizer.from_str(fast.to_str()) if fast else self.tokenizer
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(self.device)  # type: ignore[arg-type]  # transformers' `to` typing
        # transformers 5.2x renamed the forward's `past_key_values` to `cache` (the old name
        # warns on every call and goes in 5.40); older releases know only the old one
        self._cache_arg = (
            "cache"
            if "cache" in inspect.signature(self.model.forward).parameters
            else "past_key_values"
        )
        self.model.eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        )
        self.max_context = max_context or int(
            getattr(self.model.config, "max_position_embeddings", 0) or 2048
        )
        self.swap_policy: SwapPolicy = swap_policy
        self.max_batch = max_batch
        self.version = 0
        self.cache = ChunkCache.from_state_dict(self.model.state_dict())
        self.prefixes = prefix_cache.PrefixCache(prefix_cache_mb << 20)
        config = self.model.config
        heads = config.num_attention_heads
        self._batch = _Batch(
            KVSlab(
                config.num_hidden_layers,
                getattr(config, "num_key_value_heads", None) or heads,
                getattr(config, "head_dim", None) or config.hidden_size // heads,
                self.model.dtype,
                self.device,
                max_batch,
            )
        )
        self._waiting: list[_Seq] = []
        self._waiting_lock = threading.Lock()
        """`_submit` (the event loop) appends while a burst (the worker thread) takes."""
        self._finished: list[_Seq] = []
        self._joining: list[_Seq] = []
        self._closed = False
        self._swaps: list[tuple[FetchResult, asyncio.Future[float]]] = []
        self._adapter_ops: list[tuple[Callable[[], None], asyncio.Future[None]]] = []
        self._adapters: dict[str, int] = {}
        """Adapters served: name -> the version their tokens are tagged with."""
        self.base_version = 0
        """The full-weight version the model holds (0: the model directory)."""
        self.policy_adapter: str | None = None
        """Set while the policy is a LoRA run's adapter version: requests that name no
        adapter go through it."""
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="hf-engine", initializer=cpus_mod.bind, initargs=(cpus,)
        )
        """The engine's one thread: bursts, swaps and adapter changes, one at a time."""
        self.on_delivered: Callable[[], None] | None = None
        """Called on the event loop after each step's results and pieces were delivered
        (the engine process writes them out in that same call)."""
        self.busy_s = 0.0
        self.started_at = time.perf_counter()
        self.restarted_turns = 0
        self.prefill_forwards = 0
        self.folded_joins = 0
        """Requests that joined with no prefill forward of their own (`_step`)."""
        self.decode_steps = 0
        self.decode_rows = 0

    # -- public API -------------------------------------------------------------------------
    async def generate(self, prompt_tokens: list[int], sampling: Sampling) -> Generation:
        # cancelling the caller cancels the future: the row is dropped
        return await self._submit(prompt_tokens, sampling).future

    async def stream(
        self, prompt_tokens: list[int], sampling: Sampling
    ) -> AsyncGenerator[Generation, None]:
        """Pieces after every decode step. A streamed request is never restarted by a swap
        (policy `abort`): what it sent cannot be taken back, so it continues like `continue`."""
        seq = self._submit(prompt_tokens, sampling, streamed=True)
        assert seq.progress is not None
        sent = 0
        try:
            while True:
                await seq.progress.wait()
                seq.progress.clear()
                if seq.future.done():
                    gen = seq.future.result()
                    yield Generation(
                        gen.tokens[sent:],
                        gen.logprobs[sent:],
                        gen.versions[sent:],
                        gen.finish_reason,
                        gen.top_logprobs[sent:],
                    )
                    return
                ready = seq.ready
                if ready > sent:
                    yield Generation(
                        seq.tokens[sent:ready],
                        seq.logprobs[sent:ready],
                        seq.versions[sent:ready],
                        "",
                        seq.top[sent:ready],
                    )
                    sent = ready
        finally:
            if not seq.future.done():
                seq.future.cancel()

    def submit(
        self,
        prompt_tokens: list[int],
        sampling: Sampling,
        on_piece: Callable[[Generation], None] | None = None,
        on_finish: Callable[[Generation], None] | None = None,
    ) -> asyncio.Future[Generation]:
        """`generate` and `stream` in callback form, for a server that forwards pieces (the
        engine process): `on_piece`, if given, is called on the event loop with the tokens
        added since its last call (as often as `stream` yields, but never with the last
        ones); `on_finish`, if given, with the whole generation in the same call as the step's
        other pieces (the future's callbacks run a loop turn later); the future holds the
        whole generation (or the error). Cancelling it cancels the request."""
        seq = self._submit(prompt_tokens, sampling, on_piece=on_piece)
        seq.on_finish = on_finish
        return seq.future

    def _submit(
        self,
        prompt_tokens: list[int],
        sampling: Sampling,
        streamed: bool = False,
        on_piece: Callable[[Generation], None] | None = None,
    ) -> _Seq:
        if len(prompt_tokens) >= self.max_context:
            raise ContextOverflow(
                f"prompt of {len(prompt_tokens)} tokens leaves no room in the "
                f"{self.max_context}-token context"
            )
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        seq = _Seq(list(prompt_tokens), sampling, future, generator, on_piece=on_piece)
        if streamed:
            seq.progress = asyncio.Event()
            future.add_done_callback(lambda _: seq.progress.set() if seq.progress else None)
        with self._waiting_lock:
            self._waiting.append(seq)
        self._ensure_scheduler()
        return seq

    async def update_to(self, store: WeightStoreClient, version: int) -> SwapStats:
        """Full weights, or a LoRA run's adapter version: then first the full-weight version
        it applies to, unless that is what the engine holds."""
        start = time.perf_counter()
        fetched = await store.fetch(
            self.model_name, version, have=self.held_chunks(), skip_assets=True
        )
        received = fetched.bytes_received
        metadata = dict(fetched.manifest.metadata)
        pause_s = 0.0
        if lora.is_adapter(metadata):
            base = int(metadata.get("lora_base_version", "0"))
            if base != self.base_version:
                full = await store.fetch(
                    self.model_name, base, have=self.held_chunks(), skip_assets=True
                )
                received += full.bytes_received
                pause_s += await self.swap(full)
        fetch_s = time.perf_counter() - start
        pause_s += await self.swap(fetched)
        return SwapStats(fetched.manifest.version, pause_s, fetch_s, received)

    async def swap(self, fetched: FetchResult) -> float:
        """Apply fetched weights at the next step boundary; return the pause in seconds. A
        LoRA adapter version becomes the policy's adapter (`policy_adapter`) on the base
        weights held; a full-weight version replaces them and drops it."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._swaps.append((fetched, future))
        self._ensure_scheduler()
        return await asyncio.shield(future)

    def held_chunks(self) -> set[str]:
        return self.cache.have()

    async def load_adapter(
        self, name: str, tensors: dict, config: lora.AdapterConfig, version: int = 0
    ) -> None:
        def apply() -> None:
            lora.inject(self.model, lora.ATTENTION + lora.MLP + lora.UNEMBED)
            state = {k: t.to(self.device) for k, t in tensors.items()}
            lora.load_adapter(self.model, name, state, config)
            self._adapters[name] = version

        await self._adapter_op(apply)

    async def unload_adapter(self, name: str) -> None:
        def apply() -> None:
            lora.remove_adapter(self.model, name)
            self._adapters.pop(name, None)

        await self._adapter_op(apply)

    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    async def _adapter_op(self, apply: Callable[[], None]) -> None:
        """Run `apply` at the next step boundary (no forward pass is running)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._adapter_ops.append((apply, future))
        self._ensure_scheduler()
        await asyncio.shield(future)

    @property
    def running(self) -> int:
        return len(self._batch.seqs) + len(self._waiting)

    def busy_fraction(self) -> float:
        return self.busy_s / max(1e-9, time.perf_counter() - self.started_at)

    def busy_seconds(self) -> float:
        return self.busy_s

    def stats(self) -> dict[str, float | int]:
        p = self.prefixes
        return {
            "prefix_cache_entries": len(p),
            "prefix_cache_mb": round(p.bytes / 2**20, 1),
            "prefix_cache_hit_fraction": round(p.hit_tokens / max(1, p.lookup_tokens), 4),
            "prefill_forwards": self.prefill_forwards,
            "folded_joins": self.folded_joins,
            "decode_steps": self.decode_steps,
            "decode_rows": self.decode_rows,
            "kv_slab_allocations": self._batch.slab.allocations,
        }

    async def close(self) -> None:
        self._closed = True  # a running burst ends after its step
        if self._scheduler is not None:
            self._scheduler.cancel()
        self._thread.shutdown(wait=False)

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the engine's thread (as `asyncio.to_thread`, context included)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    # -- the scheduler ------------------------------------------------------------------------
    def _ensure_scheduler(self) -> None:
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = asyncio.create_task(self._loop(), name="hf-engine")
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            if self._adapter_ops:
                await self._apply_adapter_ops()
            if not (self._batch.seqs or self._waiting or self._swaps):
                self._wake.clear()
                await self._wake.wait()
                continue
            if not (self._batch.seqs or self._swaps):  # idle -> busy
                await self._gather()
            if self._swaps:
                await self._apply_swaps()
                if not (self._batch.seqs or self._waiting):
                    continue
            joiners = self._take_joiners()
            loop = asyncio.get_running_loop()
            started = time.perf_counter()
            try:
                await self._in_thread(self._burst, loop, joiners)
            except Exception as exc:  # a failed forward fails its requests, not the engine
                for seq in [*self._batch.seqs, *self._joining, *self._finished]:
                    if not seq.future.done():
                        seq.future.set_exception(exc)
                self._batch.clear()
                self._joining, self._finished = [], []
                continue
            finally:
                elapsed = time.perf_counter() - started
                self.busy_s += elapsed
                metrics.ENGINE_BUSY.inc(elapsed)

    def _take_joiners(self) -> list[_Seq]:
        """The waiting requests that fit in the batch, oldest episodes first (ties keep
        arrival order); cancelled ones are dropped."""
        with self._waiting_lock:
            joiners = [s for s in self._waiting if not s.future.done()]
            room = max(0, self.max_batch - len(self._batch.seqs))
            if len(joiners) > room:
                joiners.sort(key=lambda s: s.sampling.priority)
            joiners, self._waiting = joiners[:room], joiners[room:]
        return joiners

    async def _gather(self) -> None:
        """Idle -> busy: let the requests released together arrive together.

        A weight swap un-gates every waiting group at once, but their episodes reach
        `generate` over several event-loop turns (lock hand-offs, then each group's gate).
        Stepping at the first request would prefill and decode the first group alone and
        the others one step later each (measured: 20-30 ms of a 0.1 s sync generation).
        So: a few loop turns, until `QUIET_TURNS` turns in a row add no request (at most
        `GATHER_TURNS`); each idle turn costs microseconds."""
        quiet, seen = 0, len(self._waiting)
        for _ in range(GATHER_TURNS):
            await asyncio.sleep(0)
            quiet = quiet + 1 if len(self._waiting) == seen else 0
            seen = len(self._waiting)
            if quiet >= QUIET_TURNS:
                return

    def _apply(self, fetched: FetchResult) -> None:
        """A fetched version into the model (in the worker thread, at the pause point)."""
        metadata = dict(fetched.manifest.metadata)
        if not lora.is_adapter(metadata):
            apply_fetch(fetched, self.model.state_dict(), self.cache)
            self.base_version = fetched.manifest.version
            self.policy_adapter = None
            return
        lora.inject(self.model, lora.ATTENTION + lora.MLP + lora.UNEMBED)
        tensors = {k: t.to(self.device) for k, t in tensors_of(fetched).items()}
        lora.load_adapter(self.model, POLICY_ADAPTER, tensors, lora.from_metadata(metadata))
        self.policy_adapter = POLICY_ADAPTER

    async def _apply_swaps(self) -> None:
        swaps, self._swaps = self._swaps, []
        for fetched, future in swaps:
            paused = time.perf_counter()
            try:
                await self._in_thread(self._apply, fetched)
            except Exception as exc:
                future.set_exception(exc)
                continue
            self.version = fetched.manifest.version
            self.prefixes.clear()  # cached KV belongs to the weights that computed it
            if self.swap_policy == "abort" and self._batch.seqs:
                rows = [i for i, s in enumerate(self._batch.seqs) if not s.streamed]
                restarted = [self._batch.seqs[i] for i in rows]
                for seq in restarted:
                    seq.restart()
                self.restarted_turns += len(restarted)
                metrics.RESTARTED_TURNS.inc(len(restarted))
                with self._waiting_lock:
                    self._waiting[:0] = restarted
                if len(rows) == len(self._batch.seqs):
                    self._batch.clear()
                elif rows:
                    self._batch.drop(rows)
            future.set_result(time.perf_counter() - paused)

    async def _apply_adapter_ops(self) -> None:
        ops, self._adapter_ops = self._adapter_ops, []
        for apply, future in ops:
            try:
                await self._in_thread(apply)
            except Exception as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

    def _stopped_by_text(self, seq: _Seq) -> bool:
        """A stop string in the text of the last tokens (every token is at least one
        character, so a window one longer than the longest stop string covers it)."""
        stops = seq.sampling.stop_strings
        window = max(len(s) for s in stops) + 1
        tail = self.tokenizer.decode(seq.tokens[-window:])
        return any(s in tail for s in stops)

    def _adapters_of(self, seqs: list[_Seq]) -> list[str | None] | None:
        """Each row's adapter for `lora.using` (the policy's rows: its adapter, if any);
        None when no row has one (the plain model)."""
        names = [s.sampling.adapter or self.policy_adapter for s in seqs]
        return names if any(n is not None for n in names) else None

    def _deliver(self, finished: list[_Seq], progressed: list[_Seq]) -> None:
        """On the event loop: a step's finished requests get their results, and the streamed
        ones with new tokens are woken."""
        for seq in finished:
            if not seq.future.done():
                gen = Generation(
                    seq.tokens, seq.logprobs, seq.versions, seq.finish or "length", seq.top
                )
                if seq.on_finish is not None:
                    seq.on_finish(gen)
                seq.future.set_result(gen)
        for seq in progressed:
            if seq.on_piece is not None:
                if seq.ready > seq.sent and not seq.future.done():
                    start, seq.sent = seq.sent, seq.ready
                    seq.on_piece(
                        Generation(
                            seq.tokens[start : seq.ready],
                            seq.logprobs[start : seq.ready],
                            seq.versions[start : seq.ready],
                            "",
                            seq.top[start : seq.ready],
                        )
                    )
            elif seq.progress is not None:
                seq.progress.set()
        if self.on_delivered is not None:
            self.on_delivered()

    # -- model work (runs in a worker thread) -----------------------------------------------
    def _burst(self, loop: asyncio.AbstractEventLoop, joiners: list[_Seq]) -> None:
        """Steps back to back, taking new requests in between, until the batch is empty or
        a swap or an adapter change waits for the pause point. The event loop needs no turn
        between steps: under load it has HTTP and gRPC work queued, and waiting for it left
        the engine idle between steps (about 40% of the time with 32 streamed requests on
        the bench's tiny model). Each step's results and stream progress go to the loop in
        one call."""
        while True:
            self._joining = joiners
            self._step(joiners)
            self._joining = []
            self._hand_over(loop)
            if self._swaps or self._adapter_ops or self._closed:
                return
            joiners = self._take_joiners()
            if not (joiners or self._batch.seqs):
                return

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """Pass the finished requests, and the streamed ones with new tokens whose interval
        has passed, to the event loop (`_deliver`). A stream's interval starts once its
        tokens form some text: until then every step's token goes at once (a first token
        that is part of a character, which a small model's byte tokens often are, would
        otherwise hold the first visible text back a whole interval)."""
        finished, self._finished = self._finished, []
        progressed = []
        now = time.monotonic()
        for seq in self._batch.seqs:
            if not seq.streamed or len(seq.tokens) <= seq.ready:
                continue
            if seq.shown and now - seq.reported_at < seq.sampling.stream_interval_s:
                continue
            seq.ready, seq.reported_at = len(seq.tokens), now
            seq.shown = seq.shown or self._forms_text(seq.tokens)
            progressed.append(seq)
        if finished or progressed:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(self._deliver, finished, progressed)

    @torch.inference_mode()
    def _step(self, joiners: list[_Seq]) -> None:
        self._match(joiners)
        # a prompt that the prefix cache holds but for its last token needs no forward of its
        # own: its row joins with the cached KV and feeds that token in this step's decode,
        # as a generated token is fed (a prefill forward of a few rows costs about 0.6 of a
        # 30-row decode step on a small model)
        folded: list[_Seq] = []
        rest: list[_Seq] = []
        for seq in joiners:
            whole = seq.hit is not None and seq.hit.length == len(seq.prompt) - 1
            (folded if whole else rest).append(seq)
        if rest:
            self.prefill_forwards += 1
            cache, mask_B_T, logits_B_V = self._prefill(rest)
            self._append(rest, logits_B_V)
            self._batch.add(rest, cache, mask_B_T)
            self._retire()
        if folded:
            self.folded_joins += len(folded)
            self._batch.add(folded, *self._cached_rows(folded))
        if self._batch.seqs:
            self.decode_steps += 1
            self.decode_rows += len(self._batch.seqs)
            self._append(self._batch.seqs, self._decode())
            self._retire()

    def _retire(self) -> None:
        """Move finished (and cancelled) rows out of the batch; cache the KV of finished ones."""
        gone = []
        for i, seq in enumerate(self._batch.seqs):
            if seq.finish is not None:
                self._finished.append(seq)
                self._remember(i, seq)
                gone.append(i)
            elif seq.future.cancelled():
                gone.append(i)
        if gone:
            self._batch.drop(gone)

    def _remember(self, row: int, seq: _Seq) -> None:
        """Put the KV of a finished row in the prefix cache: it covers the prompt and every
        generated token but the last (which was sampled, never fed)."""
        if self.prefixes.max_bytes <= 0 or seq.kv_version != self.version:
            return  # KV that spans a swap (policy continue) mixes two policies: not reused
        if seq.sampling.last_turn or seq.sampling.adapter is not None:
            return  # nothing will extend it / not the policy's KV
        entry = prefix_cache.Entry(seq.prompt + seq.tokens[:-1], *self._batch.slab.row_kv(row))
        assert entry.keys[0].shape[1] == len(entry.tokens)
        self.prefixes.insert(entry, extends=seq.hit.entry if seq.hit else None)

    def _match(self, seqs: list[_Seq]) -> None:
        """Each joiner's longest prefix in the prefix cache (adapters' rows: none)."""
        for seq in seqs:
            seq.hit = self.prefixes.match(seq.prompt) if seq.sampling.adapter is None else None
            seq.kv_version = self.version

    def _cached_rows(self, seqs: list[_Seq]) -> tuple[DynamicCache, torch.Tensor]:
        """Rows whose prompt the prefix cache holds but for its last token: their cached KV,
        right-aligned, and its mask (the last token is fed by the decode step)."""
        reused = [len(s.prompt) - 1 for s in seqs]
        past = max(reused)
        cache = DynamicCache(config=self.model.config)
        self._load_prefixes(cache, seqs, reused, past)
        mask_B_T = torch.zeros((len(seqs), past), dtype=torch.long, device=self.device)
        for i, r in enumerate(reused):
            mask_B_T[i, past - r :] = 1
        metrics.PREFILL_TOKENS.inc(len(seqs))
        metrics.PREFIX_CACHE_HIT_TOKENS.inc(sum(reused))
        return cache, mask_B_T

    def _prefill(self, seqs: list[_Seq]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """One forward over what each distinct prompt does not find in the prefix cache
        (`_match`): the episodes of a group share their prompt, so it is computed once and
        its KV and logits copied to each of them (each still samples on its own)."""
        first: dict[tuple, int] = {}
        rows = [
            first.setdefault(
                (
                    tuple(s.prompt),
                    id(s.hit.entry) if s.hit else 0,
                    s.hit.length if s.hit else 0,
                    s.sampling.adapter,
                ),
                len(first),
            )
            for s in seqs
        ]
        if len(first) == len(seqs):
            return self._prefill_rows(seqs)
        distinct = list({row: seq for row, seq in zip(rows, seqs, strict=True)}.values())
        cache, mask_B_T, logits_B_V = self._prefill_rows(distinct)
        index = torch.tensor(rows, device=self.device)
        for layer in _layers(cache):
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        metrics.PREFIX_CACHE_HIT_TOKENS.inc(
            sum(len(s.prompt) for s in seqs) - sum(len(s.prompt) for s in distinct)
        )
        return cache, mask_B_T.index_select(0, index), logits_B_V.index_select(0, index)

    def _prefill_rows(self, seqs: list[_Seq]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        reused = [s.hit.length if s.hit else 0 for s in seqs]
        past = max(reused)
        length = max(len(s.prompt) - r for s, r in zip(seqs, reused, strict=True))
        ids_B_T = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(seqs), past + length), dtype=torch.long)
        positions_B_T = torch.zeros((len(seqs), length), dtype=torch.long)
        cache = DynamicCache(config=self.model.config)
        for i, (seq, r) in enumerate(zip(seqs, reused, strict=True)):
            rest = seq.prompt[r:]
            ids_B_T[i, length - len(rest) :] = torch.tensor(rest)
            positions_B_T[i, length - len(rest) :] = torch.arange(r, len(seq.prompt))
            mask_B_T[i, past - r : past] = 1
            mask_B_T[i, past + length - len(rest) :] = 1
        if past:
            self._load_prefixes(cache, seqs, reused, past)
        metrics.PREFILL_TOKENS.inc(sum(len(s.prompt) for s in seqs) - sum(reused))
        metrics.PREFIX_CACHE_HIT_TOKENS.inc(sum(reused))
        ids_B_T, mask_B_T = ids_B_T.to(self.device), mask_B_T.to(self.device)
        with lora.using(self._adapters_of(seqs)):
            out = self.model(
                input_ids=ids_B_T,
                attention_mask=mask_B_T,
                position_ids=positions_B_T.to(self.device),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )
        cache = getattr(out, self._cache_arg)
        if past:
            mask_B_T = _right_align(cache, mask_B_T)
        return cache, mask_B_T, out.logits[:, -1, :]

    def _load_prefixes(
        self, cache: DynamicCache, seqs: list[_Seq], reused: list[int], past: int
    ) -> None:
        """Fill `cache` with each row's reused prefix, right-aligned to `past` columns."""
        first = next(s.hit.entry for s in seqs if s.hit)
        for layer_idx, like in enumerate(first.keys):
            heads, _, dim = like.shape
            keys = like.new_zeros((len(seqs), heads, past, dim), device=self.device)
            values = torch.zeros_like(keys)
            for i, (seq, r) in enumerate(zip(seqs, reused, strict=True)):
                if seq.hit:
                    keys[i, :, past - r :] = seq.hit.entry.keys[layer_idx][:, :r]
                    values[i, :, past - r :] = seq.hit.entry.values[layer_idx][:, :r]
            cache.update(keys, values, layer_idx)

    def _decode(self) -> torch.Tensor:
        slab = self._batch.slab
        # a row that joined this step from the prefix cache feeds its prompt's last token
        last_B_1 = torch.tensor(
            [[s.tokens[-1] if s.tokens else s.prompt[-1]] for s in self._batch.seqs],
            device=self.device,
        )
        cache, mask_B_T, positions_B_1 = slab.begin_step()
        with lora.using(self._adapters_of(self._batch.seqs)):
            out = self.model(
                input_ids=last_B_1,
                attention_mask=mask_B_T,
                position_ids=positions_B_1,
                use_cache=True,
                **{self._cache_arg: cache},
            )
        slab.end_step()
        return out.logits[:, -1, :]

    def _forms_text(self, tokens: list[int]) -> bool:
        """Whether `tokens` decode to some text, special tokens and an incomplete last
        character left out (the fast tokenizer's own decoder: microseconds)."""
        text = self._text_decoder.decode(tokens, skip_special_tokens=True)
        return bool(text.rstrip("\ufffd"))

    def _append(self, seqs: list[_Seq], logits_B_V: torch.Tensor) -> None:
        tokens, logprobs, tops = sample(logits_B_V.float(), [s.sampling for s in seqs], seqs)
        for seq, token, logprob, top in zip(seqs, tokens, logprobs, tops, strict=True):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if top is not None:
                seq.top.append(top)
            adapter = seq.sampling.adapter
            seq.versions.append(self._adapters.get(adapter, 0) if adapter else self.version)
            if token == self.eos_id or token in seq.sampling.stop_token_ids:
                seq.finish = "stop"
            elif seq.sampling.stop_strings and self._stopped_by_text(seq):
                seq.finish = "stop"
            elif len(seq.tokens) >= seq.sampling.max_new_tokens:
                seq.finish = "length"
            elif len(seq.prompt) + len(seq.tokens) >= self.max_context:
                seq.finish = "length"
        metrics.TOKENS.inc(len(seqs))


def sample(
    logits_B_V: torch.Tensor, params: list[Sampling], seqs: list[_Seq] | None = None
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """Sample one token per row; return the tokens and their logprobs under the distribution
    each was sampled from (tempered, top-p truncated and renormalized), and for rows that ask
    (`Sampling.top_logprobs`) the most likely tokens under that same distribution.

    All rows at once: one uniform draw per row (from the row's own generator when it has a
    seed, so a seeded request samples the same tokens in any batch) picks the token by
    inverse CDF over the row's (nucleus-truncated) distribution."""
    device = logits_B_V.device
    greedy_B = torch.tensor([p.temperature <= 0 for p in params], device=device)
    temps_B = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    logprobs_B_V = torch.log_softmax(logits_B_V / temps_B.to(device)[:, None], dim=-1)
    probs_B_V = logprobs_B_V.exp()
    top_p_B = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
    truncated = bool((top_p_B < 1.0).any())
    if truncated:  # keep the smallest set of most likely tokens whose mass reaches top_p
        sorted_B_V, order_B_V = probs_B_V.sort(dim=-1, descending=True)
        outside_B_V = sorted_B_V.cumsum(-1) - sorted_B_V >= top_p_B[:, None]
        probs_B_V = probs_B_V.scatter(-1, order_B_V, sorted_B_V.masked_fill(outside_B_V, 0.0))
        probs_B_V = probs_B_V / probs_B_V.sum(-1, keepdim=True)
    u_B = torch.rand(len(params), device=device)
    for i in range(len(params)):
        generator = seqs[i].generator if seqs is not None else None
        if generator is not None:
            u_B[i] = torch.rand(1, generator=generator, device=device)
    cdf_B_V = probs_B_V.cumsum(-1)
    drawn_B = torch.searchsorted(cdf_B_V, (u_B * cdf_B_V[:, -1])[:, None], right=True)[:, 0]
    tokens_B = torch.where(
        greedy_B, logprobs_B_V.argmax(-1), drawn_B.clamp(max=cdf_B_V.shape[1] - 1)
    )
    chosen_B = logprobs_B_V.gather(1, tokens_B[:, None])[:, 0]
    if truncated:
        nucleus_B = probs_B_V.gather(1, tokens_B[:, None])[:, 0].log()
        chosen_B = torch.where((top_p_B < 1.0) & ~greedy_B, nucleus_B, chosen_B)
    tops: list[TopLogprobs | None] = [None] * len(params)
    k = max(p.top_logprobs for p in params)
    if k:
        shown_B_V = logprobs_B_V
        if truncated:
            nucleus_B_V = ((top_p_B < 1.0) & ~greedy_B)[:, None]
            shown_B_V = torch.where(nucleus_B_V, probs_B_V.log(), logprobs_B_V)
        values_B_K, ids_B_K = shown_B_V.topk(min(k, shown_B_V.shape[1]), dim=-1)
        for i, p in enumerate(params):
            if p.top_logprobs:
                n = p.top_logprobs
                tops[i] = list(
                    zip(ids_B_K[i, :n].tolist(), values_B_K[i, :n].tolist(), strict=True)
                )
    return tokens_B.tolist(), chosen_B.tolist(), tops
