"""`hf` engine: a transformers causal LM with continuous batching, on CPU or GPU.

One scheduler task owns the model. Going from idle to busy it first waits a few event-loop
turns, so that requests released together join one prefill (`gather`). Each iteration (a
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
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle_common.clients.torch_weights import ChunkCache
from treadle_rollout import metrics
from treadle_rollout.engines import cpus as cpus_mod
from treadle_rollout.engines import grammar, prefix_cache
from treadle_rollout.engines.base import (
    ContextOverflow,
    Engine,
    Generation,
    Sampling,
    TopLogprobs,
)
from treadle_rollout.engines.hf_batch import Batch, Forwards, Seq
from treadle_rollout.engines.hf_weights import SwapPolicy, WeightChanges
from treadle_rollout.engines.kv_slab import KVSlab

GATHER_TURNS = 32
"""At most this many event-loop turns to gather requests when the engine wakes (`gather`)."""
QUIET_TURNS = 3
"""Turns in a row without a new request that end the gathering."""


def _slab(model, device: str, max_batch: int) -> KVSlab:
    """The running batch's KV slab, shaped for `model`."""
    config = model.config
    heads = config.num_attention_heads
    return KVSlab(
        config.num_hidden_layers,
        getattr(config, "num_key_value_heads", None) or heads,
        getattr(config, "head_dim", None) or config.hidden_size // heads,
        model.dtype,
        device,
        max_batch,
    )


class HFEngine(WeightChanges, Engine):
    name = "hf"
    structured_outputs = True

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
        logit_noise: float = 0.0,
    ):
        """`cpus`: the CPUs the engine's thread (all its model work) runs on (`cpus.py`);
        `logit_noise`: a mismatch injected on purpose (`logit_bias`)."""
        self.model_name = model_name
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        fast = getattr(self.tokenizer, "backend_tokenizer", None)
        # the worker thread's own copy (`_forms_text`): never borrowed by the event loop's
        # tokenizer calls
        self._text_decoder = Tokenizer.from_str(fast.to_str()) if fast else self.tokenizer
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(self.device)  # type: ignore[arg-type]  # transformers' `to` typing
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
        self.llg_tokenizer: Any = None  # llguidance's, made at the first grammar (`constraint`)
        self.bias_V = logit_bias(int(model.config.vocab_size), logit_noise, self.device)
        """Added to sampled rows' tempered logits (fault injection; None: off)."""
        self.forwards = Forwards(self.model, self.device, self.pad_id)
        """The model's prefill and decode forward passes."""
        self._batch = Batch(_slab(self.model, self.device, max_batch))
        self._init_queues()
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="hf-engine", initializer=cpus_mod.bind, initargs=(cpus,)
        )
        """The engine's one thread: bursts, swaps and adapter changes, one at a time."""
        self._init_counters()

    def _init_queues(self) -> None:
        """What waits for the engine: requests, swaps, adapter changes."""
        self._waiting: list[Seq] = []
        self._waiting_lock = threading.Lock()
        """`_submit` (the event loop) appends while a burst (the worker thread) takes."""
        self._finished: list[Seq] = []
        self._joining: list[Seq] = []
        self._closed = False
        self._init_changes()
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task | None = None

    def _init_counters(self) -> None:
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
    ) -> Seq:
        if len(prompt_tokens) >= self.max_context:
            raise ContextOverflow(
                f"prompt of {len(prompt_tokens)} tokens leaves no room in the "
                f"{self.max_context}-token context"
            )
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        seq = Seq(list(prompt_tokens), sampling, future, generator, on_piece=on_piece)
        seq.constraint = constraint(self, sampling.grammar)
        if streamed:
            seq.progress = asyncio.Event()
            future.add_done_callback(lambda _: seq.progress.set() if seq.progress else None)
        with self._waiting_lock:
            self._waiting.append(seq)
        self._ensure_scheduler()
        return seq

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
            # an adapter op queued while others applied is work too: sleeping on it would
            # lose its wake-up (its tasks wait for it, so no request would come to wake us)
            if not (self._batch.seqs or self._waiting or self._swaps or self._adapter_ops):
                self._wake.clear()
                await self._wake.wait()
                continue
            if not (self._batch.seqs or self._swaps):  # idle -> busy
                await gather(self._waiting)
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

    def _take_joiners(self) -> list[Seq]:
        """The waiting requests that fit in the batch, oldest episodes first (ties keep
        arrival order); cancelled ones are dropped."""
        with self._waiting_lock:
            joiners = [s for s in self._waiting if not s.future.done()]
            room = max(0, self.max_batch - len(self._batch.seqs))
            if len(joiners) > room:
                joiners.sort(key=lambda s: s.sampling.priority)
            joiners, self._waiting = joiners[:room], joiners[room:]
        return joiners

    def _adapters_of(self, seqs: list[Seq]) -> list[str | None] | None:
        """Each row's adapter for `lora.using` (the policy's rows: its adapter, if any);
        None when no row has one (the plain model)."""
        names = [s.sampling.adapter or self.policy_adapter for s in seqs]
        return names if any(n is not None for n in names) else None

    def _deliver(self, finished: list[Seq], progressed: list[Seq]) -> None:
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
    def _burst(self, loop: asyncio.AbstractEventLoop, joiners: list[Seq]) -> None:
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
            seq.shown = seq.shown or forms_text(self._text_decoder, seq.tokens)
            progressed.append(seq)
        if finished or progressed:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(self._deliver, finished, progressed)

    @torch.inference_mode()
    def _step(self, joiners: list[Seq]) -> None:
        self._match(joiners)
        # a prompt that the prefix cache holds but for its last token needs no forward of its
        # own: its row joins with the cached KV and feeds that token in this step's decode,
        # as a generated token is fed (a prefill forward of a few rows costs about 0.6 of a
        # 30-row decode step on a small model)
        folded: list[Seq] = []
        rest: list[Seq] = []
        for seq in joiners:
            whole = seq.hit is not None and seq.hit.length == len(seq.prompt) - 1
            (folded if whole else rest).append(seq)
        if rest:
            self.prefill_forwards += 1
            cache, mask_B_T, logits_B_V = self.forwards.prefill(rest, self._adapters_of)
            self._append(rest, logits_B_V)
            self._batch.add(rest, cache, mask_B_T)
            self._retire()
        if folded:
            self.folded_joins += len(folded)
            self._batch.add(folded, *self.forwards.cached_rows(folded))
        if self._batch.seqs:
            self.decode_steps += 1
            self.decode_rows += len(self._batch.seqs)
            self._append(self._batch.seqs, self.forwards.decode(self._batch, self._adapters_of))
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

    def _remember(self, row: int, seq: Seq) -> None:
        """Put the KV of a finished row in the prefix cache: it covers the prompt and every
        generated token but the last (which was sampled, never fed)."""
        if self.prefixes.max_bytes <= 0 or seq.kv_version != self.version:
            return  # KV that spans a swap (policy continue) mixes two policies: not reused
        if seq.sampling.last_turn or seq.sampling.adapter is not None:
            return  # nothing will extend it / not the policy's KV
        entry = prefix_cache.Entry(seq.prompt + seq.tokens[:-1], *self._batch.slab.row_kv(row))
        assert entry.keys[0].shape[1] == len(entry.tokens)
        self.prefixes.insert(entry, extends=seq.hit.entry if seq.hit else None)

    def _match(self, seqs: list[Seq]) -> None:
        """Each joiner's longest prefix in the prefix cache (adapters' rows: none)."""
        for seq in seqs:
            seq.hit = self.prefixes.match(seq.prompt) if seq.sampling.adapter is None else None
            seq.kv_version = self.version

    def _append(self, seqs: list[Seq], logits_B_V: torch.Tensor) -> None:
        params, logits_B_V = [s.sampling for s in seqs], masked(seqs, logits_B_V.float())
        tokens, logprobs, tops = sample(logits_B_V, params, seqs, self.bias_V)
        for seq, token, logprob, top in zip(seqs, tokens, logprobs, tops, strict=True):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if top is not None:
                seq.top.append(top)
            adapter = seq.sampling.adapter
            seq.versions.append(self._adapters.get(adapter, 0) if adapter else self.version)
            if seq.constraint is not None:  # complete, it allows only the end-of-text token
                seq.constraint.advance(token)
            if token == self.eos_id or token in seq.sampling.stop_token_ids:
                seq.finish = "stop"
            elif seq.sampling.stop_strings and stopped_by_text(self.tokenizer, seq):
                seq.finish = "stop"
            elif len(seq.tokens) >= seq.sampling.max_new_tokens:
                seq.finish = "length"
            elif len(seq.prompt) + len(seq.tokens) >= self.max_context:
                seq.finish = "length"
        metrics.TOKENS.inc(len(seqs))


async def gather(waiting: list[Seq]) -> None:
    """Idle -> busy: let the requests released together arrive together.

    A weight swap un-gates every waiting group at once, but their episodes reach
    `generate` over several event-loop turns (lock hand-offs, then each group's gate).
    Stepping at the first request would prefill and decode the first group alone and
    the others one step later each (measured: 20-30 ms of a 0.1 s sync generation).
    So: a few loop turns, until `QUIET_TURNS` turns in a row add no request (at most
    `GATHER_TURNS`); each idle turn costs microseconds."""
    quiet, seen = 0, len(waiting)
    for _ in range(GATHER_TURNS):
        await asyncio.sleep(0)
        quiet = quiet + 1 if len(waiting) == seen else 0
        seen = len(waiting)
        if quiet >= QUIET_TURNS:
            return


def forms_text(decoder: Any, tokens: list[int]) -> bool:
    """Whether `tokens` decode to some text, special tokens and an incomplete last character
    left out (the worker thread's own fast-tokenizer decoder: microseconds)."""
    return bool(decoder.decode(tokens, skip_special_tokens=True).rstrip("\ufffd"))


def constraint(engine: HFEngine, grammar_text: str | None) -> grammar.Constraint | None:
    """A generation's grammar matcher; the engine's llguidance tokenizer is made once."""
    if grammar_text is None:
        return None
    if engine.llg_tokenizer is None:
        vocab = int(getattr(engine.model, "config").vocab_size)  # noqa: B009 (typed Any)
        engine.llg_tokenizer = grammar.llg_tokenizer(engine.tokenizer, vocab, [engine.eos_id])
    return grammar.Constraint(engine.llg_tokenizer, grammar_text)


def masked(seqs: list[Seq], logits_B_V: torch.Tensor) -> torch.Tensor:
    """The logits with each constrained row's disallowed tokens at -inf (a copy: the prefix
    cache may hold the step's logits)."""
    rows = [(i, s.constraint) for i, s in enumerate(seqs) if s.constraint is not None]
    if not rows:
        return logits_B_V
    logits_B_V = logits_B_V.clone()
    grammar.apply_masks(logits_B_V, rows)
    return logits_B_V


def stopped_by_text(tokenizer, seq: Seq) -> bool:
    """A stop string in the text of the last tokens (every token is at least one
    character, so a window one longer than the longest stop string covers it)."""
    stops = seq.sampling.stop_strings
    window = max(len(s) for s in stops) + 1
    tail = tokenizer.decode(seq.tokens[-window:])
    return any(s in tail for s in stops)


def logit_bias(vocab: int, noise: float, device: str, seed: int = 0) -> torch.Tensor | None:
    """A fixed bias per vocabulary token, N(0, noise^2), seeded (`RolloutSettings.
    rollout_fault_logit_noise`): the same mismatch on every run; None when noise is 0."""
    if noise <= 0:
        return None
    generator = torch.Generator().manual_seed(seed)
    return (noise * torch.randn(vocab, generator=generator)).to(device)


def sample(
    logits_B_V: torch.Tensor,
    params: list[Sampling],
    seqs: list[Seq] | None = None,
    bias_V: torch.Tensor | None = None,
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """Sample one token per row; return the tokens and their logprobs under the distribution
    each was sampled from (tempered, top-p truncated and renormalized), and for rows that ask
    (`Sampling.top_logprobs`) the most likely tokens under that same distribution.

    All rows at once: one uniform draw per row (from the row's own generator when it has a
    seed, so a seeded request samples the same tokens in any batch) picks the token by
    inverse CDF over the row's (nucleus-truncated) distribution. `bias_V`, when given, is
    added to the sampled rows' tempered logits first (`logit_bias`)."""
    device = logits_B_V.device
    greedy_B = torch.tensor([p.temperature <= 0 for p in params], device=device)
    temps_B = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    scaled_B_V = logits_B_V / temps_B.to(device)[:, None]
    if bias_V is not None:  # an injected mismatch, on sampled rows only (greedy stays clean)
        scaled_B_V = scaled_B_V + (~greedy_B)[:, None] * bias_V[: scaled_B_V.shape[1]]
    logprobs_B_V = torch.log_softmax(scaled_B_V, dim=-1)
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
