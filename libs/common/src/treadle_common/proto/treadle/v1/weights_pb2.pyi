from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChunkRef(_message.Message):
    __slots__ = ("hash", "size")
    HASH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    hash: str
    size: int
    def __init__(self, hash: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkRef]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., chunks: _Optional[_Iterable[_Union[ChunkRef, _Mapping]]] = ...) -> None: ...

class AssetEntry(_message.Message):
    __slots__ = ("name", "chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkRef]
    def __init__(self, name: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[ChunkRef, _Mapping]]] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("model", "version", "parent_version", "trainer_step", "created_at", "tensors", "metadata", "assets")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ASSETS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    parent_version: int
    trainer_step: int
    created_at: float
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    metadata: _containers.ScalarMap[str, str]
    assets: _containers.RepeatedCompositeFieldContainer[AssetEntry]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., parent_version: _Optional[int] = ..., trainer_step: _Optional[int] = ..., created_at: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., assets: _Optional[_Iterable[_Union[AssetEntry, _Mapping]]] = ...) -> None: ...

class MissingChunksRequest(_message.Message):
    __slots__ = ("hashes", "probe")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[str]
    probe: bool
    def __init__(self, hashes: _Optional[_Iterable[str]] = ..., probe: _Optional[bool] = ...) -> None: ...

class MissingChunksResponse(_message.Message):
    __slots__ = ("missing",)
    MISSING_FIELD_NUMBER: _ClassVar[int]
    missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, missing: _Optional[_Iterable[str]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("hash", "data")
    HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    hash: str
    data: bytes
    def __init__(self, hash: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("chunk", "manifest", "durable")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    manifest: WeightManifest
    durable: bool
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., durable: _Optional[bool] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("model", "version", "num_chunks_received", "bytes_received")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    num_chunks_received: int
    bytes_received: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., num_chunks_received: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class VersionRef(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("model", "version", "have", "skip_assets")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HAVE_FIELD_NUMBER: _ClassVar[int]
    SKIP_ASSETS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    have: _containers.RepeatedScalarFieldContainer[str]
    skip_assets: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., have: _Optional[_Iterable[str]] = ..., skip_assets: _Optional[bool] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("chunk", "manifest")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    chunk: Chunk
    manifest: WeightManifest
    def __init__(self, chunk: _Optional[_Union[Chunk, _Mapping]] = ..., manifest: _Optional[_Union[WeightManifest, _Mapping]] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("model", "version", "trainer_step", "created_at", "num_bytes", "pinned", "parent_version", "durable")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    trainer_step: int
    created_at: float
    num_bytes: int
    pinned: bool
    parent_version: int
    durable: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., trainer_step: _Optional[int] = ..., created_at: _Optional[float] = ..., num_bytes: _Optional[int] = ..., pinned: _Optional[bool] = ..., parent_version: _Optional[int] = ..., durable: _Optional[bool] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ...) -> None: ...

class WaitForVersionRequest(_message.Message):
    __slots__ = ("model", "version", "timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    timeout_s: float
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitForVersionResponse(_message.Message):
    __slots__ = ("latest",)
    LATEST_FIELD_NUMBER: _ClassVar[int]
    latest: int
    def __init__(self, latest: _Optional[int] = ...) -> None: ...

class WeightAnnouncement(_message.Message):
    __slots__ = ("model", "version", "trainer_step", "store_address")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    trainer_step: int
    store_address: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., trainer_step: _Optional[int] = ..., store_address: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteVersionResponse(_message.Message):
    __slots__ = ("chunks_deleted",)
    CHUNKS_DELETED_FIELD_NUMBER: _ClassVar[int]
    chunks_deleted: int
    def __init__(self, chunks_deleted: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("model", "version", "pinned")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    pinned: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class GarbageCollectRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GarbageCollectResponse(_message.Message):
    __slots__ = ("versions_deleted", "chunks_deleted", "bytes_deleted")
    VERSIONS_DELETED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DELETED_FIELD_NUMBER: _ClassVar[int]
    versions_deleted: _containers.RepeatedCompositeFieldContainer[VersionRef]
    chunks_deleted: int
    bytes_deleted: int
    def __init__(self, versions_deleted: _Optional[_Iterable[_Union[VersionRef, _Mapping]]] = ..., chunks_deleted: _Optional[int] = ..., bytes_deleted: _Optional[int] = ...) -> None: ...
