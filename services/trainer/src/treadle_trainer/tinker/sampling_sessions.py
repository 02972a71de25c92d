"""Tinker's sampling, without HTTP (the edge is `api_router.py`): sampling sessions on a base
model or on published sampler weights, and `asample`, answered by rollout (`sampling.py`'s
`RolloutSampler`) as a future."""

from __future__ import annotations

from tinker import types

from treadle_common.auth import policy as auth
from treadle_trainer.errors import InvalidInput, NotFound
from treadle_trainer.tinker import wire
from treadle_trainer.tinker.futures import Result
from treadle_trainer.tinker.sampling import Sampler, check_sample_request, sequence_ids
from treadle_trainer.tinker.state import TinkerState


def create_session(
    state: TinkerState, request: types.CreateSamplingSessionRequest
) -> types.CreateSamplingSessionResponse:
    if request.session_id not in state.sessions:
        raise NotFound(f"no session {request.session_id!r}")
    state.owned(request.session_id)
    try:
        weights = state.sampler_weights_of(request.model_path) if request.model_path else None
    except InvalidInput as exc:
        raise NotFound(str(exc)) from exc
    base_model = weights.base_model if weights else request.base_model
    if base_model is None:
        raise InvalidInput("name a model_path or a base_model")
    state.check_served(base_model)
    sampler_id = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
    state.samplers[sampler_id] = Sampler(base_model, weights, request.model_path)
    return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)


def describe(state: TinkerState, sampler_id: str) -> types.GetSamplerResponse:
    sampler = state.sampler(sampler_id)
    return types.GetSamplerResponse(
        sampler_id=sampler_id, base_model=sampler.base_model, model_path=sampler.model_path
    )


def _sampler_for(state: TinkerState, request: types.SampleRequest) -> Sampler:
    if request.sampling_session_id is not None:
        return state.sampler(request.sampling_session_id)
    if request.model_path is not None:
        weights = state.sampler_weights_of(request.model_path)
        return Sampler(weights.base_model, weights, request.model_path)
    if request.base_model is not None:
        state.check_served(request.base_model)
        return Sampler(request.base_model, None, None)
    raise InvalidInput("name a sampling_session_id, a model_path or a base_model")


def sample(state: TinkerState, request: types.SampleRequest) -> types.UntypedAPIFuture:
    rollout = state.rollout
    if rollout is None:  # configuration, not a passing outage: no 503 to retry on
        raise InvalidInput(
            "this trainer does not sample: set TREADLE_TRAINER_ROLLOUT_URL (treadle up does)"
        )
    check_sample_request(request)
    sampler = _sampler_for(state, request)
    ids = sequence_ids(request.num_samples)

    async def work() -> Result:
        sequences = await rollout.sample(sampler, request)
        return Result(proto=wire.sample_response(sequences, None))

    queue = request.sampling_session_id or f"sample:{auth.caller().tenant}"
    request_id = state.submit(work, queue, request.seq_id, ordered=False)
    return types.UntypedAPIFuture(request_id=request_id, sample_sequence_ids=ids)
