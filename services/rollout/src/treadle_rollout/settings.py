"""Rollout's settings (TREADLE_*): the common ones and its own."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from treadle_common.config.settings import Settings


class RolloutSettings(Settings):
    """The model rollout serves, its engine and how many tasks it plays at once."""

    rollout_model: Path | None = Field(None, description="HF model directory rollout serves")
    rollout_model_name: str | None = Field(None, description="weight-store name of that model")
    rollout_max_concurrent_tasks: int = Field(8, ge=1, description="Tasks in flight per replica")
    rollout_reclaim_idle_ms: int = Field(
        60_000,
        ge=100,
        description="rollout: a task its replica stopped heartbeating for this long is "
        "reclaimed by another replica",
    )
    rollout_max_deliveries: int = Field(
        3, ge=1, description="rollout: a task delivered more often goes to the dead letters"
    )
    rollout_engine: Literal["hf", "vllm", "openai"] = Field(
        "hf",
        description="rollout engine: hf (transformers), vllm (needs .venv-vllm) or openai "
        "(an OpenAI-compatible server; fixed policy)",
    )
    rollout_openai_base_url: str = Field("", description="rollout openai: server base URL (…/v1)")
    rollout_openai_model: str = Field("", description="rollout openai: served model name")
    rollout_openai_api_key: str = Field("", description="rollout openai: API key, if needed")
    rollout_swap_policy: Literal["continue", "abort"] = Field(
        "continue",
        description="In-flight sequences at a weight swap: continue with new weights, or abort "
        "and regenerate the turn",
    )
    rollout_max_queued: int = Field(
        256,
        ge=1,
        description="rollout: client generation requests (OpenAI API, gRPC Generate) in "
        "flight at once; more are refused with 429 / RESOURCE_EXHAUSTED",
    )
    rollout_engine_process: bool = Field(
        True,
        description="rollout hf: run the engine in a process of its own, so that serving "
        "(HTTP, SSE, gRPC) and generation do not share one Python interpreter lock",
    )
    rollout_engine_cpus: str = Field(
        "",
        description="rollout hf: CPUs the engine computes on, the service's own threads on the "
        "rest: auto (the last torch_threads CPUs, if one is left), a list (2,3 or 2-3), or "
        "empty (no binding; treadle up sets auto)",
    )
    rollout_max_batch: int = Field(64, ge=1, description="rollout hf: sequences per decode step")
    rollout_prefix_cache_mb: int = Field(
        256, ge=0, description="rollout hf: KV of finished turns kept for reuse by prefix (0: off)"
    )
    rollout_max_context: int | None = Field(
        None, ge=16, description="rollout: context length (default: the model's)"
    )
    rollout_vllm_dtype: str = Field("auto", description="rollout vllm: dtype (float32 on CPU)")
    rollout_vllm_kv_cache_gb: int = Field(1, ge=1, description="rollout vllm: CPU KV cache")
    rollout_vllm_max_lora_rank: int = Field(
        0,
        ge=0,
        le=256,
        description="rollout vllm: serve LoRA adapters up to this rank (the Tinker API's "
        "sampler weights, a LoRA run's versions); 0: vLLM starts without LoRA support",
    )
    rollout_vllm_max_loras: int = Field(
        4, ge=1, description="rollout vllm: adapters in one batch at once"
    )
    rollout_session_ttl_s: float = Field(
        3600.0, gt=0, description="rollout: idle recorded OpenAI-API sessions expire after"
    )
    rollout_fault_logit_noise: float = Field(
        0.0,
        ge=0,
        description="rollout hf, fault injection (tests, `treadle bench mismatch`): add a fixed "
        "bias, drawn once per vocabulary token from N(0, this squared), to the tempered logits of "
        "every sampled (not greedy) token: an engine whose policy differs from the trainer's, as "
        "a miscalibrated kernel or quantisation makes it. Recorded logprobs are the biased "
        "distribution's (what the engine sampled from); 0: off",
    )
    rollout_tool_parser: str = Field(
        "auto",
        description="rollout: how the OpenAI API reads tool calls from generated text: auto "
        "(from the chat template), none, hermes, llama3_json, or package.module:Class",
    )
    rollout_stream_interval_ms: float = Field(
        10.0,
        ge=0,
        le=1000,
        description="rollout: a streamed OpenAI response sends what was generated at most "
        "once per this interval (the first and last tokens at once); 0: every decode step",
    )
    rollout_stream_events_per_s: float = Field(
        500.0,
        ge=0,
        description="rollout: all streamed OpenAI responses together send about this many "
        "events per second at most: with N streams open each one's interval is N / this "
        "(never below rollout_stream_interval_ms), so many streams cost the engine no more "
        "than a few; 0: no bound",
    )
