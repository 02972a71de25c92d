"""Whose a model's weights are: the tenant named in its versions' metadata
(`names.WEIGHTS_TENANT_KEY`).

    Publish   a tenant's token (`auth.Identity.scoped`) stamps its own tenant, whatever the
              manifest says, and may publish only a new model or one of its own; a fleet token
              (the trainer service, publishing for a run) stamps the run's tenant it names, or
              none (the fleet's: base models)
    reads     Fetch, GetManifest, WaitForVersion, ListVersions, pins, deletes: 403 unless the
              caller may see the model's tenant; ListModels lists only those it may

A model's tenant never changes: every version carries it (so retention deleting old versions
loses nothing) and a publish of an owned model is stamped with its owner's.

Quota (`tenant_max_stored_bytes`): a version of a tenant's model is refused (`QuotaExceeded`,
RESOURCE_EXHAUSTED) when the bytes of every version of the tenant's models, this one
included, would pass it. Counted per version (what the tenant keeps, before the store's
deduplication), over its models' listed versions, at each of its publishes.
"""

from __future__ import annotations

from treadle_common import names
from treadle_common.auth import policy as auth
from treadle_common.proto.treadle.v1 import weights_pb2 as pb
from treadle_weight_store.errors import NotFound, QuotaExceeded
from treadle_weight_store.store import WeightStore

TENANT_KEY = names.WEIGHTS_TENANT_KEY


class Tenancy:
    def __init__(self, store: WeightStore, max_stored_bytes: int = 0):
        self.store = store
        self.max_stored_bytes = max_stored_bytes
        self._owners: dict[str, str | None] = {}
        """model -> its tenant (None: the fleet's), for models that have a version."""

    async def owner(self, model: str) -> str | None:
        if model not in self._owners:
            try:
                manifest = await self.store.get_manifest(model, -1)
            except NotFound:
                return None  # nothing yet: not remembered (its first publish decides)
            self._owners[model] = manifest.metadata.get(TENANT_KEY) or None
        return self._owners[model]

    async def check(self, model: str) -> None:
        """403 (`auth.AuthError`) unless the caller may see `model`."""
        auth.refuse_unless_sees(await self.owner(model), f"model {model!r}")

    async def stamp(self, manifest: pb.WeightManifest) -> None:
        """Set the tenant of a version about to be committed (see the module's table)."""
        who = auth.caller()
        exists = bool(await self.store.versions(manifest.model))
        owner = await self.owner(manifest.model) if exists else None
        if who.scoped:
            if exists and owner != who.tenant:
                raise auth.AuthError(
                    403, f"model {manifest.model!r} belongs to another tenant or the fleet"
                )
            tenant: str | None = who.tenant
        else:
            tenant = owner if exists else manifest.metadata.get(TENANT_KEY) or None
        if tenant is None:
            manifest.metadata.pop(TENANT_KEY, None)
        else:
            manifest.metadata[TENANT_KEY] = tenant
            await self._check_quota(tenant, manifest)

    async def stored_bytes(self, tenant: str) -> int:
        total = 0
        for model in await self.store.models():
            if await self.owner(model) != tenant:
                continue
            for version in await self.store.versions(model):
                try:
                    total += size_of(await self.store.get_manifest(model, version))
                except NotFound:  # deleted meanwhile
                    continue
        return total

    async def _check_quota(self, tenant: str, manifest: pb.WeightManifest) -> None:
        if not self.max_stored_bytes:
            return
        held, adding = await self.stored_bytes(tenant), size_of(manifest)
        if held + adding > self.max_stored_bytes:
            raise QuotaExceeded(
                f"quota stored_bytes: tenant {tenant!r} keeps {held} bytes of weights; "
                f"{adding} more would pass its {self.max_stored_bytes} (delete versions or "
                "lower retention)"
            )

    def committed(self, manifest: pb.WeightManifest) -> None:
        self._owners[manifest.model] = manifest.metadata.get(TENANT_KEY) or None

    def forget(self, model: str) -> None:
        """After a delete: the model may have no versions left."""
        self._owners.pop(model, None)

    async def visible(self, models: list[str]) -> list[str]:
        who = auth.caller()
        return [m for m in models if (t := await self.owner(m)) is None or who.may_see(t)]


def size_of(manifest: pb.WeightManifest) -> int:
    """The bytes a version holds (its tensors' and assets' chunks)."""
    return sum(c.size for t in [*manifest.tensors, *manifest.assets] for c in t.chunks)
