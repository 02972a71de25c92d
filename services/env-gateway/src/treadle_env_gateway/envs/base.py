"""The environment interface and its registry.

An `Env` is one episode's state: `reset` shows the first observation, `step` takes the
policy's action (text and/or tool calls) and answers with the next observation, an optional
reward and whether the episode is done. `sample_tasks` is the env's dataset generator.
Third-party packages add environments through the `treadle.envs` entry point group.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from treadle_common.runtime import errors
from treadle_env_gateway.settings import EnvGatewaySettings


@dataclass
class Message:
    role: str  # system | user | tool
    content: str
    tool_call_id: str = ""


@dataclass
class StepResult:
    observation: list[Message]
    done: bool
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"
    """`ok`, or `env_error` when the env raised (set by the gateway, not by envs)."""
    error: str = ""
    sandbox_runs: int = 0
    """Programs the step ran in the sandbox (counted by the gateway, not by envs)."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]
    error: str = ""
    """Why the call is malformed (bad JSON arguments, unknown tool); empty when it is fine."""


@dataclass
class Action:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class Env(abc.ABC):
    """One episode. Instances are created per session; steps of one session are serialized."""

    played: bool = False
    """A `PlayedEnv`: rollout plays it with `Play`, not with steps."""

    tools: list[dict[str, Any]] = []
    """Tools in OpenAI function-calling format (`{"type": "function", "function": {...}}`)."""

    def __init__(self, options: dict[str, Any] | None = None):
        self.options = options or {}

    @classmethod  # noqa: B027  (an optional hook, not abstract)
    def configure(cls, settings: EnvGatewaySettings) -> None:
        """Once per process, before any session: the env's share of the gateway's settings."""

    @classmethod  # noqa: B027  (an optional hook, not abstract)
    async def shutdown(cls) -> None:
        """Once, as the gateway stops: end what the env class started (worker processes)."""

    @classmethod
    @abc.abstractmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """The env's dataset: `num_tasks` tasks, deterministic in `seed` and `split`."""

    @abc.abstractmethod
    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        """Start the episode on `task`; return the first observation."""

    @abc.abstractmethod
    async def step(self, action: Action) -> StepResult:
        """Apply the policy's action."""

    async def close(self) -> None:  # noqa: B027  (optional hook, not abstract)
        """Release resources held by the episode."""


@dataclass
class ModelReply:
    status: int
    content_type: str
    body: bytes


class Model(Protocol):
    """The policy, as a played env reaches it: one HTTP request of the OpenAI API at a time
    (`treadle_env_gateway.envs.relay.openai_client` wraps it in an `openai.AsyncOpenAI`)."""

    async def request(self, method: str, path: str, body: bytes) -> ModelReply: ...


class PlayedEnv(Env):
    """An env that plays the whole episode itself: an agent loop calling the policy through an
    OpenAI client (a `verifiers` environment, an OpenAI-client agent). Rollout opens `Play`
    for its sessions and records every chat completion token-exact; the env scores the
    episode (its reward and breakdown are the result's `reward` and `info`)."""

    played = True

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        self.task, self.seed = task, seed
        return []

    async def step(self, action: Action) -> StepResult:
        raise EnvError(f"{type(self).__name__} is played, not stepped: open Play for it")

    @abc.abstractmethod
    async def play(self, model: Model, model_name: str, sampling: dict[str, Any]) -> StepResult:
        """Play `self.task` against `model`; `sampling` is the run's (`temperature`, `top_p`,
        `max_tokens`). Return the done result with the reward."""


class EnvError(errors.BadRequest, ValueError):
    """A request the env cannot serve (bad task, bad action); answered as a client error
    (INVALID_ARGUMENT / 400)."""


class UnknownEnv(EnvError):
    """No environment of that name is registered (NOT_FOUND / 404)."""

    http_status = errors.NotFound.http_status
    grpc_status = errors.NotFound.grpc_status


_Number = TypeVar("_Number", int, float)


def option(
    options: dict[str, Any], name: str, default: _Number, low: _Number, high: _Number
) -> _Number:
    """`options[name]` (else `default`) as the type of `default`, within `[low, high]`; a
    client's value that is not a number or is out of bounds is an `EnvError` naming it."""
    value = options.get(name, default)
    kind = type(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EnvError(f"option {name!r} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise EnvError(f"option {name!r} must be finite, got {value!r}")
    if kind is int and value != int(value):
        raise EnvError(f"option {name!r} must be an integer, got {value!r}")
    number = kind(value)
    if not low <= number <= high:
        raise EnvError(f"option {name!r} must be in [{low}, {high}], got {value!r}")
    return number
