"""The env-gateway's HTTP API (people and tools; rollout's data plane is gRPC, `env.proto`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class EnvList(BaseModel):
    """`GET /v1/envs`."""

    envs: list[str]


class ObservationMessage(BaseModel):
    role: str = Field(description="system | user | tool")
    content: str
    tool_call_id: str = ""


class CreateSession(BaseModel):
    """`POST /v1/sessions`."""

    env: str = Field(description="Registered environment name")
    task: dict[str, Any] = Field(description="Env-specific task")
    seed: int = 0
    options: dict[str, Any] = Field(default_factory=dict)


class SessionOpened(BaseModel):
    session_id: str
    observation: list[ObservationMessage]


class Act(BaseModel):
    """`POST /v1/sessions/{id}/step`."""

    text: str = Field("", description="The policy's text action")


class Stepped(BaseModel):
    observation: list[ObservationMessage]
    done: bool
    reward: float | None = Field(None, description="The env's own reward, when it gives one")
    info: dict[str, Any] = Field(default_factory=dict)


class SessionClosed(BaseModel):
    """`DELETE /v1/sessions/{id}`."""

    closed: str
