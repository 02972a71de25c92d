"""Weight-store service: wires the store, the gRPC servicer, the HTTP mirror and announcements.

trainer --Publish(stream chunks + manifest)--> WeightStoreServicer --commit--> LocalStore
                                                    |
                                                    +--announce--> JetStream treadle.weights.{model}
rollout <--Fetch(manifest + missing chunks)--------+
"""

from __future__ import annotations

from fastapi import HTTPException
from google.protobuf.json_format import MessageToDict

from treadle_common import names
from treadle_common.clients.weights import ensure_weights_stream
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_common.proto.treadle.v1 import weights_pb2_grpc
from treadle_common.service import ServiceRuntime
from treadle_common.settings import Settings
from treadle_weight_store.grpc_service import SERVICE, WeightStoreServicer
from treadle_weight_store.store import BadRequest, LocalStore, NotFound


def build(settings: Settings) -> tuple[ServiceRuntime, LocalStore]:
    runtime = ServiceRuntime(SERVICE, settings)
    store = LocalStore(settings.weight_store_dir or settings.state_dir / "weights")
    grpc_addr = f"{settings.host}:{settings.port(SERVICE, 'grpc')}"
    stream_ready = False

    async def announce(manifest: pb.WeightManifest) -> None:
        nonlocal stream_ready
        js = (await runtime.wait_nats()).jetstream()
        if not stream_ready:
            await ensure_weights_stream(js)
            stream_ready = True
        message = pb.WeightAnnouncement(
            model=manifest.model,
            version=manifest.version,
            trainer_step=manifest.trainer_step,
            store_address=grpc_addr,
        )
        await js.publish(names.weights_subject(manifest.model), message.SerializeToString())

    servicer = WeightStoreServicer(store, announce)
    weights_pb2_grpc.add_WeightStoreServicer_to_server(servicer, runtime.make_grpc_server())
    runtime.set_info(
        lambda: {"grpc": grpc_addr, "models": {m: store.versions(m)[-1:] for m in store.models()}}
    )
    _add_routes(runtime, store, servicer)
    return runtime, store


def _add_routes(runtime: ServiceRuntime, store: LocalStore, servicer: WeightStoreServicer) -> None:
    app = runtime.app

    def guard(fn):
        try:
            return fn()
        except BadRequest as exc:
            raise HTTPException(400, str(exc)) from exc
        except NotFound as exc:
            raise HTTPException(404, str(exc)) from exc

    @app.get("/v1/models", tags=["weights"])
    async def list_models() -> dict:
        return {"models": store.models()}

    @app.get("/v1/models/{model}/versions", tags=["weights"])
    async def list_versions(model: str) -> dict:
        def run():
            return [
                MessageToDict(servicer.version_info(model, v), preserving_proto_field_name=True)
                for v in store.versions(model)
            ]

        return {"model": model, "versions": guard(run)}

    @app.get("/v1/models/{model}/versions/{version}", tags=["weights"])
    async def get_version(model: str, version: int) -> dict:
        manifest = guard(lambda: store.get_manifest(model, version))
        return MessageToDict(manifest, preserving_proto_field_name=True)


async def main(settings: Settings) -> None:
    runtime, _ = build(settings)
    await runtime.serve()
