from treadle_common.proto.treadle.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Task(_message.Message):
    __slots__ = ("task_id", "run_id", "env", "payload_json", "group_size", "max_turns", "sampling", "scorer", "model", "min_policy_version", "created_at", "trace", "env_options_json", "scorer_options_json", "failures")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    ENV_OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    SCORER_OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    run_id: str
    env: str
    payload_json: str
    group_size: int
    max_turns: int
    sampling: _common_pb2.SamplingParams
    scorer: str
    model: str
    min_policy_version: int
    created_at: float
    trace: _common_pb2.TraceContext
    env_options_json: str
    scorer_options_json: str
    failures: EpisodeFailures
    def __init__(self, task_id: _Optional[str] = ..., run_id: _Optional[str] = ..., env: _Optional[str] = ..., payload_json: _Optional[str] = ..., group_size: _Optional[int] = ..., max_turns: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., scorer: _Optional[str] = ..., model: _Optional[str] = ..., min_policy_version: _Optional[int] = ..., created_at: _Optional[float] = ..., trace: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., env_options_json: _Optional[str] = ..., scorer_options_json: _Optional[str] = ..., failures: _Optional[_Union[EpisodeFailures, _Mapping]] = ...) -> None: ...

class EpisodeFailures(_message.Message):
    __slots__ = ("retries", "breaker_window", "breaker_failure_rate")
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    BREAKER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FAILURE_RATE_FIELD_NUMBER: _ClassVar[int]
    retries: int
    breaker_window: int
    breaker_failure_rate: float
    def __init__(self, retries: _Optional[int] = ..., breaker_window: _Optional[int] = ..., breaker_failure_rate: _Optional[float] = ...) -> None: ...
