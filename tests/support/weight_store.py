"""A real weight-store gRPC server in the test's own process (the store's server options), and
a torch client of it: for the engine tests that fetch versions from a store."""

from __future__ import annotations

from pathlib import Path

import grpc

from treadle_common.clients.torch_weights import TorchWeightClient, state_dict_to_raw
from treadle_common.model import lora
from treadle_common.runtime import grpc_options
from treadle_weight_store.backends.local import LocalBackend
from treadle_weight_store.grpc import WeightStoreServicer, add_to_server
from treadle_weight_store.store import WeightStore


async def no_announce(_manifest) -> None:
    return None


async def start_weight_store(root: Path) -> tuple[grpc.aio.Server, TorchWeightClient]:
    """A store on local disk under `root`, serving on a free port; its client."""
    server = grpc.aio.server(options=grpc_options.SERVER_OPTIONS)
    add_to_server(WeightStoreServicer(WeightStore(LocalBackend(root)), no_announce), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, TorchWeightClient(f"127.0.0.1:{port}")


async def stop_weight_store(server: grpc.aio.Server, client: TorchWeightClient) -> None:
    await client.close()
    await server.stop(None)


async def swap_in_adapter(
    engine, client: TorchWeightClient, model: str, tensors: dict, config, base: tuple[str, int]
) -> int:
    """A LoRA run's version: the adapter `tensors` published on the base (its directory, its
    version), then swapped into `engine` as its policy; the version."""
    response = await client.store.publish(
        model,
        state_dict_to_raw(tensors),
        trainer_step=1,
        metadata=lora.to_metadata(config, base[0], base[1]),
    )
    stats = await engine.update_to(client.store, response.version)
    assert engine.version == stats.version == response.version
    return response.version
