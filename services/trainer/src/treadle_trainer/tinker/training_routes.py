"""Tinker's training clients: create_model, get_info, weights_info, forward_backward,
optim_step, save_weights (save_state), load_weights (load_state, create from state),
save_weights_for_sampler (publish the adapter to the weight-store). Each answers a future
(`futures.py`); a client, a checkpoint and a future are their session tenant's (`state.py`)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from tinker import types

from treadle_common import auth, lora
from treadle_common.api.training import AdamParams
from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_trainer.backends import on_torch_thread
from treadle_trainer.tinker import checkpoints, wire
from treadle_trainer.tinker.adapters import BadRequest, LoraClient
from treadle_trainer.tinker.checkpoints import read_meta
from treadle_trainer.tinker.futures import Result
from treadle_trainer.tinker.sampling import Sampler, SamplerWeights
from treadle_trainer.tinker.state import ROLES, TinkerState, checkpoint_name, json_result


def accepted(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return types.UntypedAPIFuture(request_id=request_id, model_id=model_id).model_dump(
        mode="json", exclude_none=True
    )


def bad(exc: BadRequest) -> HTTPException:
    return HTTPException(400, str(exc))


def adapter_config(lora_config: types.LoraConfig | None) -> lora.AdapterConfig:
    if lora_config is None:
        raise BadRequest("full-weight training clients are not served: pass a lora_config")
    if not 1 <= lora_config.rank <= 256:
        raise BadRequest("lora rank must be in 1..256")
    targets = lora.targets_for(
        lora_config.train_attn, lora_config.train_mlp, lora_config.train_unembed
    )
    if not targets:
        raise BadRequest("train at least one of attn, mlp, unembed")
    return lora.AdapterConfig(rank=lora_config.rank, targets=targets, seed=lora_config.seed or 0)


def mount(app: FastAPI, state: TinkerState, reap: Callable[[], Awaitable[None]]) -> None:
    async def keep(model_id: str, session_id: str, client: LoraClient) -> None:
        """A built client joins its session, unless the session ended meanwhile."""
        if session_id not in state.sessions:
            state.clients.pop(model_id, None)
            await on_torch_thread(client.close)
            raise BadRequest(f"session {session_id} ended while its client was created")
        state.clients[model_id] = client

    async def new_model_id(session_id: str, seq: int) -> str:
        await reap()
        state.session(session_id)
        model_id = f"{session_id}:train:{seq}"
        if model_id in state.clients:
            raise HTTPException(409, f"training client {model_id} exists")
        if len(state.clients) >= state.max_clients:
            raise HTTPException(
                429,
                f"{len(state.clients)} training clients are open, the most this trainer holds "
                "(TREADLE_TRAINER_TINKER_MAX_CLIENTS)",
            )
        return model_id

    @app.post("/api/v1/create_model", tags=["tinker"], openapi_extra=ROLES)
    async def create_model(request: types.CreateModelRequest) -> dict[str, Any]:
        state.check_served(request.base_model)
        model_id = await new_model_id(request.session_id, request.model_seq_id)
        if request.optimizer_config.type != "adamw":
            raise HTTPException(400, f"optimizer {request.optimizer_config.type!r}: adamw only")
        try:
            config = adapter_config(request.lora_config)
        except BadRequest as exc:
            raise bad(exc) from exc
        state.clients[model_id] = None  # type: ignore[assignment]  # reserved while it builds
        tenant, owner = auth.caller().tenant, auth.caller().owner

        async def work() -> Result:
            try:
                base = await state.base(request.base_model)
                client = await on_torch_thread(
                    LoraClient.create, model_id, base, config, tenant, owner
                )
            except BaseException:
                state.clients.pop(model_id, None)
                raise
            await keep(model_id, request.session_id, client)
            return json_result(types.CreateModelResponse(model_id=model_id))

        return accepted(state.submit(work, model_id), model_id)

    @app.post("/api/v1/get_info", tags=["tinker"], openapi_extra=ROLES)
    async def get_info(request: types.GetInfoRequest) -> dict[str, Any]:
        client = state.client(request.model_id)
        base = client.base
        return types.GetInfoResponse(
            model_id=request.model_id,
            model_data=types.ModelData(
                arch=base.arch, model_name=base.name, tokenizer_id=base.path
            ),
            is_lora=True,
            lora_rank=client.config.rank,
            model_name=base.name,
        ).model_dump(mode="json")

    @app.post("/api/v1/weights_info", tags=["tinker"], openapi_extra=ROLES)
    async def weights_info(body: dict[str, str]) -> dict[str, Any]:
        path = body.get("tinker_path", "")
        try:
            kind = "sampler_weights" if "/sampler_weights/" in path else "weights"
            meta = read_meta(state.resolve(path, kind))
        except BadRequest as exc:
            raise HTTPException(404, str(exc)) from exc
        targets = set(meta["lora"]["targets"])
        return types.WeightsInfoResponse(
            base_model=meta["base_model"],
            is_lora=True,
            lora_rank=meta["lora"]["rank"],
            train_attn=bool(targets & set(lora.ATTENTION)),
            train_mlp=bool(targets & set(lora.MLP)),
            train_unembed=bool(targets & set(lora.UNEMBED)),
        ).model_dump(mode="json")

    @app.post("/api/v1/forward_backward", tags=["tinker"], openapi_extra=ROLES)
    async def forward_backward(request: Request) -> dict[str, Any]:
        """Body: the SDK's `ForwardBackwardRequest` protobuf (zstd when it says so)."""
        try:
            body = wire.decompress(await request.body(), request.headers.get("content-encoding"))
            fb = wire.read_forward_backward(body)
        except BadRequest as exc:
            raise bad(exc) from exc
        client = state.client(fb.model_id)

        async def work() -> Result:
            outputs, metrics = await on_torch_thread(
                client.forward_backward, fb.data, fb.loss_fn, fb.loss_fn_config, fb.forward_only
            )
            return Result(proto=wire.forward_backward_output(outputs, metrics))

        return accepted(state.submit(work, fb.model_id, fb.seq_id), fb.model_id)

    @app.post("/api/v1/optim_step", tags=["tinker"], openapi_extra=ROLES)
    async def optim_step(request: types.OptimStepRequest) -> dict[str, Any]:
        client = state.client(request.model_id)
        params = request.optim_params
        if not isinstance(params, types.AdamParams):
            raise HTTPException(
                400, "optim_step: adam_params only (the clients' optimizer is AdamW)"
            )
        adam = AdamParams(
            learning_rate=params.learning_rate,
            beta1=params.beta1,
            beta2=params.beta2,
            eps=max(params.eps, 1e-30),
            weight_decay=params.weight_decay,
        )

        async def work() -> Result:
            metrics = await on_torch_thread(client.optim_step, adam, params.grad_clip_norm)
            return json_result(types.OptimStepResponse(metrics=metrics))

        return accepted(state.submit(work, request.model_id, request.seq_id), request.model_id)

    @app.post("/api/v1/save_weights", tags=["tinker"], openapi_extra=ROLES)
    async def save_weights(request: types.SaveWeightsRequest) -> dict[str, Any]:
        """The SDK's `save_state`: adapter and optimizer state, to load or resume from."""
        client = state.client(request.model_id)

        async def work() -> Result:
            name = checkpoint_name(request.path, client)
            directory = state.checkpoint_dir(client.model_id, "weights", name)
            if directory.exists() and not request.overwrite:
                raise BadRequest(f"checkpoint {name!r} exists (pass overwrite=True)")
            await on_torch_thread(checkpoints.save, client, directory)
            path = f"tinker://{client.model_id}/weights/{name}"
            return json_result(types.SaveWeightsResponse(path=path, type="save_weights"))

        return accepted(state.submit(work, request.model_id, request.seq_id), request.model_id)

    @app.post("/api/v1/load_weights", tags=["tinker"], openapi_extra=ROLES)
    async def load_weights(request: types.LoadWeightsRequest) -> dict[str, Any]:
        """`load_state[_with_optimizer]` on a client, or (session_id + model_seq_id) a new
        client created from the checkpoint (`create_training_client_from_state`)."""
        try:
            directory = state.resolve(request.path)
            meta = read_meta(directory)
        except BadRequest as exc:
            raise bad(exc) from exc
        if request.session_id is not None:
            if request.model_seq_id is None:
                raise HTTPException(400, "session_id needs model_seq_id")
            state.check_served(request.base_model or meta["base_model"])
            session_id = request.session_id
            model_id = await new_model_id(session_id, request.model_seq_id)
            state.clients[model_id] = None  # type: ignore[assignment]
            config = lora.AdapterConfig(
                rank=meta["lora"]["rank"],
                alpha=meta["lora"]["alpha"],
                targets=tuple(meta["lora"]["targets"]),
            )
            tenant, owner = auth.caller().tenant, auth.caller().owner

            async def create() -> Result:
                try:
                    base = await state.base(request.base_model or meta["base_model"])
                    client = await on_torch_thread(
                        LoraClient.create, model_id, base, config, tenant, owner
                    )
                    await on_torch_thread(checkpoints.load, client, directory, request.optimizer)
                except BaseException:
                    pending = state.clients.pop(model_id, None)
                    if pending is not None:
                        await on_torch_thread(pending.close)
                    raise
                await keep(model_id, session_id, client)
                return json_result(types.LoadWeightsResponse(path=request.path, model_id=model_id))

            return accepted(state.submit(create, model_id), model_id)
        if request.model_id is None:
            raise HTTPException(400, "load_weights needs model_id, or session_id + model_seq_id")
        client = state.client(request.model_id)
        if meta["base_model"] != client.base.name:
            raise HTTPException(400, f"{request.path} was trained on {meta['base_model']}")

        async def load() -> Result:
            await on_torch_thread(checkpoints.load, client, directory, request.optimizer)
            return json_result(
                types.LoadWeightsResponse(path=request.path, model_id=client.model_id)
            )

        return accepted(state.submit(load, client.model_id, request.seq_id), client.model_id)

    @app.post("/api/v1/save_weights_for_sampler", tags=["tinker"], openapi_extra=ROLES)
    async def save_for_sampler(request: types.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        """Publish the adapter (only its tensors) as a weight-store version; named, it is a
        `sampler_weights` path, unnamed a sampling session on it."""
        client = state.client(request.model_id)
        session_id = request.model_id.split(":", 1)[0]
        if request.path is None and request.sampling_session_seq_id is None:
            raise HTTPException(400, "name the weights (path) or pass sampling_session_seq_id")

        async def work() -> Result:
            tensors = await on_torch_thread(client.adapter_state)
            store_model = "tinker-" + client.model_id.replace(":", "-")
            response = await state.store.publish(
                store_model,
                state_dict_to_raw(tensors),
                trainer_step=client.steps,
                metadata=lora.to_metadata(client.config, client.base.name),
            )
            weights = SamplerWeights(client.base.name, store_model, response.version)
            if request.path is None:
                sampler_id = f"{session_id}:sample:{request.sampling_session_seq_id}"
                state.samplers[sampler_id] = Sampler(client.base.name, weights, None)
                return Result(json={"sampling_session_id": sampler_id})
            name = checkpoint_name(request.path, client)
            directory = state.checkpoint_dir(client.model_id, "sampler_weights", name)
            directory.mkdir(parents=True, exist_ok=True)
            meta = {**client.meta(), "store_model": store_model, "version": response.version}
            (directory / "meta.json").write_text(json.dumps(meta))
            path = f"tinker://{client.model_id}/sampler_weights/{name}"
            state.sampler_weights[path] = weights
            return Result(json={"path": path, "type": "save_weights_for_sampler"})

        return accepted(state.submit(work, request.model_id, request.seq_id), request.model_id)
