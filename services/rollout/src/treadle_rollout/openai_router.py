"""The OpenAI-compatible API's HTTP edge: handlers of a few lines over `OpenAIFrontend`
(`openai_api.py`); request bodies are `openai_types.py`'s, the session routes' models
`treadle_common.api.rollout`'s, errors OpenAI's format (`errors.py`).

    GET    /v1/models                      the policy and its adapters
    POST   /v1/chat/completions            streamed or not; recorded with X-Treadle-Session
    POST   /v1/completions                 prompts (text or token ids), n each
    POST   /v1/sessions                    open an agent's session against a run's task
    GET    /v1/sessions/{id}               what a recorded session holds
    POST   /v1/sessions/{id}/finish        the session becomes a trajectory of its run
    DELETE /v1/sessions/{id}               discarded
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from treadle_common.api.rollout import (
    FinishSession,
    ModelList,
    SessionDeleted,
    SessionFinished,
    SessionInfo,
    SessionIssued,
)
from treadle_common.auth import policy as auth
from treadle_rollout import issued
from treadle_rollout.openai_api import SESSION_HEADER, OpenAIFrontend, SessionId
from treadle_rollout.openai_types import (
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
)
from treadle_rollout.quota_gate import REQUEST_TENANT
from treadle_rollout.sse import EventStream

router = APIRouter(prefix="/v1", tags=["openai"])


def streamed(model: type) -> dict[int | str, dict[str, Any]]:
    """The answer's schema; with `stream`, server-sent events of its chunks instead."""
    return {200: {"model": model, "content": {"text/event-stream": {}}}}


def openai_frontend(request: Request) -> OpenAIFrontend:
    return request.app.state.frontend


Frontend = Annotated[OpenAIFrontend, Depends(openai_frontend)]


def _respond(result: dict | AsyncIterator[str]) -> Any:
    return result if isinstance(result, dict) else EventStream(result)


@router.get(
    "/models", openapi_extra=auth.roles(auth.ANY, errors="openai"), response_model_exclude_none=True
)
async def models(frontend: Frontend) -> ModelList:
    return frontend.models()


@router.post(
    "/chat/completions",
    openapi_extra=auth.roles(auth.AGENT, errors="openai"),
    response_model=None,
    responses=streamed(ChatCompletion),
)
async def chat(req: ChatRequest, request: Request, frontend: Frontend) -> Any:
    REQUEST_TENANT.set(auth.caller().tenant)  # its generations count to its quotas
    return _respond(await frontend.chat(req, request.headers.get(SESSION_HEADER)))


@router.post(
    "/completions",
    openapi_extra=auth.roles(auth.AGENT, auth.TRAINER, errors="openai"),
    response_model=None,
    responses=streamed(Completion),
)
async def completions(req: CompletionRequest, frontend: Frontend) -> Any:
    REQUEST_TENANT.set(auth.caller().tenant)
    return _respond(await frontend.completions(req))


@router.post("/sessions", openapi_extra=auth.roles(auth.TRAINER), status_code=201)
async def open_session(req: issued.OpenSession, frontend: Frontend) -> SessionIssued:
    return await frontend.sessions.issue(req)


@router.get("/sessions/{session_id}", openapi_extra=auth.roles(auth.AGENT))
async def session_info(session_id: SessionId, frontend: Frontend) -> SessionInfo:
    return frontend.sessions.info(session_id)


@router.post("/sessions/{session_id}/finish", openapi_extra=auth.roles(auth.AGENT | auth.WORKERS))
async def finish(
    session_id: SessionId, body: FinishSession, request: Request, frontend: Frontend
) -> SessionFinished:
    # the caller's role, as the service runtime's auth found it (none without auth)
    return await frontend.sessions.finish(session_id, body, getattr(request.state, "role", None))


@router.delete("/sessions/{session_id}", openapi_extra=auth.roles(auth.AGENT))
async def discard(session_id: SessionId, frontend: Frontend) -> SessionDeleted:
    return frontend.sessions.discard(session_id)
