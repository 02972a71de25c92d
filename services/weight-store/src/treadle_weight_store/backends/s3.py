"""S3 backend through the `minio` client. Same layout and semantics as the local backend;
a manifest is created with `If-None-Match: *` so that of two publishers of one version the
second gets `VersionConflict` (S3, MinIO and SeaweedFS support conditional writes)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from minio import Minio
from minio.error import S3Error

from treadle_weight_store.backends.base import Backend, chunk_key, manifest_key
from treadle_weight_store.errors import NotFound, VersionConflict

_MISSING = ("NoSuchKey", "NoSuchObject", "ResourceNotFound")


class S3Backend(Backend):
    name = "s3"

    def __init__(
        self, endpoint: str, access_key: str, secret_key: str, bucket: str, secure: bool = False
    ):
        self.client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure)
        self.bucket = bucket
        if not self.client.bucket_exists(bucket):
            self.client.make_bucket(bucket)

    def _get(self, key: str) -> bytes:
        try:
            response = self.client.get_object(self.bucket, key)
        except S3Error as exc:
            if exc.code in _MISSING:
                raise NotFound(f"{key} is missing") from exc
            raise
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()

    def _exists(self, key: str) -> bool:
        try:
            self.client.stat_object(self.bucket, key)
            return True
        except S3Error as exc:
            if exc.code in _MISSING:
                return False
            raise

    def _put(self, key: str, data: bytes) -> None:
        self.client.put_object(self.bucket, key, io.BytesIO(data), len(data))

    def has_chunk(self, digest: str) -> bool:
        return self._exists(chunk_key(digest))

    def has_chunks(self, digests: Sequence[str]) -> list[bool]:
        """HEAD requests in parallel (each is a round trip)."""
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(digests)))) as pool:
            return list(pool.map(self.has_chunk, digests))

    def put_chunk(self, digest: str, parts: Sequence[bytes | memoryview]) -> None:
        self._put(chunk_key(digest), b"".join(parts))  # a single PUT is atomic in S3

    def get_chunk(self, digest: str) -> bytes:
        return self._get(chunk_key(digest))

    def delete_chunk(self, digest: str) -> None:
        self.client.remove_object(self.bucket, chunk_key(digest))

    def list_chunks(self) -> Iterator[tuple[str, float, int]]:
        for obj in self.client.list_objects(self.bucket, prefix="chunks/", recursive=True):
            yield obj.object_name.rsplit("/", 1)[-1], obj.last_modified.timestamp(), obj.size or 0

    def put_manifest(self, model: str, version: int, data: bytes) -> None:
        # minio-py has no public conditional PUT; `_execute` is its request primitive.
        try:
            self.client._execute(
                "PUT",
                self.bucket,
                manifest_key(model, version),
                body=data,
                headers={"If-None-Match": "*"},
            )
        except S3Error as exc:
            if exc.code in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise VersionConflict(f"{model} version {version} already exists") from exc
            raise

    def get_manifest(self, model: str, version: int) -> bytes:
        try:
            return self._get(manifest_key(model, version))
        except NotFound as exc:
            raise NotFound(f"model {model!r} has no version {version}") from exc

    def delete_manifest(self, model: str, version: int) -> None:
        self.client.remove_object(self.bucket, manifest_key(model, version))

    def list_versions(self, model: str) -> list[int]:
        objects = self.client.list_objects(
            self.bucket, prefix=f"manifests/{model}/", recursive=True
        )
        return sorted(int(o.object_name.rsplit("/", 1)[-1].removesuffix(".pb")) for o in objects)

    def list_models(self) -> list[str]:
        objects = self.client.list_objects(self.bucket, prefix="manifests/", recursive=True)
        return sorted({o.object_name.split("/")[1] for o in objects})

    def get_pins(self, model: str) -> set[int]:
        try:
            return set(json.loads(self._get(f"pins/{model}.json")))
        except NotFound:
            return set()

    def set_pins(self, model: str, pins: set[int]) -> None:
        self._put(f"pins/{model}.json", json.dumps(sorted(pins)).encode())

    def get_reserved(self, model: str) -> int:
        try:
            return int(json.loads(self._get(f"reserved/{model}.json")))
        except NotFound:
            return 0

    def set_reserved(self, model: str, below: int) -> None:
        self._put(f"reserved/{model}.json", json.dumps(below).encode())
