"""Infrastructure settings: endpoints, ports and secrets, from the environment (TREADLE_*).

Experiment choices live in recipes (`config.py`); where things run lives here. `Settings`
holds what every process reads; each service extends it with its own fields
(`treadle_rollout.settings.RolloutSettings`, ...), the CLI with its own
(`treadle_cli.settings.CliSettings`). The names stay `TREADLE_<FIELD>`, so compose and k8s
set them the same way. A process builds its settings once and hands them down: nothing
reads a global.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from treadle_common import names
from treadle_common.auth.infra import has_credentials
from treadle_common.auth.policy import TokenTable, load_table, read_token

LOCAL_SECRET = "treadle-local-secret"
"""The S3 keys of local development (the embedded S3); production refuses them."""


PROCESS_ENVIRONMENT: dict[str, tuple[str, str]] = {
    "TREADLE_MALLOC_TUNING": (
        "1",
        "`0` leaves glibc's malloc defaults in weight-moving processes "
        "(`treadle_common.runtime.malloc`, "
        "applied at start, before the settings are read)",
    ),
    "TREADLE_MALLOC_TRIM_MB": (
        "1024",
        "glibc's `M_TRIM_THRESHOLD` in MiB: freed memory below it stays in the process",
    ),
    "TREADLE_FREE_PORT_RANGE": (
        "10000-32768",
        "`low-high`: where `treadle up`, `treadle infra up`, `treadle bench` and the test "
        "fixtures choose free ports (parallel test workers each get a slice)",
    ),
    "TREADLE_TRAINER_TORCH_THREADS": (
        "cores / lanes",
        "`treadle up`: the trainer's torch threads (its `TREADLE_TORCH_THREADS`); by default "
        "the cores divided among its torch lanes",
    ),
    "TREADLE_PUBLISH_WORKER_TOKEN": (
        "the parent's",
        "set by a trainer for its publish worker (`trainer_publish_worker`): the bearer token "
        "the child presents to the weight-store, kept off its command line; never set by hand",
    ),
}
"""`TREADLE_*` variables read outside the settings classes: name -> (default, what it does).
The docs' settings reference lists them with the fields (`scripts/gen_docs.py`)."""


class Settings(BaseSettings):
    """What every process reads. `TREADLE_REDIS_URL=... treadle-rollout` and so on."""

    model_config = SettingsConfigDict(env_prefix="TREADLE_", extra="ignore")

    environment: Literal["local", "production"] = Field(
        "local", description="`production` refuses the default secrets"
    )
    transport_security: Literal["tls", "mesh", "private-network"] = Field(
        "tls",
        description="Who encrypts the traffic between services in production: `tls` (this "
        "process, with TREADLE_TLS_CERT_FILE, _KEY_FILE and _CA_FILE, which production then "
        "requires), `mesh` (a service mesh's mTLS) or `private-network` (a network only this "
        "deployment uses, e.g. compose's bridge on one host); the last two are logged as a "
        "warning at every start",
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
    scheduling_policy: Literal["fair", "fifo"] = Field(
        "fair",
        description="How runs share rollout's task slots and the trainer's torch thread "
        "(`treadle_common.fleet.scheduling`): fair (priority, then weighted fair share) or fifo",
    )
    s3_access_key: str = Field(LOCAL_SECRET, description="S3 access key")
    s3_secret_key: str = Field(LOCAL_SECRET, description="S3 secret key")

    auth: Literal["on", "off"] = Field(
        "on",
        description="`on`: every endpoint but /healthz and /readyz needs a bearer token of a "
        "role allowed to call it (`treadle_common.auth.policy`); `off` only with environment=local",
    )
    auth_tokens: SecretStr | None = Field(
        None,
        description='A server\'s token table: JSON `{"admin": "...", "trainer": ["...", ...]}` '
        "(roles: admin, trainer, rollout, agent, read)",
    )
    auth_tokens_file: Path | None = Field(
        None, description="... or a file holding that JSON (a mounted Secret)"
    )
    token: SecretStr | None = Field(
        None, description="The bearer token this process presents to the services it calls"
    )
    token_file: Path | None = Field(None, description="... or a file holding it")

    host: str = Field("127.0.0.1", description="Interface this process's servers bind to")
    tls_cert_file: Path | None = Field(
        None, description="This process's servers speak TLS with this certificate (PEM chain)"
    )
    tls_key_file: Path | None = Field(None, description="... and this key (PEM)")
    tls_ca_file: Path | None = Field(
        None, description="The CA bundle this process's clients verify peers with (TLS on)"
    )
    max_body_mb: float = Field(
        64.0, gt=0, description="HTTP request bodies larger than this are refused (413)"
    )
    http_port: int | None = Field(
        None, description="HTTP port of this service (default per service)"
    )
    grpc_port: int | None = Field(
        None, description="gRPC port of this service (default per service)"
    )
    instance: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="This process's name in heartbeats, leases and consumer groups "
        "(default: host name and pid)",
    )

    weight_store_addr: str = Field("127.0.0.1:50051", description="weight-store gRPC address")
    weight_store_retry_s: float = Field(
        60.0,
        gt=0,
        description="How long a call to the weight-store is retried while it is unavailable "
        "(restarting); past it the caller's own recovery takes over (a run resumes later)",
    )
    env_gateway_addr: str = Field("127.0.0.1:50052", description="env-gateway gRPC address")
    reward_timeout_s: float = Field(30.0, gt=0, description="Reward request-reply timeout")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="Seconds between heartbeats")
    drain_timeout_s: float = Field(20.0, gt=0, description="Max seconds to drain on SIGTERM")
    torch_threads: int = Field(
        0,
        ge=0,
        description="CPU threads torch may use in this process (rollout's engine, the "
        "trainer); 0: one per core. `treadle up` gives rollout half the cores, so an async "
        "run's generation and training do not fight over them",
    )
    tenant_max_episodes: int = Field(
        0,
        ge=0,
        description="Quota: episodes a tenant may have in flight across the fleet (rollout's "
        "RL tasks wait; its OpenAI requests get 429); 0: no limit",
    )
    tenant_max_tokens_per_minute: int = Field(
        0,
        ge=0,
        description="Quota: tokens a tenant's episodes and requests may generate per minute "
        "(past it, RL tasks wait and OpenAI requests get 429 until the next minute); 0: none",
    )
    tenant_max_stored_bytes: int = Field(
        0,
        ge=0,
        description="Quota: bytes of weights the weight-store keeps for a tenant's models (a "
        "publish past it is refused: RESOURCE_EXHAUSTED, a run fails naming it); 0: none",
    )
    log_level: str = Field("INFO", description="Python log level")
    log_json: bool = Field(False, description="Log JSON lines instead of console text")
    liveness_stall_s: float = Field(
        600.0,
        ge=0,
        description="/healthz fails once a stage only this process can advance (generate, "
        "train, score, env step) has had work and no progress this long (0: never)",
    )
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
        if self.environment != "production":
            return self
        if self.auth == "off":
            raise ValueError("TREADLE_AUTH=off is refused in production")
        if "redis_url" in self.model_fields_set:  # unset: a service that uses Redis checks
            self.refuse_redis_without_credentials()
        if not has_credentials(self.nats_url):
            raise ValueError(
                "TREADLE_NATS_URL must carry credentials in production "
                "(nats://USER:PASSWORD@host:4222)"
            )
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        if self.transport_security == "tls" and not all(tls):
            raise ValueError(
                "production needs TLS between services: set TREADLE_TLS_CERT_FILE, "
                "TREADLE_TLS_KEY_FILE and TREADLE_TLS_CA_FILE, or say what provides it "
                "instead (TREADLE_TRANSPORT_SECURITY=mesh or private-network)"
            )
        return self

    def refuse_redis_without_credentials(self) -> None:
        """Production: a Redis URL without credentials is refused (a service that uses Redis
        checks at start; the others get no Redis URL at all)."""
        if self.environment == "production" and not has_credentials(self.redis_url):
            raise ValueError(
                "TREADLE_REDIS_URL must carry credentials in production "
                "(redis://USER:PASSWORD@host:6379)"
            )

    def transport_warning(self) -> str | None:
        """What a production process says at start when it does not encrypt its traffic."""
        if self.environment != "production" or self.transport_security == "tls":
            return None
        return (
            f"traffic between services is in clear here: TREADLE_TRANSPORT_SECURITY="
            f"{self.transport_security} says the {self.transport_security} provides "
            "confidentiality; set the TREADLE_TLS_* files otherwise"
        )

    def token_table(self) -> TokenTable | None:
        """This server's token table; None only when auth is off. Auth on without a table is
        an error that says how to give one."""
        if self.auth == "off":
            return None
        tokens = self.auth_tokens.get_secret_value() if self.auth_tokens else None
        table = load_table(tokens, self.auth_tokens_file)
        if table is None:
            raise ValueError(
                "auth is on but no tokens are configured: set TREADLE_AUTH_TOKENS or "
                "TREADLE_AUTH_TOKENS_FILE (`treadle up` writes one under its state dir), or "
                "TREADLE_AUTH=off for local development"
            )
        return table

    def client_token(self) -> str | None:
        """The bearer token this process presents (`TREADLE_TOKEN` / `TREADLE_TOKEN_FILE`)."""
        token = self.token.get_secret_value() if self.token else None
        return read_token(token, self.token_file)

    def port(self, service: str, kind: Literal["http", "grpc"]) -> int:
        explicit = self.http_port if kind == "http" else self.grpc_port
        return explicit if explicit is not None else names.DEFAULT_PORTS[service][kind]
