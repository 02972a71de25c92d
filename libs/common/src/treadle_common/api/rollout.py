"""The rollout service's HTTP API: `GET /v1/info` (`RolloutInfo`), `POST /v1/evaluate`,
`GET /v1/swaps`, `/v1/adapters` (LoRA adapters served next to the policy). (Its
OpenAI-compatible API has its own models, in the service.)"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from treadle_common import names
from treadle_common.api.ops import ServiceInfo

MAX_EVAL_TASKS = 4096


class Swap(BaseModel):
    """One weight swap: the version swapped in, the engine's pause and the fetch."""

    version: int
    pause_s: float
    fetch_s: float
    bytes_fetched: int
    at: float


class Swaps(BaseModel):
    swaps: list[Swap]


class RolloutInfo(ServiceInfo):
    model: str
    model_dir: str
    engine: str
    swap_policy: str
    policy_version: int
    version_lag: int
    weight_sync_error: str | None = None
    swaps: int
    last_swap: Swap | None = None
    engine_requests: int
    engine_busy_fraction: float
    engine_busy_s: float
    engine_stats: dict[str, float] = Field(
        default_factory=dict, description="Engine-specific counters (e.g. prefix-cache use)"
    )
    policies: dict[str, int] = Field(
        default_factory=dict,
        description="LoRA runs' policies served as adapters on this model: version of each",
    )
    tasks_done: int = 0
    tasks_invalid: int = 0
    tasks_cancelled: int = 0
    admission_waits: int = 0
    trajectories_pushed: int = 0
    recorded_sessions: int = 0

    def version_of(self, policy: str) -> int:
        """The version of `policy` rollout serves: its own policy's or a LoRA run's (-1:
        not loaded)."""
        if policy == self.model:
            return self.policy_version
        return self.policies.get(policy, -1)


class EvaluateRequest(BaseModel):
    env: str = Field(min_length=1, description="Environment registered in the env-gateway")
    env_options: dict[str, Any] = Field(
        default_factory=dict, description="The env's options (the recipe's `env.options`)"
    )
    tasks: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_EVAL_TASKS)
    scorer: str = Field("exact_match", min_length=1)
    scorer_options: dict[str, Any] = Field(default_factory=dict, description="The scorer's")
    max_turns: int = Field(1, ge=1, le=1024)
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(16, ge=1, le=32768)
    concurrency: int = Field(64, ge=1, le=1024, description="Episodes in flight at once")
    seed: int = Field(
        0, ge=0, description="Task i samples with seed + i when nonzero (temperature > 0)"
    )
    model: str | None = Field(
        None,
        description="The policy to evaluate: a LoRA run's policy model (served as an adapter "
        "on rollout's model); None: rollout's own policy",
    )
    min_version: int = Field(
        0, ge=0, description="The policy's version to evaluate at least (rollout loads it)"
    )


class EvaluateResult(BaseModel):
    num_tasks: int
    mean_reward: float
    rewards: list[float] = Field(description="Per task, in request order (failed = 0)")
    statuses: dict[str, int]
    policy_versions: list[int] = Field(description="Distinct policy versions that generated")
    seconds: float


class LoadAdapter(BaseModel):
    """`POST /v1/adapters`: serve a LoRA adapter published in the weight-store (the Tinker
    API's sampler weights). OpenAI requests then name it as their `model`."""

    name: str = Field(
        pattern=names.NAME_PATTERN, max_length=names.NAME_MAX, description="What requests call it"
    )
    model: str = Field(
        pattern=names.NAME_PATTERN, max_length=names.NAME_MAX, description="Weight-store model"
    )
    version: int = Field(ge=1, description="Weight-store version of the adapter")


class Adapters(BaseModel):
    adapters: list[str]


# --- the OpenAI-compatible API's own routes (rollout's `openai_router.py`) ---------------------
class ModelCard(BaseModel):
    """One entry of `GET /v1/models`: the policy (with its version) or an adapter on it."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "treadle"
    policy_version: int | None = Field(None, description="The policy's weight version")
    parent: str | None = Field(None, description="An adapter's base policy")


class ModelList(BaseModel):
    """`GET /v1/models`, as OpenAI's."""

    object: str = "list"
    data: list[ModelCard]


class SessionIssued(BaseModel):
    """`POST /v1/sessions`: an agent's session, opened against a task of an active run."""

    session_id: str
    run_id: str
    expires_in_s: float


class SessionInfo(BaseModel):
    """`GET /v1/sessions/{id}`: what a recorded session holds so far."""

    session_id: str
    turns: int
    num_tokens: int
    num_generated: int
    versions: list[int] = Field(description="The policy versions its tokens came from")
    messages: list[dict[str, Any]] = Field(description="The conversation, as recorded")


class FinishSession(BaseModel):
    """`POST /v1/sessions/{id}/finish`. A session opened with `POST /v1/sessions` is finished
    with an empty body (what it is judged against was set then); the `agent` role may finish
    only such a session. A trusted caller may finish any other naming all of it."""

    model_config = ConfigDict(extra="forbid")
    run_id: str | None = Field(
        None,
        pattern=names.ID_PATTERN,
        description="Active run whose trajectory stream receives it (names.ID_PATTERN)",
    )
    reward: float | None = Field(
        None, allow_inf_nan=False, description="The reward, if the caller computed it"
    )
    scorer: str | None = Field(None, description="Or: a reward-service scorer to ask")
    task_json: str | None = Field(None, description="Task payload passed to the scorer")
    group_id: str | None = Field(None, description="GRPO group (defaults to the session id)")
    task_id: str | None = None

    def names_anything(self) -> bool:
        return any(v is not None for v in self.model_dump().values())


class SessionFinished(BaseModel):
    """`POST /v1/sessions/{id}/finish`: the trajectory it became."""

    trajectory_id: str
    run_id: str
    num_tokens: int
    num_generated: int
    reward: float


class SessionDeleted(BaseModel):
    """`DELETE /v1/sessions/{id}`: discarded, never trained on."""

    deleted: str
