"""The weight-store's HTTP mirror (read-only; publish and fetch are gRPC, `grpc.py`).

GET /v1/models                            model names
GET /v1/models/{model}/versions           every version's info
GET /v1/models/{model}/versions/{version} the manifest (-1 = latest)

A tenant's token lists and reads only its tenant's models and the fleet's (`tenancy.py`).
A refusal is the store's error (`errors.py`), answered by the service runtime.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from treadle_common.api.weights import Manifest, Models, VersionInfo, Versions
from treadle_common.auth import policy as auth
from treadle_weight_store.store import WeightStore
from treadle_weight_store.tenancy import Tenancy

router = APIRouter(prefix="/v1/models", tags=["weights"])
ANYONE = auth.roles(auth.ANY)


def store(request: Request) -> WeightStore:
    return request.app.state.store


def tenancy(request: Request) -> Tenancy:
    return request.app.state.tenancy


Store = Annotated[WeightStore, Depends(store)]
Tenants = Annotated[Tenancy, Depends(tenancy)]


@router.get("", openapi_extra=ANYONE)
async def list_models(store: Store, tenants: Tenants) -> Models:
    return Models(models=await tenants.visible(await store.models()))


@router.get("/{model}/versions", openapi_extra=ANYONE)
async def list_versions(model: str, store: Store, tenants: Tenants) -> Versions:
    await tenants.check(model)
    infos = await store.infos(model)
    return Versions(model=model, versions=[VersionInfo.from_proto(i) for i in infos])


@router.get("/{model}/versions/{version}", openapi_extra=ANYONE)
async def get_version(model: str, version: int, store: Store, tenants: Tenants) -> Manifest:
    """The manifest (tensors, dtypes, shapes, chunk hashes); -1 = latest."""
    await tenants.check(model)
    return Manifest.from_proto(await store.get_manifest(model, version))
