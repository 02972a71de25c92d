from treadle_common.proto.treadle.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScheduleStep(_message.Message):
    __slots__ = ("step", "version", "max_staleness", "groups", "torch_rng_state", "stats", "weights_sha256", "trained")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TORCH_RNG_STATE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    step: int
    version: int
    max_staleness: int
    groups: _containers.RepeatedCompositeFieldContainer[RecordedGroup]
    torch_rng_state: bytes
    stats: _containers.ScalarMap[str, float]
    weights_sha256: str
    trained: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., version: _Optional[int] = ..., max_staleness: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[RecordedGroup, _Mapping]]] = ..., torch_rng_state: _Optional[bytes] = ..., stats: _Optional[_Mapping[str, float]] = ..., weights_sha256: _Optional[str] = ..., trained: _Optional[_Iterable[str]] = ...) -> None: ...

class RecordedGroup(_message.Message):
    __slots__ = ("group_id", "entries")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    entries: _containers.RepeatedCompositeFieldContainer[RecordedEntry]
    def __init__(self, group_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[RecordedEntry, _Mapping]]] = ...) -> None: ...

class RecordedEntry(_message.Message):
    __slots__ = ("entry_id", "trajectory", "invalid")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    trajectory: _trajectory_pb2.Trajectory
    invalid: str
    def __init__(self, entry_id: _Optional[str] = ..., trajectory: _Optional[_Union[_trajectory_pb2.Trajectory, _Mapping]] = ..., invalid: _Optional[str] = ...) -> None: ...
