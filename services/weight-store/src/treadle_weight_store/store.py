"""Local-filesystem backend: content-addressed chunks + immutable, atomically committed manifests.

    {root}/chunks/ab/abcdef...        raw chunk bytes, named by their xxh3-128 hash
    {root}/manifests/{model}/000000000003.pb   WeightManifest protobuf (version 3)

A chunk is verified against its hash when written and again when read: a corrupted chunk is
an error, never served. Versions count from 1 (0 names the base weights of the model
directory). A manifest is written to a temp file and hard-linked into place, so a version
appears only complete, and of two publishers of the same version one wins and the
other gets `VersionConflict`.
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from pathlib import Path

from treadle_common.clients.weights import chunk_hash
from treadle_common.proto.treadle.v1 import weights_pb2 as pb

HASH_RE = re.compile(r"^[0-9a-f]{32}$")
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class StoreError(Exception):
    pass


class BadRequest(StoreError):
    pass


class NotFound(StoreError):
    pass


class VersionConflict(StoreError):
    pass


class CorruptChunk(StoreError):
    pass


def check_model(model: str) -> None:
    if not MODEL_RE.match(model):
        raise BadRequest(f"invalid model name {model!r}: use letters, digits, '.', '_' or '-'")


class LocalStore:
    def __init__(self, root: Path):
        self.root = root
        (root / "chunks").mkdir(parents=True, exist_ok=True)
        (root / "manifests").mkdir(parents=True, exist_ok=True)
        self._commit_lock = asyncio.Lock()

    # -- chunks ---------------------------------------------------------------------------
    def _chunk_path(self, digest: str) -> Path:
        if not HASH_RE.match(digest):
            raise BadRequest(f"invalid chunk hash {digest!r}")
        return self.root / "chunks" / digest[:2] / digest

    def has_chunk(self, digest: str) -> bool:
        return self._chunk_path(digest).exists()

    def put_chunk(self, digest: str, data: bytes) -> None:
        path = self._chunk_path(digest)
        if chunk_hash(data) != digest:
            raise BadRequest(f"chunk {digest} does not match its content hash")
        if path.exists():
            return
        path.parent.mkdir(exist_ok=True)
        _atomic_write(path, data)

    def get_chunk(self, digest: str) -> bytes:
        path = self._chunk_path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(f"chunk {digest} is missing") from exc
        if chunk_hash(data) != digest:
            raise CorruptChunk(f"chunk {digest} is corrupted on disk")
        return data

    # -- manifests ------------------------------------------------------------------------
    def _model_dir(self, model: str) -> Path:
        check_model(model)
        return self.root / "manifests" / model

    def models(self) -> list[str]:
        return sorted(p.name for p in (self.root / "manifests").iterdir() if p.is_dir())

    def versions(self, model: str) -> list[int]:
        directory = self._model_dir(model)
        if not directory.exists():
            return []
        return sorted(int(p.stem) for p in directory.glob("*.pb"))

    def resolve(self, model: str, version: int) -> int:
        if version >= 0:
            return version
        versions = self.versions(model)
        if not versions:
            raise NotFound(f"model {model!r} has no versions")
        return versions[-1]

    def get_manifest(self, model: str, version: int) -> pb.WeightManifest:
        version = self.resolve(model, version)
        path = self._model_dir(model) / f"{version:012d}.pb"
        try:
            return pb.WeightManifest.FromString(path.read_bytes())
        except FileNotFoundError as exc:
            raise NotFound(f"model {model!r} has no version {version}") from exc

    async def commit(self, manifest: pb.WeightManifest) -> pb.WeightManifest:
        """Make a version visible once every chunk it names is stored."""
        directory = self._model_dir(manifest.model)
        missing = {c.hash for t in manifest.tensors for c in t.chunks if not self.has_chunk(c.hash)}
        if missing:
            raise BadRequest(
                f"manifest names {len(missing)} chunks the store lacks, e.g. {min(missing)}"
            )
        if manifest.version == 0:
            raise BadRequest(
                "version 0 is reserved for a model's base weights; publish with -1 or >= 1"
            )
        async with self._commit_lock:
            if manifest.version < 0:
                versions = self.versions(manifest.model)
                manifest.version = versions[-1] + 1 if versions else 1
            directory.mkdir(parents=True, exist_ok=True)
            target = directory / f"{manifest.version:012d}.pb"
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(manifest.SerializeToString())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, target)
            except FileExistsError as exc:
                raise VersionConflict(
                    f"{manifest.model} version {manifest.version} already exists"
                ) from exc
            finally:
                os.unlink(tmp)
        return manifest

    def num_bytes(self, manifest: pb.WeightManifest) -> int:
        return sum(c.size for t in manifest.tensors for c in t.chunks)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
