"""LoRA adapters served next to the policy, on the same base model (`Engine.load_adapter`).

    POST   /v1/adapters          {name, model, version}: fetch the adapter version from the
                                 weight-store and serve it as `name` (trainer role)
    GET    /v1/adapters          the names served
    DELETE /v1/adapters/{name}

An OpenAI request whose `model` is an adapter's name samples through that adapter (as vLLM
serves LoRA adapters); the Tinker API's sampling clients use this.
"""

from __future__ import annotations

import grpc

from treadle_common.api.rollout import Adapters, LoadAdapter
from treadle_common.clients.torch_weights import fetch_state_dict
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.model import lora
from treadle_rollout.engines.base import AdapterUnsupported, Engine
from treadle_rollout.errors import BadAdapter, NoAdapter, TooManyAdapters

MAX_ADAPTERS = 64
"""Adapters served at once; loading one more is refused (unload one)."""


async def load(engine: Engine, store: WeightStoreClient, request: LoadAdapter) -> Adapters:
    """Fetch the adapter version from the weight store and serve it as `request.name`."""
    if request.name == engine.model_name:
        raise BadAdapter(f"{request.name!r} is the policy's own name")
    served = engine.adapters()
    if request.name not in served and len(served) >= MAX_ADAPTERS:
        raise TooManyAdapters(f"{len(served)} adapters are served, the most; unload one")
    try:
        manifest, tensors = await fetch_state_dict(store, request.model, request.version)
        config = lora.from_metadata(dict(manifest.metadata))
        await engine.load_adapter(request.name, tensors, config, version=request.version)
    except (AdapterUnsupported, ValueError) as exc:
        raise BadAdapter(f"adapter {request.name}: {exc}") from exc
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        where = f"{request.model}@{request.version}"
        raise NoAdapter(f"adapter {request.name}: no {where}") from exc
    return Adapters(adapters=engine.adapters())


async def unload(engine: Engine, name: str) -> None:
    if name not in engine.adapters():
        raise NoAdapter(f"no adapter {name!r}")
    await engine.unload_adapter(name)
