from treadle_common.proto.treadle.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolSpec(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("text", "tool_calls")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("env", "task_json", "seed", "options_json")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    env: str
    task_json: str
    seed: int
    options_json: str
    def __init__(self, env: _Optional[str] = ..., task_json: _Optional[str] = ..., seed: _Optional[int] = ..., options_json: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "replica", "observation", "tools", "played")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    PLAYED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    replica: str
    observation: Observation
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    played: bool
    def __init__(self, session_id: _Optional[str] = ..., replica: _Optional[str] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ..., played: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action", "close_when_done", "trace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    CLOSE_WHEN_DONE_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: Action
    close_when_done: bool
    trace: _common_pb2.TraceContext
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[_Union[Action, _Mapping]] = ..., close_when_done: _Optional[bool] = ..., trace: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "has_reward", "reward", "done", "info_json", "status", "error", "sandbox_runs")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    HAS_REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_RUNS_FIELD_NUMBER: _ClassVar[int]
    observation: Observation
    has_reward: bool
    reward: float
    done: bool
    info_json: str
    status: str
    error: str
    sandbox_runs: int
    def __init__(self, observation: _Optional[_Union[Observation, _Mapping]] = ..., has_reward: _Optional[bool] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., info_json: _Optional[str] = ..., status: _Optional[str] = ..., error: _Optional[str] = ..., sandbox_runs: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateSessionsRequest(_message.Message):
    __slots__ = ("env", "task_json", "seeds", "options_json")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    env: str
    task_json: str
    seeds: _containers.RepeatedScalarFieldContainer[int]
    options_json: str
    def __init__(self, env: _Optional[str] = ..., task_json: _Optional[str] = ..., seeds: _Optional[_Iterable[int]] = ..., options_json: _Optional[str] = ...) -> None: ...

class CreateSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class StepManyRequest(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepRequest]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepRequest, _Mapping]]] = ...) -> None: ...

class StepManyItem(_message.Message):
    __slots__ = ("index", "result", "code")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    index: int
    result: StepResponse
    code: str
    def __init__(self, index: _Optional[int] = ..., result: _Optional[_Union[StepResponse, _Mapping]] = ..., code: _Optional[str] = ...) -> None: ...

class StepManyResults(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StepManyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[StepManyItem, _Mapping]]] = ...) -> None: ...

class CloseSessionsRequest(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListEnvsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvsResponse(_message.Message):
    __slots__ = ("envs",)
    ENVS_FIELD_NUMBER: _ClassVar[int]
    envs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, envs: _Optional[_Iterable[str]] = ...) -> None: ...

class SampleTasksRequest(_message.Message):
    __slots__ = ("env", "num_tasks", "seed", "split", "options_json")
    ENV_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    env: str
    num_tasks: int
    seed: int
    split: str
    options_json: str
    def __init__(self, env: _Optional[str] = ..., num_tasks: _Optional[int] = ..., seed: _Optional[int] = ..., split: _Optional[str] = ..., options_json: _Optional[str] = ...) -> None: ...

class SampleTasksResponse(_message.Message):
    __slots__ = ("tasks_json",)
    TASKS_JSON_FIELD_NUMBER: _ClassVar[int]
    tasks_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tasks_json: _Optional[_Iterable[str]] = ...) -> None: ...

class PlayStart(_message.Message):
    __slots__ = ("session_id", "model", "sampling_json", "trace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_JSON_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    sampling_json: str
    trace: _common_pb2.TraceContext
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., sampling_json: _Optional[str] = ..., trace: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class ModelRequest(_message.Message):
    __slots__ = ("id", "method", "path", "body")
    ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    id: int
    method: str
    path: str
    body: bytes
    def __init__(self, id: _Optional[int] = ..., method: _Optional[str] = ..., path: _Optional[str] = ..., body: _Optional[bytes] = ...) -> None: ...

class ModelResponse(_message.Message):
    __slots__ = ("id", "status", "content_type", "body")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    id: int
    status: int
    content_type: str
    body: bytes
    def __init__(self, id: _Optional[int] = ..., status: _Optional[int] = ..., content_type: _Optional[str] = ..., body: _Optional[bytes] = ...) -> None: ...

class PlayUp(_message.Message):
    __slots__ = ("start", "response")
    START_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    start: PlayStart
    response: ModelResponse
    def __init__(self, start: _Optional[_Union[PlayStart, _Mapping]] = ..., response: _Optional[_Union[ModelResponse, _Mapping]] = ...) -> None: ...

class PlayDown(_message.Message):
    __slots__ = ("request", "result")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    request: ModelRequest
    result: StepResponse
    def __init__(self, request: _Optional[_Union[ModelRequest, _Mapping]] = ..., result: _Optional[_Union[StepResponse, _Mapping]] = ...) -> None: ...
