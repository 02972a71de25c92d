"""Local filesystem backend: temp file + rename for chunks, temp file + hard link for
manifests (the link fails if the version exists, so exactly one publisher wins)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from treadle_weight_store.backends.base import Backend, chunk_key, manifest_key
from treadle_weight_store.errors import NotFound, VersionConflict


class LocalBackend(Backend):
    name = "local"

    def __init__(self, root: Path):
        self.root = Path(root)
        for sub in ("chunks", "manifests", "pins"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def _write_temp(self, directory: Path, *parts: bytes | memoryview) -> str:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                for part in parts:
                    f.write(part)
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    def has_chunk(self, digest: str) -> bool:
        return (self.root / chunk_key(digest)).exists()

    def put_chunk(self, digest: str, parts: Sequence[bytes | memoryview]) -> None:
        path = self.root / chunk_key(digest)
        if not path.exists():
            os.replace(self._write_temp(path.parent, *parts), path)

    def get_chunk(self, digest: str) -> bytes:
        try:
            return (self.root / chunk_key(digest)).read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(f"chunk {digest} is missing") from exc

    def delete_chunk(self, digest: str) -> None:
        (self.root / chunk_key(digest)).unlink(missing_ok=True)

    def list_chunks(self) -> Iterator[tuple[str, float, int]]:
        for path in (self.root / "chunks").glob("*/*"):
            if not path.name.startswith(".tmp-"):
                stat = path.stat()
                yield path.name, stat.st_mtime, stat.st_size

    def put_manifest(self, model: str, version: int, data: bytes) -> None:
        target = self.root / manifest_key(model, version)
        tmp = self._write_temp(target.parent, data)
        try:
            os.link(tmp, target)
        except FileExistsError as exc:
            raise VersionConflict(f"{model} version {version} already exists") from exc
        finally:
            os.unlink(tmp)

    def get_manifest(self, model: str, version: int) -> bytes:
        try:
            return (self.root / manifest_key(model, version)).read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(f"model {model!r} has no version {version}") from exc

    def delete_manifest(self, model: str, version: int) -> None:
        (self.root / manifest_key(model, version)).unlink(missing_ok=True)

    def list_versions(self, model: str) -> list[int]:
        directory = self.root / "manifests" / model
        return sorted(int(p.stem) for p in directory.glob("*.pb")) if directory.exists() else []

    def list_models(self) -> list[str]:
        return sorted(
            p.name
            for p in (self.root / "manifests").iterdir()
            if p.is_dir() and any(p.glob("*.pb"))
        )

    def get_pins(self, model: str) -> set[int]:
        path = self.root / "pins" / f"{model}.json"
        return set(json.loads(path.read_text())) if path.exists() else set()

    def set_pins(self, model: str, pins: set[int]) -> None:
        path = self.root / "pins" / f"{model}.json"
        os.replace(self._write_temp(path.parent, json.dumps(sorted(pins)).encode()), path)
