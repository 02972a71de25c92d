"""The Tinker REST surface (`/api/v1/...`) that the official `tinker` SDK (pinned in the
trainer's dependencies) talks to: `tinker.ServiceClient(base_url=<trainer>, api_key=...)`.

    client/config, client/dynamic_config, healthz, get_server_capabilities   the SDK's setup
    create_session, session_heartbeat, sessions/{id}/finish, telemetry       its session
    create_model (a LoRA training client), get_info, weights_info
    forward_backward (protobuf in and out), optim_step                      futures
    save_weights (save_state), load_weights (load_state, create from state) futures
    save_weights_for_sampler (publish the adapter to the weight-store)      future
    retrieve_future                                                         long poll

Request and response bodies are the SDK's own pydantic types (`tinker.types`), so the server
parses exactly what the SDK sends. Auth: the SDK sends `X-API-Key: tml-<key>`; the key after
the prefix is a Treadle token with the trainer role (`treadle_common.auth`).

Base models are named by `TREADLE_TRAINER_TINKER_MODELS` (`{"name": "<HF dir>"}`); each is
loaded once, on its first training client, and every client on it is a LoRA adapter on that
one copy (`adapters.py`). Checkpoints are `tinker://<model id>/weights/<name>` under the
trainer's state dir; sampler weights are `tinker://<model id>/sampler_weights/<name>`, an
adapter-only version in the weight-store.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from treadle_common import auth, lora
from treadle_common.api.training import AdamParams
from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.logs import get_logger
from treadle_trainer.backends import on_torch_thread
from treadle_trainer.tinker import wire
from treadle_trainer.tinker.adapters import BadRequest, BaseModel, LoraClient, read_meta
from treadle_trainer.tinker.futures import Futures, Result
from treadle_trainer.tinker.sampling import (
    RolloutSampler,
    Sampler,
    SamplerWeights,
    check_sample_request,
    sequence_ids,
)

log = get_logger(__name__)
ROLES = auth.roles(auth.TRAINER)
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
TINKER_PATH = re.compile(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$")


@dataclass
class TinkerState:
    models: dict[str, str]
    """Base-model name -> HF directory (`TREADLE_TRAINER_TINKER_MODELS`)."""
    root: Path
    store: WeightStoreClient
    max_clients: int
    rollout: RolloutSampler | None
    bases: dict[str, BaseModel] = field(default_factory=dict)
    clients: dict[str, LoraClient] = field(default_factory=dict)
    session_ttl_s: float = 300.0
    sessions: dict[str, float] = field(default_factory=dict)
    """Open sessions -> when the last heartbeat (or creation) was seen (monotonic)."""
    sampler_weights: dict[str, SamplerWeights] = field(default_factory=dict)
    samplers: dict[str, Sampler] = field(default_factory=dict)
    futures: Futures = field(default_factory=Futures)
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)

    def check_served(self, name: str) -> None:
        if name not in self.models:
            known = ", ".join(sorted(self.models)) or "none (set TREADLE_TRAINER_TINKER_MODELS)"
            raise HTTPException(400, f"base model {name!r} is not served here; served: {known}")

    async def base(self, name: str) -> BaseModel:
        async with self.loading:
            if name not in self.bases:
                self.bases[name] = await on_torch_thread(BaseModel, name, self.models[name])
        return self.bases[name]

    def client(self, model_id: str) -> LoraClient:
        if model_id not in self.clients:
            raise HTTPException(404, f"no training client {model_id!r}")
        return self.clients[model_id]

    def checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.root / model_id.replace(":", "_") / kind / name

    def resolve(self, path: str, kind: str = "weights") -> Path:
        """The directory of a `tinker://<model id>/weights/<name>` checkpoint."""
        match = TINKER_PATH.match(path)
        if not match or match.group(2) != kind:
            raise BadRequest(f"{path!r} is not a tinker://<model id>/{kind}/<name> path")
        directory = self.checkpoint_dir(match.group(1), kind, match.group(3))
        if not (directory / "meta.json").exists():
            raise BadRequest(f"no checkpoint at {path}")
        return directory


def _json(result: Any) -> Result:
    return Result(json=result.model_dump(mode="json", exclude_none=True))


def _checkpoint_name(name: str | None, client: LoraClient) -> str:
    name = name or f"step-{client.steps:06d}-{uuid.uuid4().hex[:6]}"
    if not CHECKPOINT_NAME.match(name) or ".." in name:
        raise BadRequest(f"checkpoint name {name!r}: letters, digits, '.', '_', '-' only")
    return name


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

    def accepted(request_id: str, model_id: str | None = None) -> dict[str, Any]:
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id).model_dump(
            mode="json", exclude_none=True
        )

    def bad(exc: BadRequest) -> HTTPException:
        return HTTPException(400, str(exc))

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
        return types.CreateSessionResponse(session_id=session_id).model_dump()

    @app.post("/api/v1/session_heartbeat", tags=["tinker"], openapi_extra=ROLES)
    async def heartbeat(request: types.SessionHeartbeatRequest) -> dict[str, Any]:
        if request.session_id not in state.sessions:
            raise HTTPException(410, f"session {request.session_id} has finished")
        state.sessions[request.session_id] = time.monotonic()
        return types.SessionHeartbeatResponse().model_dump()

    async def end_session(session_id: str) -> None:
        """Its training clients and their adapters go (saved checkpoints and published
        sampler weights stay); a client still being built is dropped when it is done."""
        state.sessions.pop(session_id, None)
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
        await end_session(session_id)
        return Response(status_code=204)

    @app.post("/api/v1/telemetry", tags=["tinker"], openapi_extra=ROLES)
    async def telemetry(request: Request) -> Response:
        """The SDK's telemetry: accepted and dropped (nothing leaves a self-hosted stack)."""
        return Response(status_code=204)

    # --- training clients -------------------------------------------------------------------
    async def keep(model_id: str, session_id: str, client: LoraClient) -> None:
        """A built client joins its session, unless the session ended meanwhile."""
        if session_id not in state.sessions:
            state.clients.pop(model_id, None)
            await on_torch_thread(client.close)
            raise BadRequest(f"session {session_id} ended while its client was created")
        state.clients[model_id] = client

    async def new_model_id(session_id: str, seq: int) -> str:
        await reap()
        if session_id not in state.sessions:
            raise HTTPException(404, f"no session {session_id!r} (create_session first)")
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
        return lora.AdapterConfig(
            rank=lora_config.rank, targets=targets, seed=lora_config.seed or 0
        )

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

        async def work() -> Result:
            try:
                base = await state.base(request.base_model)
                client = await on_torch_thread(LoraClient.create, model_id, base, config)
            except BaseException:
                state.clients.pop(model_id, None)
                raise
            await keep(model_id, request.session_id, client)
            return _json(types.CreateModelResponse(model_id=model_id))

        return accepted(futures.submit(work, model_id), model_id)

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

    # --- futures: training ------------------------------------------------------------------
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

        return accepted(futures.submit(work, fb.model_id, fb.seq_id), fb.model_id)

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
            return _json(types.OptimStepResponse(metrics=metrics))

        return accepted(futures.submit(work, request.model_id, request.seq_id), request.model_id)

    @app.post("/api/v1/save_weights", tags=["tinker"], openapi_extra=ROLES)
    async def save_weights(request: types.SaveWeightsRequest) -> dict[str, Any]:
        """The SDK's `save_state`: adapter and optimizer state, to load or resume from."""
        client = state.client(request.model_id)

        async def work() -> Result:
            name = _checkpoint_name(request.path, client)
            directory = state.checkpoint_dir(client.model_id, "weights", name)
            if directory.exists() and not request.overwrite:
                raise BadRequest(f"checkpoint {name!r} exists (pass overwrite=True)")
            await on_torch_thread(client.save, directory)
            path = f"tinker://{client.model_id}/weights/{name}"
            return _json(types.SaveWeightsResponse(path=path, type="save_weights"))

        return accepted(futures.submit(work, request.model_id, request.seq_id), request.model_id)

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

            async def create() -> Result:
                try:
                    base = await state.base(request.base_model or meta["base_model"])
                    client = await on_torch_thread(LoraClient.create, model_id, base, config)
                    await on_torch_thread(client.load, directory, request.optimizer)
                except BaseException:
                    pending = state.clients.pop(model_id, None)
                    if pending is not None:
                        await on_torch_thread(pending.close)
                    raise
                await keep(model_id, session_id, client)
                return _json(types.LoadWeightsResponse(path=request.path, model_id=model_id))

            return accepted(futures.submit(create, model_id), model_id)
        if request.model_id is None:
            raise HTTPException(400, "load_weights needs model_id, or session_id + model_seq_id")
        client = state.client(request.model_id)
        if meta["base_model"] != client.base.name:
            raise HTTPException(400, f"{request.path} was trained on {meta['base_model']}")

        async def load() -> Result:
            await on_torch_thread(client.load, directory, request.optimizer)
            return _json(types.LoadWeightsResponse(path=request.path, model_id=client.model_id))

        return accepted(futures.submit(load, client.model_id, request.seq_id), client.model_id)

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
            name = _checkpoint_name(request.path, client)
            directory = state.checkpoint_dir(client.model_id, "sampler_weights", name)
            directory.mkdir(parents=True, exist_ok=True)
            meta = {**client.meta(), "store_model": store_model, "version": response.version}
            (directory / "meta.json").write_text(json.dumps(meta))
            path = f"tinker://{client.model_id}/sampler_weights/{name}"
            state.sampler_weights[path] = weights
            return Result(json={"path": path, "type": "save_weights_for_sampler"})

        return accepted(futures.submit(work, request.model_id, request.seq_id), request.model_id)

    # --- sampling ---------------------------------------------------------------------------
    def sampler_weights(path: str) -> SamplerWeights:
        if path not in state.sampler_weights:
            meta = read_meta(state.resolve(path, "sampler_weights"))  # after a restart
            state.sampler_weights[path] = SamplerWeights(
                meta["base_model"], meta["store_model"], meta["version"]
            )
        return state.sampler_weights[path]

    @app.post("/api/v1/create_sampling_session", tags=["tinker"], openapi_extra=ROLES)
    async def create_sampling_session(
        request: types.CreateSamplingSessionRequest,
    ) -> dict[str, Any]:
        if request.session_id not in state.sessions:
            raise HTTPException(404, f"no session {request.session_id!r}")
        try:
            weights = sampler_weights(request.model_path) if request.model_path else None
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
        if sampler_id not in state.samplers:
            raise HTTPException(404, f"no sampler {sampler_id!r}")
        sampler = state.samplers[sampler_id]
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
                if request.sampling_session_id not in state.samplers:
                    raise HTTPException(404, f"no sampler {request.sampling_session_id!r}")
                sampler = state.samplers[request.sampling_session_id]
            elif request.model_path is not None:
                weights = sampler_weights(request.model_path)
                sampler = Sampler(weights.base_model, weights, request.model_path)
            elif request.base_model is not None:
                state.check_served(request.base_model)
                sampler = Sampler(request.base_model, None, None)
            else:
                raise BadRequest("name a sampling_session_id, a model_path or a base_model")
        except BadRequest as exc:
            raise bad(exc) from exc
        rollout = state.rollout
        ids = sequence_ids(request.num_samples)

        async def work() -> Result:
            sequences = await rollout.sample(sampler, request)
            return Result(proto=wire.sample_response(sequences, None))

        queue = request.sampling_session_id or "sample"
        request_id = futures.submit(work, queue, request.seq_id, ordered=False)
        return types.UntypedAPIFuture(request_id=request_id, sample_sequence_ids=ids).model_dump(
            mode="json", exclude_none=True
        )

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
