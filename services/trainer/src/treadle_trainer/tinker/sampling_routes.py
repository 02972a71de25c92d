"""Tinker's sampling: create_sampling_session, samplers/{id}, asample (a future answered by
the rollout service, `sampling.py`). A sampler and a sampler-weights path are their session
tenant's (`state.py`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from tinker import types

from treadle_common import auth
from treadle_trainer.tinker import wire
from treadle_trainer.tinker.adapters import BadRequest
from treadle_trainer.tinker.futures import Result
from treadle_trainer.tinker.sampling import Sampler, check_sample_request, sequence_ids
from treadle_trainer.tinker.state import ROLES, TinkerState


def mount(app: FastAPI, state: TinkerState) -> None:
    @app.post("/api/v1/create_sampling_session", tags=["tinker"], openapi_extra=ROLES)
    async def create_sampling_session(
        request: types.CreateSamplingSessionRequest,
    ) -> dict[str, Any]:
        if request.session_id not in state.sessions:
            raise HTTPException(404, f"no session {request.session_id!r}")
        state.owned(request.session_id)
        try:
            weights = state.sampler_weights_of(request.model_path) if request.model_path else None
        except BadRequest as exc:
            raise HTTPException(404, str(exc)) from exc
        base_model = weights.base_model if weights else request.base_model
        if base_model is None:
            raise HTTPException(400, "name a model_path or a base_model")
        state.check_served(base_model)
        sampler_id = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
        state.samplers[sampler_id] = Sampler(base_model, weights, request.model_path)
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id).model_dump()

    @app.get("/api/v1/samplers/{sampler_id}", tags=["tinker"], openapi_extra=ROLES)
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        sampler = state.sampler(sampler_id)
        return {
            "sampler_id": sampler_id,
            "base_model": sampler.base_model,
            "model_path": sampler.model_path,
        }

    @app.post("/api/v1/asample", tags=["tinker"], openapi_extra=ROLES)
    async def asample(request: types.SampleRequest) -> dict[str, Any]:
        if state.rollout is None:
            raise HTTPException(  # configuration, not a passing outage: no 503 to retry on
                400,
                "this trainer does not sample: set TREADLE_TRAINER_ROLLOUT_URL (treadle up does)",
            )
        try:
            check_sample_request(request)
            if request.sampling_session_id is not None:
                sampler = state.sampler(request.sampling_session_id)
            elif request.model_path is not None:
                weights = state.sampler_weights_of(request.model_path)
                sampler = Sampler(weights.base_model, weights, request.model_path)
            elif request.base_model is not None:
                state.check_served(request.base_model)
                sampler = Sampler(request.base_model, None, None)
            else:
                raise BadRequest("name a sampling_session_id, a model_path or a base_model")
        except BadRequest as exc:
            raise HTTPException(400, str(exc)) from exc
        rollout = state.rollout
        ids = sequence_ids(request.num_samples)

        async def work() -> Result:
            sequences = await rollout.sample(sampler, request)
            return Result(proto=wire.sample_response(sequences, None))

        queue = request.sampling_session_id or f"sample:{auth.caller().tenant}"
        request_id = state.submit(work, queue, request.seq_id, ordered=False)
        return types.UntypedAPIFuture(request_id=request_id, sample_sequence_ids=ids).model_dump(
            mode="json", exclude_none=True
        )
