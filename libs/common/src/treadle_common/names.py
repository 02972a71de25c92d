"""Every Redis key, NATS subject, KV bucket and default port, in one place.

Producers and consumers import these functions instead of formatting strings themselves.
"""

from __future__ import annotations

import re

ID_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
"""What a run id may be (DNS-1123 label: lowercase letters, digits and inner dashes, at most
63): it becomes part of Redis keys (`treadle:{run}:...`, split on `:`), NATS subjects and
directory names, so nothing in it may be a separator (`:`, `.`, `/`) or `..`."""

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$"
"""What a model name, session id or saved-state name may be (at most `NAME_MAX`): letters,
digits, `_`, `-` and single inner dots (`Qwen2.5-0.5B`): one path component that is never
`..`, one run of NATS subject tokens with none empty, no `:`, `/`, space or wildcard."""
NAME_MAX = 128
_NAME = re.compile(NAME_PATTERN)


def valid_name(value: str) -> bool:
    """`value` is a valid model name, session id or state name (`NAME_PATTERN`)."""
    return len(value) <= NAME_MAX and _NAME.fullmatch(value) is not None


def valid_file_name(value: str) -> bool:
    """`value` is one plain file name (an asset of a model directory): no separator, not
    `.` or `..`, no NUL, at most 255 bytes."""
    return (
        0 < len(value.encode()) <= 255
        and value not in (".", "..")
        and not any(c in value for c in "/\\\0")
    )


# --- Redis (durable work queues and small run state) -------------------------------------
RUNS_KEY = "treadle:runs"
"""Set of active run ids. The trainer adds its run; rollout consumes tasks of every member
whose policy's base model it serves (`RUN_POLICIES`)."""
RUN_POLICIES = "treadle:runs:policies"
"""Hash: run id -> its `fleet.RunPolicy` as JSON (the policy its tasks name, the base model
rollout must serve, its tenant, weight and priority). Written by the run's owner before the
run joins `RUNS_KEY`, removed when it ends."""


def tenant_episodes(tenant: str) -> str:
    """Sorted set: a tenant's episodes in flight across the fleet (member: one episode,
    score: when its lease lapses), for `quotas.TenantQuotas`."""
    return f"treadle:tenants:{tenant}:episodes"


def tenant_tokens(tenant: str, minute: int) -> str:
    """Counter: the tokens a tenant's episodes and requests generated in one minute (since
    the epoch), for `quotas.TenantQuotas`; expires after two."""
    return f"treadle:tenants:{tenant}:tokens:{minute}"


def adapter_policy(base: str, run: str) -> str:
    """The weight-store model a LoRA run publishes its adapter versions under: its own, so
    runs on one base never share a version sequence (`{base}.{run}`; the base's full-weight
    versions stay under `base`, shared and deduplicated)."""
    return f"{base}.{run}"


def tasks_stream(run: str) -> str:
    """Stream of `Task` protobufs; trainer -> rollout (consumer group `rollout`)."""
    return f"treadle:{run}:tasks"


def run_of(key: str) -> str:
    """The run id in a per-run key (`treadle:{run}:...`)."""
    return key.split(":")[1]


def trajectories_stream(run: str) -> str:
    """Stream of `Trajectory` protobufs; rollout -> trainer (consumer group `trainer`)."""
    return f"treadle:{run}:trajectories"


def run_state(run: str) -> str:
    """Hash of run state and counters (trainer version, produced/consumed counts)."""
    return f"treadle:{run}:state"


def run_config(run: str) -> str:
    """The run's recipe as JSON (a restarted trainer resumes the run from it)."""
    return f"treadle:{run}:config"


def fed_tasks(run: str) -> str:
    """Set of task ids the trainer fed (a trajectory of any other group is unknown)."""
    return f"treadle:{run}:fed"


def ledger_stream(run: str) -> str:
    """One entry per committed (checkpointed) step: trajectories trained and dropped."""
    return f"treadle:{run}:ledger"


def dead_letters(run: str) -> str:
    """Stream of tasks rollout gave up on (invalid, or failed `max_deliveries` times): the
    task, the reason, the last error and how often it was delivered."""
    return f"treadle:{run}:dead"


def quarantine(run: str) -> str:
    """Stream of episodes that failed past their retries (their group was not trained): the
    trajectory, its status, its error, its task and how often it was played."""
    return f"treadle:{run}:quarantine"


def env_health(run: str) -> str:
    """Hash: env name -> the outcomes of the run's last episodes of it ("0" played, "1"
    failed; the circuit breaker's window, `fleet.breaker`)."""
    return f"treadle:{run}:env_health"


def task_errors(run: str) -> str:
    """Hash: task entry id -> the last error an attempt at it raised (for its dead letter)."""
    return f"treadle:{run}:task_errors"


def run_owner(run: str) -> str:
    """Lease key: "{instance}#{token}" of the trainer that owns the run (expires if it dies)."""
    return f"treadle:{run}:owner"


def issued_session(session_id: str) -> str:
    """An agent session a trusted caller opened against a task: its run, task, scorer and
    group as JSON (`treadle_rollout.issued`), read when the agent says it is done; expires."""
    return f"treadle:sessions:{session_id}"


def run_keys(run: str) -> list[str]:
    """Every Redis key a run leaves behind (expired `trainer_run_retention_s` after its end;
    `treadle runs gc` deletes them)."""
    keys = [tasks_stream(run), trajectories_stream(run), run_state(run), run_config(run)]
    keys += [fed_tasks(run), ledger_stream(run), dead_letters(run), task_errors(run)]
    keys += [quarantine(run), env_health(run)]
    return [*keys, run_fence(run), run_status(run), run_steps(run), f"treadle:{run}:admitted"]


def run_status(run: str) -> str:
    """The run's `RunStatus` as JSON, without step records: written by its owner every step,
    so any trainer answers `GET /v1/runs/{id}` for it (the owner may have died or moved)."""
    return f"treadle:{run}:status"


def run_steps(run: str) -> str:
    """Hash: step number -> that step's record (JSON), written with `run_status`."""
    return f"treadle:{run}:steps"


def run_fence(run: str) -> str:
    """Counter (INCR): the run's fencing tokens, one per lease taken, never reused."""
    return f"treadle:{run}:fence"


ROLLOUT_GROUP = "rollout"
TRAINER_GROUP = "trainer"
TRAINER_CONSUMER = "owner"
"""The trainer's consumer name: stable, so a restarted owner replays its pending entries."""
STREAM_FIELD = "pb"
"""Field of a stream entry that holds the serialized protobuf."""

# --- NATS ---------------------------------------------------------------------------------
WEIGHTS_STREAM = "TREADLE_WEIGHTS"
"""JetStream stream holding weight announcements (last message per subject kept)."""
WEIGHTS_TENANT_KEY = "treadle.tenant"
"""A weight version's metadata key naming the tenant its model belongs to (the weight-store's
`tenancy.py`; a run's versions carry its tenant)."""


def weights_subject(model: str) -> str:
    """Weight-version announcements (`WeightAnnouncement`) for one model."""
    return f"treadle.weights.{model}"


def reward_subject(scorer: str) -> str:
    """Scoring request-reply (`ScoreRequest` -> `ScoreResult`), queue group `reward`."""
    return f"treadle.reward.{scorer}"


REWARD_BATCH_SUBJECT = "treadle.reward._batch"
REWARD_WILDCARD = "treadle.reward.*"
REWARD_QUEUE = "reward"


def run_control_subject(run: str) -> str:
    return f"treadle.run.{run}.control"


def run_events_subject(run: str) -> str:
    return f"treadle.run.{run}.events"


HEARTBEAT_BUCKET = "treadle_heartbeats"
"""NATS KV bucket: key `{service}.{instance}` -> JSON heartbeat."""

# --- Services and default ports -----------------------------------------------------------
SERVICES = ("weight-store", "env-gateway", "reward", "rollout", "trainer")
"""Start order for `treadle up`: dependencies first."""
HTTP_KEEPALIVE_S = 5
"""Services close an idle HTTP connection after this many seconds; clients drop theirs sooner."""

DEFAULT_PORTS: dict[str, dict[str, int]] = {
    "weight-store": {"grpc": 50051, "http": 8001},
    "env-gateway": {"grpc": 50052, "http": 8002},
    "reward": {"http": 8003},
    "rollout": {"grpc": 50054, "http": 8004},
    "trainer": {"http": 8005},
}

DEFAULT_INFRA_PORTS = {"redis": 16379, "nats": 14222, "s3": 18333}
"""Embedded infrastructure ports; deliberately not the system defaults (6379/4222)."""


def module_of(service: str) -> str:
    """Python module that runs a service: `weight-store` -> `treadle_weight_store`."""
    return "treadle_" + service.replace("-", "_")
