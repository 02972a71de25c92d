"""The weight-store's HTTP mirror (read-only; publish and fetch are gRPC, `grpc.py`).

GET /v1/models                            model names
GET /v1/models/{model}/versions           every version's info
GET /v1/models/{model}/versions/{version} the manifest (-1 = latest)

A tenant's token lists and reads only its tenant's models and the fleet's (`tenancy.py`).
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException
from google.protobuf.json_format import MessageToDict

from treadle_common import auth
from treadle_common.api.weights import Models, VersionInfo, Versions
from treadle_weight_store.errors import BadRequest, NotFound, Precondition, StoreError
from treadle_weight_store.store import WeightStore
from treadle_weight_store.tenancy import Tenancy


def mount(app: FastAPI, store: WeightStore, tenancy: Tenancy) -> None:

    async def guard(coro):
        try:
            return await coro
        except (BadRequest, Precondition) as exc:
            raise HTTPException(400 if isinstance(exc, BadRequest) else 409, str(exc)) from exc
        except NotFound as exc:
            raise HTTPException(404, str(exc)) from exc
        except StoreError as exc:
            raise HTTPException(503, str(exc)) from exc

    def as_dict(message) -> dict:
        return MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )

    @app.get("/v1/models", tags=["weights"], openapi_extra=auth.roles(auth.ANY))
    async def list_models() -> Models:
        return Models(models=await guard(tenancy.visible(await guard(store.models()))))

    @app.get("/v1/models/{model}/versions", tags=["weights"], openapi_extra=auth.roles(auth.ANY))
    async def list_versions(model: str) -> Versions:
        await guard(tenancy.check(model))
        infos = await guard(store.infos(model))
        return Versions(model=model, versions=[VersionInfo.from_proto(i) for i in infos])

    @app.get(
        "/v1/models/{model}/versions/{version}",
        tags=["weights"],
        openapi_extra=auth.roles(auth.ANY),
    )
    async def get_version(model: str, version: int) -> dict:
        """The manifest (tensors, dtypes, shapes, chunk hashes); -1 = latest."""
        await guard(tenancy.check(model))
        return as_dict(await guard(store.get_manifest(model, version)))
