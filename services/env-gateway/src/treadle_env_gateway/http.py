"""The env-gateway's HTTP API (people and tools; rollout uses gRPC, `grpc.py`).

GET    /v1/envs                      registered environments
POST   /v1/sessions                  open a session: its first observation
POST   /v1/sessions/{id}/step        act: observation, done, reward, info
DELETE /v1/sessions/{id}

A refusal is the gateway's error (`errors.py`), answered by the service runtime.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from treadle_common.api.envs import (
    Act,
    CreateSession,
    EnvList,
    ObservationMessage,
    SessionClosed,
    SessionOpened,
    Stepped,
)
from treadle_common.auth import policy as auth
from treadle_env_gateway.envs.base import Action, Message
from treadle_env_gateway.sessions import SessionManager

router = APIRouter(prefix="/v1")


def session_manager(request: Request) -> SessionManager:
    return request.app.state.sessions


Sessions = Annotated[SessionManager, Depends(session_manager)]
ROLLOUT = auth.roles(auth.ROLLOUT)


@router.get("/envs", tags=["envs"], openapi_extra=auth.roles(auth.ANY))
async def list_envs(sessions: Sessions) -> EnvList:
    return EnvList(envs=sorted(sessions.envs))


@router.post("/sessions", tags=["sessions"], openapi_extra=ROLLOUT)
async def create(body: CreateSession, sessions: Sessions) -> SessionOpened:
    session, observation = await sessions.create(body.env, body.task, body.seed, body.options)
    return SessionOpened(session_id=session.session_id, observation=_messages(observation))


@router.post("/sessions/{session_id}/step", tags=["sessions"], openapi_extra=ROLLOUT)
async def step(session_id: str, body: Act, sessions: Sessions) -> Stepped:
    result = await sessions.step(session_id, Action(text=body.text))
    return Stepped(
        observation=_messages(result.observation),
        done=result.done,
        reward=result.reward,
        info=result.info,
    )


@router.delete("/sessions/{session_id}", tags=["sessions"], openapi_extra=ROLLOUT)
async def close(session_id: str, sessions: Sessions) -> SessionClosed:
    await sessions.close(session_id)
    return SessionClosed(closed=session_id)


def _messages(messages: list[Message]) -> list[ObservationMessage]:
    return [ObservationMessage(**asdict(m)) for m in messages]
