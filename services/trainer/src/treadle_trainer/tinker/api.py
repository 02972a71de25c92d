"""The Tinker REST surface (`/api/v1/...`) that the official `tinker` SDK (pinned in the
trainer's dependencies) talks to: `tinker.ServiceClient(base_url=<trainer>, api_key=...)`.

    client/config, client/dynamic_config, healthz, get_server_capabilities   the SDK's setup
    create_session, session_heartbeat, sessions/{id}/finish, telemetry       its session
    retrieve_future                                                         long poll
    training_routes.py: create_model, get_info, weights_info, forward_backward, optim_step,
      save_weights, load_weights, save_weights_for_sampler                  futures
    sampling_routes.py: create_sampling_session, samplers/{id}, asample     futures

Request and response bodies are the SDK's own pydantic types (`tinker.types`), so the server
parses exactly what the SDK sends. Auth: the SDK sends `X-API-Key: tml-<key>`; the key after
the prefix is a Treadle token with the `tinker` role (or trainer/admin: `auth.TINKER`); the
caller's owner (`auth.Identity.owner`: a tinker key's own, else its tenant) owns the sessions
it creates and everything made in them (`state.py`).

Base models are named by `TREADLE_TRAINER_TINKER_MODELS` (`{"name": "<HF dir>"}`); each is
loaded once, on its first training client, and every client on it is a LoRA adapter on that
one copy (`adapters.py`). Checkpoints are `tinker://<model id>/weights/<name>` under the
trainer's state dir; sampler weights are `tinker://<model id>/sampler_weights/<name>`, an
adapter-only version in the weight-store.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from treadle_common import auth
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.logs import get_logger
from treadle_trainer.backends import on_torch_thread
from treadle_trainer.tinker import sampling_routes, training_routes
from treadle_trainer.tinker.sampling import RolloutSampler
from treadle_trainer.tinker.state import ROLES, TinkerState

log = get_logger(__name__)


def mount(
    app: FastAPI,
    store: WeightStoreClient,
    state_dir: Path,
    models: dict[str, str],
    *,
    max_clients: int = 16,
    rollout_url: str | None = None,
    token: str | None = None,
    session_ttl_s: float = 300.0,
) -> TinkerState:
    rollout = RolloutSampler(rollout_url, token) if rollout_url else None
    state = TinkerState(
        models, state_dir / "tinker", store, max_clients, rollout, session_ttl_s=session_ttl_s
    )
    futures = state.futures

    # --- setup, sessions --------------------------------------------------------------------
    @app.post("/api/v1/client/config", tags=["tinker"], openapi_extra=ROLES)
    async def client_config(request: types.ClientConfigRequest) -> dict[str, Any]:
        # API keys only (no JWT exchange); plain httpx; fwd/bwd bodies are protobuf, zstd
        # compressed (real payloads shrink >10x).
        return types.ClientConfigResponse(
            pjwt_auth_enabled=False,
            use_pyqwest_transport=False,
            proto_compress_fwdbwd=True,
        ).model_dump()

    @app.post("/api/v1/client/dynamic_config", tags=["tinker"], openapi_extra=ROLES)
    async def client_dynamic_config(request: types.ClientConfigRequest) -> dict[str, Any]:
        return types.ClientDynamicConfigResponse().model_dump()

    @app.get("/api/v1/healthz", tags=["tinker"], openapi_extra=auth.roles(auth.ANY))
    async def tinker_healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities", tags=["tinker"], openapi_extra=ROLES)
    async def capabilities() -> dict[str, Any]:
        sampled = await state.rollout.model_name() if state.rollout else None
        supported = [
            types.SupportedModel(model_name=name, trainable=True, sampleable=name == sampled)
            for name in sorted(state.models)
        ]
        return types.GetServerCapabilitiesResponse(supported_models=supported).model_dump()

    @app.post("/api/v1/create_session", tags=["tinker"], openapi_extra=ROLES)
    async def create_session(request: types.CreateSessionRequest) -> dict[str, Any]:
        await reap()
        session_id = uuid.uuid4().hex[:16]
        state.sessions[session_id] = time.monotonic()
        state.tenants[session_id] = auth.caller().owner
        return types.CreateSessionResponse(session_id=session_id).model_dump()

    @app.post("/api/v1/session_heartbeat", tags=["tinker"], openapi_extra=ROLES)
    async def heartbeat(request: types.SessionHeartbeatRequest) -> dict[str, Any]:
        if request.session_id not in state.sessions:
            raise HTTPException(410, f"session {request.session_id} has finished")
        state.owned(request.session_id)
        state.sessions[request.session_id] = time.monotonic()
        return types.SessionHeartbeatResponse().model_dump()

    async def end_session(session_id: str) -> None:
        """Its training clients and their adapters go (saved checkpoints and published
        sampler weights stay); a client still being built is dropped when it is done."""
        state.sessions.pop(session_id, None)
        state.tenants.pop(session_id, None)
        for model_id in [m for m in state.clients if m.startswith(f"{session_id}:")]:
            client = state.clients[model_id]
            if client is None:
                continue
            del state.clients[model_id]
            futures.forget(model_id)
            await on_torch_thread(client.close)

    async def reap() -> None:
        """End the sessions whose SDK stopped heartbeating (it beats every 10 s) more than
        `session_ttl_s` ago: a script that died frees its adapters."""
        cutoff = time.monotonic() - state.session_ttl_s
        for session_id in [s for s, seen in state.sessions.items() if seen < cutoff]:
            log.info("tinker session expired", session=session_id)
            await end_session(session_id)

    @app.post("/api/v1/sessions/{session_id}/finish", tags=["tinker"], openapi_extra=ROLES)
    async def finish(session_id: str) -> Response:
        await end_session(state.owned(session_id))
        return Response(status_code=204)

    @app.post("/api/v1/telemetry", tags=["tinker"], openapi_extra=ROLES)
    async def telemetry(request: Request) -> Response:
        """The SDK's telemetry: accepted and dropped (nothing leaves a self-hosted stack)."""
        return Response(status_code=204)

    training_routes.mount(app, state, reap)
    sampling_routes.mount(app, state)

    # --- results ----------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future", tags=["tinker"], openapi_extra=ROLES)
    async def retrieve_future(request: types.FutureRetrieveRequest) -> Response:
        try:
            result = await futures.retrieve(request.request_id)
        except KeyError:
            raise HTTPException(404, f"no request {request.request_id!r}") from None
        if result is None:
            body = TryAgainResponse(request_id=request.request_id, queue_state="active")
            return JSONResponse(body.model_dump())
        if result.error is not None:
            return JSONResponse({"error": result.error, "category": result.category})
        if result.proto is not None:
            return Response(result.proto, media_type="application/x-protobuf")
        return JSONResponse(result.json)

    return state
