"""What every service answers on its ops endpoints (`service.ServiceRuntime` mounts them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StageProgress(BaseModel):
    """One stage of a service's work (`progress.Stage`): stalled = work pending, none done."""

    pending: int
    done: int
    idle_s: float
    stalled: bool


class Liveness(BaseModel):
    """`GET /healthz`: 200 while the process makes progress, 503 (same body) naming the
    stages that stalled."""

    status: str = Field(description="'ok' or 'stalled'")
    service: str
    stages: list[str] = Field(default_factory=list, description="The stalled stages")


class Readiness(BaseModel):
    """`GET /readyz`: 200 when every dependency answers, 503 (same body) when one does not."""

    ready: bool
    draining: bool = False
    checks: dict[str, str] = Field(description="Dependency -> 'ok' or why not")


class ServiceInfo(BaseModel):
    """`GET /v1/info`, the part every service has; a service's own model extends it."""

    model_config = ConfigDict(extra="allow")  # a newer service's fields pass an older client

    service: str
    version: str
    instance: str
    uptime_s: float
    progress: dict[str, StageProgress] = Field(default_factory=dict)
