from treadle_common.proto.treadle.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrajectoryStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAJECTORY_STATUS_UNSPECIFIED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_OK: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_TRUNCATED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_ENV_ERROR: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_SANDBOX_ERROR: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_REWARD_ERROR: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_ENGINE_ERROR: _ClassVar[TrajectoryStatus]
TRAJECTORY_STATUS_UNSPECIFIED: TrajectoryStatus
TRAJECTORY_STATUS_OK: TrajectoryStatus
TRAJECTORY_STATUS_TRUNCATED: TrajectoryStatus
TRAJECTORY_STATUS_ENV_ERROR: TrajectoryStatus
TRAJECTORY_STATUS_SANDBOX_ERROR: TrajectoryStatus
TRAJECTORY_STATUS_REWARD_ERROR: TrajectoryStatus
TRAJECTORY_STATUS_ENGINE_ERROR: TrajectoryStatus

class PhaseTimings(_message.Message):
    __slots__ = ("queue_s", "generate_s", "env_s", "reward_s", "total_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    ENV_S_FIELD_NUMBER: _ClassVar[int]
    REWARD_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    generate_s: float
    env_s: float
    reward_s: float
    total_s: float
    def __init__(self, queue_s: _Optional[float] = ..., generate_s: _Optional[float] = ..., env_s: _Optional[float] = ..., reward_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "task_id", "run_id", "env", "sample_index", "tokens", "loss_mask", "logprobs", "token_versions", "reward", "reward_breakdown", "status", "error", "timings", "num_turns", "rollout_replica", "trace", "sandbox_runs", "constrained_mask")
    class RewardBreakdownEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_REPLICA_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_RUNS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_MASK_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    task_id: str
    run_id: str
    env: str
    sample_index: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_versions: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    reward_breakdown: _containers.ScalarMap[str, float]
    status: TrajectoryStatus
    error: str
    timings: PhaseTimings
    num_turns: int
    rollout_replica: str
    trace: _common_pb2.TraceContext
    sandbox_runs: int
    constrained_mask: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., run_id: _Optional[str] = ..., env: _Optional[str] = ..., sample_index: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_versions: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., reward_breakdown: _Optional[_Mapping[str, float]] = ..., status: _Optional[_Union[TrajectoryStatus, str]] = ..., error: _Optional[str] = ..., timings: _Optional[_Union[PhaseTimings, _Mapping]] = ..., num_turns: _Optional[int] = ..., rollout_replica: _Optional[str] = ..., trace: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., sandbox_runs: _Optional[int] = ..., constrained_mask: _Optional[_Iterable[int]] = ...) -> None: ...
