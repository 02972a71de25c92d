"""The env-gateway's settings (TREADLE_*): the common ones and its own."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from treadle_common.config.settings import Settings


class EnvGatewaySettings(Settings):
    """Sessions and the extra env modules."""

    env_max_sessions: int = Field(1024, ge=1, description="env-gateway: open sessions at most")
    env_idle_ttl_s: float = Field(
        600.0, gt=0, description="env-gateway: idle sessions expire after"
    )
    env_modules: str = Field(
        "", description="env-gateway: comma-separated modules to import that register extra envs"
    )
    env_sandbox: Literal["unshare", "bwrap", "docker"] = Field(
        "unshare",
        description=(
            "env-gateway: where untrusted code runs: `unshare` (root gateway), `bwrap` "
            "(bubblewrap, no root needed) or `docker` (a container per run, via the engine's "
            "socket); an unavailable one fails every run as sandbox_error, never downgrades"
        ),
    )
    env_sandbox_max_concurrent: int = Field(
        8,
        ge=1,
        le=1024,
        description="env-gateway: sandboxed runs at once (a test run's two sandboxes count "
        "as one); past them a run waits its turn (`treadle_env_sandbox_queued_total`)",
    )
    env_verifiers_python: str = Field(
        "",
        description="env-gateway: the interpreter of a virtualenv with verifiers 0.4 (the "
        "`verifiers-v1` env's workers; `scripts/setup_verifiers.sh` makes .venv-verifiers)",
    )
    env_sandbox_image: str = Field(
        "python:3.11-slim-bookworm",
        description="env-gateway: the `docker` sandbox's image (any image with python3)",
    )
