"""Infrastructure settings: endpoints, ports and secrets, from the environment (TREADLE_*).

Experiment choices live in recipes (`config.py`); where things run lives here.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from treadle_common import names

_LOCAL_SECRET = "treadle-local-secret"


class Settings(BaseSettings):
    """One class for every process. `TREADLE_REDIS_URL=... treadle-rollout` and so on."""

    model_config = SettingsConfigDict(env_prefix="TREADLE_", extra="ignore")

    environment: Literal["local", "production"] = Field(
        "local", description="`production` refuses the default secrets"
    )
    state_dir: Path = Field(Path(".treadle"), description="Local state: infra data, logs, pids")
    redis_url: str = Field(
        f"redis://127.0.0.1:{names.DEFAULT_INFRA_PORTS['redis']}", description="Redis URL"
    )
    nats_url: str = Field(
        f"nats://127.0.0.1:{names.DEFAULT_INFRA_PORTS['nats']}", description="NATS URL"
    )
    s3_endpoint: str = Field(
        f"127.0.0.1:{names.DEFAULT_INFRA_PORTS['s3']}", description="S3 endpoint host:port"
    )
    s3_access_key: str = Field(_LOCAL_SECRET, description="S3 access key")
    s3_secret_key: str = Field(_LOCAL_SECRET, description="S3 secret key")

    host: str = Field("127.0.0.1", description="Interface this process's servers bind to")
    http_port: int | None = Field(
        None, description="HTTP port of this service (default per service)"
    )
    grpc_port: int | None = Field(
        None, description="gRPC port of this service (default per service)"
    )
    base_port: int | None = Field(
        None, description="`treadle up`: assign the services' ports consecutively from here"
    )
    instance: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    weight_store_addr: str = Field("127.0.0.1:50051", description="weight-store gRPC address")
    trainer_url: str | None = Field(
        None, description="`treadle run` against a deployed stack: the trainer's HTTP URL"
    )
    rollout_url: str | None = Field(None, description="... and rollout's HTTP URL")
    weight_store_url: str | None = Field(None, description="... and the weight-store's HTTP URL")
    env_gateway_addr: str = Field("127.0.0.1:50052", description="env-gateway gRPC address")
    weight_store_dir: Path | None = Field(
        None, description="weight-store data dir for the local backend (default state_dir/weights)"
    )
    weight_store_backend: Literal["local", "s3"] = Field(
        "local", description="Where weights are kept"
    )
    weight_store_bucket: str = Field("treadle-weights", description="S3 bucket of the s3 backend")
    weight_store_keep_last: int = Field(8, ge=1, description="Versions kept per model, pins aside")
    weight_store_cache_mb: int = Field(1024, ge=0, description="Hot-chunk cache size")
    weight_store_dirty_mb: int = Field(
        2048,
        ge=1,
        description="Received bytes held in memory while they are written behind to the "
        "backend; past it, publishes wait for the disk or S3",
    )
    weight_store_gc_grace_s: float = Field(
        600.0,
        ge=0,
        description="Unreferenced chunks younger than this survive GC (resumable publishes)",
    )
    s3_secure: bool = Field(False, description="Use HTTPS for S3")

    env_max_sessions: int = Field(1024, ge=1, description="env-gateway: open sessions at most")
    env_idle_ttl_s: float = Field(
        600.0, gt=0, description="env-gateway: idle sessions expire after"
    )
    env_modules: str = Field(
        "", description="env-gateway: comma-separated modules to import that register extra envs"
    )
    rollout_model: Path | None = Field(None, description="HF model directory rollout serves")
    rollout_model_name: str | None = Field(None, description="weight-store name of that model")
    rollout_max_concurrent_tasks: int = Field(8, ge=1, description="Tasks in flight per replica")
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
    rollout_max_batch: int = Field(64, ge=1, description="rollout hf: sequences per decode step")
    rollout_prefix_cache_mb: int = Field(
        256, ge=0, description="rollout hf: KV of finished turns kept for reuse by prefix (0: off)"
    )
    rollout_max_context: int | None = Field(
        None, ge=16, description="rollout: context length (default: the model's)"
    )
    rollout_vllm_dtype: str = Field("auto", description="rollout vllm: dtype (float32 on CPU)")
    rollout_vllm_kv_cache_gb: int = Field(1, ge=1, description="rollout vllm: CPU KV cache")
    rollout_session_ttl_s: float = Field(
        3600.0, gt=0, description="rollout: idle recorded OpenAI-API sessions expire after"
    )
    trainer_lease_s: float = Field(
        15.0, gt=0, description="trainer: run-ownership lease; a dead owner's run resumes after"
    )
    reward_timeout_s: float = Field(30.0, gt=0, description="Reward request-reply timeout")
    reward_max_concurrency: int = Field(64, ge=1, description="reward: requests per scorer at once")
    reward_cache_size: int = Field(10_000, ge=0, description="reward: cached deterministic scores")
    judge_base_url: str = Field(
        "", description="reward llm_judge: OpenAI-compatible base URL (…/v1)"
    )
    judge_model: str = Field("", description="reward llm_judge: model name")
    judge_api_key: str = Field(
        "", description="reward llm_judge: API key, if the endpoint needs one"
    )
    reward_model_dir: str = Field(
        "", description="reward reward_model: HF sequence-classifier directory"
    )
    scorer_modules: str = Field(
        "", description="reward: comma-separated modules to import that register extra scorers"
    )

    heartbeat_interval_s: float = Field(2.0, gt=0, description="Seconds between heartbeats")
    drain_timeout_s: float = Field(20.0, gt=0, description="Max seconds to drain on SIGTERM")
    torch_threads: int = Field(
        0,
        ge=0,
        description="CPU threads torch may use in this process (rollout's engine, the "
        "trainer); 0: one per core. `treadle up` gives rollout half the cores, so an async "
        "run's generation and training do not fight over them",
    )
    log_level: str = Field("INFO", description="Python log level")
    log_json: bool = Field(False, description="Log JSON lines instead of console text")
    stall_after_s: float = Field(
        120.0, gt=0, description="A stage with pending work and no progress this long is stalled"
    )
    traces: Literal["file", "otlp", "off"] = Field(
        "file", description="Where spans go: JSON lines under trace_dir, an OTLP collector, nowhere"
    )
    trace_sample: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Fraction of tasks traced end to end (decided where a trace starts, "
        "followed by every hop). 1.0 traces every task: on the 2-core dev VM that cost a "
        "short sync step about 50 ms (`treadle bench step`)",
    )
    trace_dir: Path | None = Field(None, description="file traces (default state_dir/traces)")
    otlp_endpoint: str = Field("127.0.0.1:4317", description="OTLP gRPC collector (traces=otlp)")

    @model_validator(mode="after")
    def _refuse_default_secrets(self) -> Settings:
        if self.environment == "production" and _LOCAL_SECRET in (
            self.s3_access_key,
            self.s3_secret_key,
        ):
            raise ValueError("TREADLE_S3_ACCESS_KEY/SECRET_KEY must be set in production")
        return self

    def port(self, service: str, kind: Literal["http", "grpc"]) -> int:
        explicit = self.http_port if kind == "http" else self.grpc_port
        return explicit if explicit is not None else names.DEFAULT_PORTS[service][kind]


@lru_cache
def get_settings() -> Settings:
    return Settings()
