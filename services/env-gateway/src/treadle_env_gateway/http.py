"""The env-gateway's HTTP API (people and tools; rollout uses gRPC, `grpc.py`).

GET    /v1/envs                      registered environments
POST   /v1/sessions                  open a session: its first observation
POST   /v1/sessions/{id}/step        act: observation, done, reward, info
DELETE /v1/sessions/{id}
"""

from __future__ import annotations

from dataclasses import asdict

from fastapi import FastAPI, HTTPException

from treadle_common import auth
from treadle_common.api.envs import (
    Act,
    CreateSession,
    EnvList,
    ObservationMessage,
    SessionClosed,
    SessionOpened,
    Stepped,
)
from treadle_env_gateway.envs.base import Action, EnvError, Message, UnknownEnv
from treadle_env_gateway.sessions import CapacityExceeded, SessionManager, UnknownSession


def _http_errors(exc: Exception) -> HTTPException:
    status = {EnvError: 400, UnknownEnv: 404, UnknownSession: 404, CapacityExceeded: 429}[type(exc)]
    return HTTPException(status, exc.args[0] if exc.args else str(exc))


def mount(app: FastAPI, sessions: SessionManager) -> None:

    @app.get("/v1/envs", tags=["envs"], openapi_extra=auth.roles(auth.ANY))
    async def list_envs() -> EnvList:
        return EnvList(envs=sorted(sessions.envs))

    @app.post("/v1/sessions", tags=["sessions"], openapi_extra=auth.roles(auth.ROLLOUT))
    async def create(body: CreateSession) -> SessionOpened:
        try:
            session, observation = await sessions.create(
                body.env, body.task, body.seed, body.options
            )
        except (EnvError, CapacityExceeded) as exc:
            raise _http_errors(exc) from exc
        return SessionOpened(session_id=session.session_id, observation=_messages(observation))

    @app.post(
        "/v1/sessions/{session_id}/step", tags=["sessions"], openapi_extra=auth.roles(auth.ROLLOUT)
    )
    async def step(session_id: str, body: Act) -> Stepped:
        try:
            result = await sessions.step(session_id, Action(text=body.text))
        except (EnvError, UnknownSession) as exc:
            raise _http_errors(exc) from exc
        return Stepped(
            observation=_messages(result.observation),
            done=result.done,
            reward=result.reward,
            info=result.info,
        )

    @app.delete(
        "/v1/sessions/{session_id}", tags=["sessions"], openapi_extra=auth.roles(auth.ROLLOUT)
    )
    async def close(session_id: str) -> SessionClosed:
        await sessions.close(session_id)
        return SessionClosed(closed=session_id)


def _messages(messages: list[Message]) -> list[ObservationMessage]:
    return [ObservationMessage(**asdict(m)) for m in messages]
