"""Tinker's training clients, without HTTP (the edge is `api_router.py`): create_model,
get_info, weights_info, forward_backward, optim_step, save_weights (save_state),
load_weights (load_state, or a new client from a state), save_weights_for_sampler (publish the
adapter to the weight store). Work on a client runs as a future (`futures.py`), in the
client's order; each function returns the future's handle. A client, a checkpoint and a
future are their session tenant's (`state.py`). The clients are held, and worked on one call
at a time, by the trainer's training-session core (`training/core.py`), the one
`/v1/training` uses too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinker import types

from treadle_common.api.training import AdamParams
from treadle_common.auth import policy as auth
from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.model import lora
from treadle_trainer.errors import InvalidInput, NotFound
from treadle_trainer.tinker import checkpoints, wire
from treadle_trainer.tinker.adapters import LoraClient
from treadle_trainer.tinker.checkpoints import read_meta
from treadle_trainer.tinker.futures import Result
from treadle_trainer.tinker.sampling import Sampler, SamplerWeights
from treadle_trainer.tinker.state import TinkerState, checkpoint_name, json_result


def accepted(request_id: str, model_id: str | None = None) -> types.UntypedAPIFuture:
    return types.UntypedAPIFuture(request_id=request_id, model_id=model_id)


def adapter_config(lora_config: types.LoraConfig | None) -> lora.AdapterConfig:
    if lora_config is None:
        raise InvalidInput("full-weight training clients are not served: pass a lora_config")
    if not 1 <= lora_config.rank <= 256:
        raise InvalidInput("lora rank must be in 1..256")
    targets = lora.targets_for(
        lora_config.train_attn, lora_config.train_mlp, lora_config.train_unembed
    )
    if not targets:
        raise InvalidInput("train at least one of attn, mlp, unembed")
    return lora.AdapterConfig(rank=lora_config.rank, targets=targets, seed=lora_config.seed or 0)


async def _build_client(
    state: TinkerState,
    model_id: str,
    base_model: str,
    config: lora.AdapterConfig,
    caller: auth.Identity,
    checkpoint: tuple[Path, bool] | None = None,
) -> None:
    """Work of a future: the client of the reserved `model_id` (on its base, loaded once),
    the caller's, optionally from a saved state (directory, with the optimizer?). A session
    that ended meanwhile has dropped the reservation: the client is closed (`Trainables`)."""
    try:
        base = await state.base(base_model)
    except BaseException:
        await state.clients.drop(model_id)
        raise

    def make() -> LoraClient:
        client = LoraClient.create(model_id, base, config, caller.tenant, caller.owner)
        try:
            if checkpoint is not None:
                checkpoints.load(client, *checkpoint)
        except BaseException:
            client.close()
            raise
        return client

    await state.clients.build(model_id, make)


async def create_model(
    state: TinkerState, request: types.CreateModelRequest
) -> types.UntypedAPIFuture:
    state.check_served(request.base_model)
    if request.optimizer_config.type != "adamw":
        raise InvalidInput(f"optimizer {request.optimizer_config.type!r}: adamw only")
    config = adapter_config(request.lora_config)
    model_id = await state.new_model_id(request.session_id, request.model_seq_id)
    caller = auth.caller()

    async def work() -> Result:
        await _build_client(state, model_id, request.base_model, config, caller)
        return json_result(types.CreateModelResponse(model_id=model_id))

    return accepted(state.submit(work, model_id), model_id)


def get_info(state: TinkerState, request: types.GetInfoRequest) -> types.GetInfoResponse:
    client = state.client(request.model_id)
    base = client.base
    return types.GetInfoResponse(
        model_id=request.model_id,
        model_data=types.ModelData(arch=base.arch, model_name=base.name, tokenizer_id=base.path),
        is_lora=True,
        lora_rank=client.config.rank,
        model_name=base.name,
    )


def weights_info(state: TinkerState, tinker_path: str) -> types.WeightsInfoResponse:
    try:
        kind = "sampler_weights" if "/sampler_weights/" in tinker_path else "weights"
        meta = read_meta(state.resolve(tinker_path, kind))
    except InvalidInput as exc:
        raise NotFound(str(exc)) from exc
    targets = set(meta["lora"]["targets"])
    return types.WeightsInfoResponse(
        base_model=meta["base_model"],
        is_lora=True,
        lora_rank=meta["lora"]["rank"],
        train_attn=bool(targets & set(lora.ATTENTION)),
        train_mlp=bool(targets & set(lora.MLP)),
        train_unembed=bool(targets & set(lora.UNEMBED)),
    )


def forward_backward(state: TinkerState, fb: wire.ForwardBackward) -> types.UntypedAPIFuture:
    state.client(fb.model_id)  # 404 / 403 now, not in the future

    async def work() -> Result:
        outputs, metrics = await state.clients.run(
            fb.model_id,
            lambda c: c.forward_backward(fb.data, fb.loss_fn, fb.loss_fn_config, fb.forward_only),
        )
        return Result(proto=wire.forward_backward_output(outputs, metrics))

    return accepted(state.submit(work, fb.model_id, fb.seq_id), fb.model_id)


def optim_step(state: TinkerState, request: types.OptimStepRequest) -> types.UntypedAPIFuture:
    state.client(request.model_id)  # 404 / 403 now, not in the future
    params = request.optim_params
    if not isinstance(params, types.AdamParams):
        raise InvalidInput("optim_step: adam_params only (the clients' optimizer is AdamW)")
    adam = AdamParams(
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=max(params.eps, 1e-30),
        weight_decay=params.weight_decay,
    )

    async def work() -> Result:
        metrics = await state.clients.run(
            request.model_id, lambda c: c.optim_step(adam, params.grad_clip_norm)
        )
        return json_result(types.OptimStepResponse(metrics=metrics))

    return accepted(state.submit(work, request.model_id, request.seq_id), request.model_id)


def save_weights(state: TinkerState, request: types.SaveWeightsRequest) -> types.UntypedAPIFuture:
    """The SDK's `save_state`: adapter and optimizer state, to load or resume from."""
    client = state.client(request.model_id)

    async def work() -> Result:
        name = checkpoint_name(request.path, client)
        directory = state.checkpoint_dir(client.model_id, "weights", name)
        if directory.exists() and not request.overwrite:
            raise InvalidInput(f"checkpoint {name!r} exists (pass overwrite=True)")
        await state.clients.run(client.model_id, lambda c: checkpoints.save(c, directory))
        path = f"tinker://{client.model_id}/weights/{name}"
        return json_result(types.SaveWeightsResponse(path=path, type="save_weights"))

    return accepted(state.submit(work, request.model_id, request.seq_id), request.model_id)


async def load_weights(
    state: TinkerState, request: types.LoadWeightsRequest
) -> types.UntypedAPIFuture:
    """`load_state[_with_optimizer]` on a client, or (session_id + model_seq_id) a new client
    created from the checkpoint (`create_training_client_from_state`)."""
    directory = state.resolve(request.path)
    meta = read_meta(directory)
    if request.session_id is not None:
        return await _client_from_state(state, request, directory, meta)
    if request.model_id is None:
        raise InvalidInput("load_weights needs model_id, or session_id + model_seq_id")
    client = state.client(request.model_id)
    if meta["base_model"] != client.base.name:
        raise InvalidInput(f"{request.path} was trained on {meta['base_model']}")

    async def load() -> Result:
        await state.clients.run(
            client.model_id, lambda c: checkpoints.load(c, directory, request.optimizer)
        )
        return json_result(types.LoadWeightsResponse(path=request.path, model_id=client.model_id))

    return accepted(state.submit(load, client.model_id, request.seq_id), client.model_id)


async def _client_from_state(
    state: TinkerState, request: types.LoadWeightsRequest, directory: Path, meta: dict[str, Any]
) -> types.UntypedAPIFuture:
    if request.model_seq_id is None or request.session_id is None:
        raise InvalidInput("session_id needs model_seq_id")
    base_model = request.base_model or meta["base_model"]
    state.check_served(base_model)
    session_id = request.session_id
    model_id = await state.new_model_id(session_id, request.model_seq_id)
    config = lora.AdapterConfig(
        rank=meta["lora"]["rank"],
        alpha=meta["lora"]["alpha"],
        targets=tuple(meta["lora"]["targets"]),
    )

    caller = auth.caller()

    async def create() -> Result:
        saved = (directory, request.optimizer)
        await _build_client(state, model_id, base_model, config, caller, saved)
        return json_result(types.LoadWeightsResponse(path=request.path, model_id=model_id))

    return accepted(state.submit(create, model_id), model_id)


def save_for_sampler(
    state: TinkerState, request: types.SaveWeightsForSamplerRequest
) -> types.UntypedAPIFuture:
    """Publish the adapter (only its tensors) as a weight-store version; named, it is a
    `sampler_weights` path, unnamed a sampling session on it."""
    client = state.client(request.model_id)
    if request.path is None and request.sampling_session_seq_id is None:
        raise InvalidInput("name the weights (path) or pass sampling_session_seq_id")

    async def work() -> Result:
        weights = await _publish_adapter(state, client)
        if request.path is None:
            session_id = request.model_id.split(":", 1)[0]
            sampler_id = f"{session_id}:sample:{request.sampling_session_seq_id}"
            state.samplers[sampler_id] = Sampler(client.base.name, weights, None)
            return Result(json={"sampling_session_id": sampler_id})
        name = checkpoint_name(request.path, client)
        directory = state.checkpoint_dir(client.model_id, "sampler_weights", name)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {**client.meta(), "store_model": weights.store_model, "version": weights.version}
        (directory / "meta.json").write_text(json.dumps(meta))
        path = f"tinker://{client.model_id}/sampler_weights/{name}"
        state.sampler_weights[path] = weights
        return Result(json={"path": path, "type": "save_weights_for_sampler"})

    return accepted(state.submit(work, request.model_id, request.seq_id), request.model_id)


async def _publish_adapter(state: TinkerState, client: LoraClient) -> SamplerWeights:
    tensors = await state.clients.run(client.model_id, lambda c: c.adapter_state())
    store_model = "tinker-" + client.model_id.replace(":", "-")
    response = await state.store.publish(
        store_model,
        state_dict_to_raw(tensors),
        trainer_step=client.steps,
        metadata=lora.to_metadata(client.config, client.base.name),
    )
    return SamplerWeights(client.base.name, store_model, response.version)
