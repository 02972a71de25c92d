"""The env-gateway's settings (TREADLE_*): the common ones and its own."""

from __future__ import annotations

from pydantic import Field

from treadle_common.settings import Settings


class EnvGatewaySettings(Settings):
    """Sessions and the extra env modules."""

    env_max_sessions: int = Field(1024, ge=1, description="env-gateway: open sessions at most")
    env_idle_ttl_s: float = Field(
        600.0, gt=0, description="env-gateway: idle sessions expire after"
    )
    env_modules: str = Field(
        "", description="env-gateway: comma-separated modules to import that register extra envs"
    )
