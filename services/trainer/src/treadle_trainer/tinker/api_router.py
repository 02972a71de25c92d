"""The Tinker REST surface (`/api/v1/...`) that the official `tinker` SDK (pinned in the
trainer's dependencies) talks to: `tinker.ServiceClient(base_url=<trainer>, api_key=...)`.
Handlers only translate; the work is `state.py` (sessions), `training.py` (training clients)
and `sampling_sessions.py` (sampling).

    client/config, client/dynamic_config, healthz, get_server_capabilities   the SDK's setup
    create_session, session_heartbeat, sessions/{id}/finish, telemetry       its session
    create_model, get_info, weights_info, forward_backward, optim_step,
      save_weights, load_weights, save_weights_for_sampler                  futures
    create_sampling_session, samplers/{id}, asample                         futures
    retrieve_future                                                         long poll

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

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from treadle_common.auth import policy as auth
from treadle_trainer import errors
from treadle_trainer.tinker import sampling_sessions, training, wire
from treadle_trainer.tinker.state import ROLES, TinkerState

router = APIRouter(prefix="/api/v1", tags=["tinker"])
FUTURE: dict[str, Any] = {"openapi_extra": ROLES, "response_model_exclude_none": True}


def tinker_state(request: Request) -> TinkerState:
    return request.app.state.tinker


State = Annotated[TinkerState, Depends(tinker_state)]


class Health(BaseModel):
    status: str


class WeightsInfoRequest(BaseModel):
    tinker_path: str


# --- setup, sessions ------------------------------------------------------------------------
@router.post("/client/config", openapi_extra=ROLES)
async def client_config(request: types.ClientConfigRequest) -> types.ClientConfigResponse:
    # API keys only (no JWT exchange); plain httpx; fwd/bwd bodies are protobuf, zstd
    # compressed (real payloads shrink >10x).
    return types.ClientConfigResponse(
        pjwt_auth_enabled=False, use_pyqwest_transport=False, proto_compress_fwdbwd=True
    )


@router.post("/client/dynamic_config", openapi_extra=ROLES)
async def client_dynamic_config(
    request: types.ClientConfigRequest,
) -> types.ClientDynamicConfigResponse:
    return types.ClientDynamicConfigResponse()


@router.get("/healthz", openapi_extra=auth.roles(auth.ANY))
async def tinker_healthz() -> Health:
    return Health(status="ok")


@router.get("/get_server_capabilities", openapi_extra=ROLES)
async def capabilities(state: State) -> types.GetServerCapabilitiesResponse:
    sampled = await state.rollout.model_name() if state.rollout else None
    supported = [
        types.SupportedModel(model_name=name, trainable=True, sampleable=name == sampled)
        for name in sorted(state.models)
    ]
    return types.GetServerCapabilitiesResponse(supported_models=supported)


@router.post("/create_session", openapi_extra=ROLES)
async def create_session(
    request: types.CreateSessionRequest, state: State
) -> types.CreateSessionResponse:
    return types.CreateSessionResponse(session_id=await state.open_session())


@router.post("/session_heartbeat", openapi_extra=ROLES)
async def heartbeat(
    request: types.SessionHeartbeatRequest, state: State
) -> types.SessionHeartbeatResponse:
    state.heartbeat(request.session_id)
    return types.SessionHeartbeatResponse()


@router.post("/sessions/{session_id}/finish", status_code=204, openapi_extra=ROLES)
async def finish(session_id: str, state: State) -> None:
    await state.end_session(state.owned(session_id))


@router.post("/telemetry", status_code=204, openapi_extra=ROLES)
async def telemetry(request: Request) -> None:
    """The SDK's telemetry: accepted and dropped (nothing leaves a self-hosted stack)."""


# --- training clients -----------------------------------------------------------------------
@router.post("/create_model", **FUTURE)
async def create_model(request: types.CreateModelRequest, state: State) -> types.UntypedAPIFuture:
    return await training.create_model(state, request)


@router.post("/get_info", openapi_extra=ROLES)
async def get_info(request: types.GetInfoRequest, state: State) -> types.GetInfoResponse:
    return training.get_info(state, request)


@router.post("/weights_info", openapi_extra=ROLES)
async def weights_info(request: WeightsInfoRequest, state: State) -> types.WeightsInfoResponse:
    return training.weights_info(state, request.tinker_path)


@router.post("/forward_backward", **FUTURE)
async def forward_backward(request: Request, state: State) -> types.UntypedAPIFuture:
    """Body: the SDK's `ForwardBackwardRequest` protobuf (zstd when it says so)."""
    body = wire.decompress(await request.body(), request.headers.get("content-encoding"))
    return training.forward_backward(state, wire.read_forward_backward(body))


@router.post("/optim_step", **FUTURE)
async def optim_step(request: types.OptimStepRequest, state: State) -> types.UntypedAPIFuture:
    return training.optim_step(state, request)


@router.post("/save_weights", **FUTURE)
async def save_weights(request: types.SaveWeightsRequest, state: State) -> types.UntypedAPIFuture:
    return training.save_weights(state, request)


@router.post("/load_weights", **FUTURE)
async def load_weights(request: types.LoadWeightsRequest, state: State) -> types.UntypedAPIFuture:
    return await training.load_weights(state, request)


@router.post("/save_weights_for_sampler", **FUTURE)
async def save_for_sampler(
    request: types.SaveWeightsForSamplerRequest, state: State
) -> types.UntypedAPIFuture:
    return training.save_for_sampler(state, request)


# --- sampling -------------------------------------------------------------------------------
@router.post("/create_sampling_session", openapi_extra=ROLES)
async def create_sampling_session(
    request: types.CreateSamplingSessionRequest, state: State
) -> types.CreateSamplingSessionResponse:
    return sampling_sessions.create_session(state, request)


@router.get("/samplers/{sampler_id}", openapi_extra=ROLES)
async def get_sampler(sampler_id: str, state: State) -> types.GetSamplerResponse:
    return sampling_sessions.describe(state, sampler_id)


@router.post("/asample", **FUTURE)
async def asample(request: types.SampleRequest, state: State) -> types.UntypedAPIFuture:
    return sampling_sessions.sample(state, request)


# --- results --------------------------------------------------------------------------------
FutureResult = (
    TryAgainResponse
    | types.CreateModelResponse
    | types.OptimStepResponse
    | types.SaveWeightsResponse
    | types.LoadWeightsResponse
    | types.SaveWeightsForSamplerResponse
    | types.SaveWeightsForSamplerResponseInternal
    | types.RequestFailedResponse
)
"""What `retrieve_future` answers in JSON (the SDK's `FutureRetrieveResponse` without the
protobuf results: a forward_backward's and a sample's come as `application/x-protobuf`)."""


@router.post(
    "/retrieve_future",
    openapi_extra=ROLES,
    response_model=FutureResult,
    responses={200: {"content": {"application/x-protobuf": {}}}},
)
async def retrieve_future(request: types.FutureRetrieveRequest, state: State) -> Response:
    """The future's result: JSON (a `FutureRetrieveResponse`), or the protobuf of a
    forward_backward or a sample; `TryAgainResponse` while it runs."""
    try:
        result = await state.futures.retrieve(request.request_id)
    except KeyError:
        raise errors.NotFound(f"no request {request.request_id!r}") from None
    if result is None:
        body = TryAgainResponse(request_id=request.request_id, queue_state="active")
        return JSONResponse(body.model_dump())
    if result.error is not None:
        return JSONResponse({"error": result.error, "category": result.category})
    if result.proto is not None:
        return Response(result.proto, media_type="application/x-protobuf")
    return JSONResponse(result.json)
