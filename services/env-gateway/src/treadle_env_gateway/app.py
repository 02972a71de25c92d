"""Env-gateway service: sessions over gRPC (rollout's data plane) and HTTP (people, tools).

rollout --CreateSession/Step/CloseSession (gRPC)--> EnvGatewayServicer --> SessionManager
trainer --SampleTasks (gRPC)----------------------> Env.sample_tasks (the env's dataset)
people  --/v1/envs, /v1/sessions (HTTP)-----------> SessionManager
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, Field

from treadle_common.proto.treadle.v1 import env_pb2_grpc
from treadle_common.service import ServiceRuntime
from treadle_env_gateway.envs.base import Action, EnvError, UnknownEnv
from treadle_env_gateway.grpc_service import EnvGatewayServicer
from treadle_env_gateway.sessions import SERVICE, CapacityExceeded, SessionManager, UnknownSession
from treadle_env_gateway.settings import EnvGatewaySettings


class CreateSessionBody(BaseModel):
    env: str = Field(description="Registered environment name")
    task: dict[str, Any] = Field(description="Env-specific task")
    seed: int = 0
    options: dict[str, Any] = Field(default_factory=dict)


class StepBody(BaseModel):
    text: str = Field("", description="The policy's text action")


def build(settings: EnvGatewaySettings) -> tuple[ServiceRuntime, SessionManager]:
    runtime = ServiceRuntime(SERVICE, settings)
    modules = tuple(m.strip() for m in settings.env_modules.split(",") if m.strip())
    sessions = SessionManager(
        replica=settings.instance,
        max_sessions=settings.env_max_sessions,
        idle_ttl_s=settings.env_idle_ttl_s,
        env_modules=modules,
        settings=settings,
    )
    env_pb2_grpc.add_EnvGatewayServicer_to_server(
        EnvGatewayServicer(sessions, runtime.progress.stage("step")), runtime.make_grpc_server()
    )
    runtime.set_info(lambda: {"envs": sorted(sessions.envs), "sessions": len(sessions.sessions)})
    _add_routes(runtime, sessions)
    return runtime, sessions


def _http_errors(exc: Exception) -> HTTPException:
    status = {EnvError: 400, UnknownEnv: 404, UnknownSession: 404, CapacityExceeded: 429}[type(exc)]
    return HTTPException(status, exc.args[0] if exc.args else str(exc))


def _add_routes(runtime: ServiceRuntime, sessions: SessionManager) -> None:
    app = runtime.app

    @app.get("/v1/envs", tags=["envs"])
    async def list_envs() -> dict:
        return {"envs": sorted(sessions.envs)}

    @app.post("/v1/sessions", tags=["sessions"])
    async def create(body: CreateSessionBody) -> dict:
        try:
            session, observation = await sessions.create(
                body.env, body.task, body.seed, body.options
            )
        except (EnvError, CapacityExceeded) as exc:
            raise _http_errors(exc) from exc
        return {"session_id": session.session_id, "observation": [m.__dict__ for m in observation]}

    @app.post("/v1/sessions/{session_id}/step", tags=["sessions"])
    async def step(session_id: str, body: StepBody) -> dict:
        try:
            result = await sessions.step(session_id, Action(text=body.text))
        except (EnvError, UnknownSession) as exc:
            raise _http_errors(exc) from exc
        return {
            "observation": [m.__dict__ for m in result.observation],
            "done": result.done,
            "reward": result.reward,
            "info": result.info,
        }

    @app.delete("/v1/sessions/{session_id}", tags=["sessions"])
    async def close(session_id: str) -> dict:
        await sessions.close(session_id)
        return {"closed": session_id}


async def expire_loop(runtime: ServiceRuntime, sessions: SessionManager) -> None:
    while not runtime.stop_event.is_set():
        await asyncio.sleep(min(5.0, sessions.idle_ttl_s / 2))
        await sessions.expire_idle()


async def main(settings: EnvGatewaySettings) -> None:
    runtime, sessions = build(settings)
    await runtime.serve(expire_loop(runtime, sessions))
