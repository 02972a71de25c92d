"""Sessions issued against a task: what an agent is judged against stays on the server.

An agent (the `agent` role) plays a recorded session through the OpenAI API and then says it
is done; it never names the run, the task (which holds the reference answer or the tests),
the scorer or the GRPO group, since with those it could grade itself (`exact_match` against
its own reply scores 1). A trusted caller (the `trainer` role: the run's driver) opens the
session first with `POST /v1/sessions`, and the binding lives in Redis
(`names.issued_session`) so that whichever rollout replica the agent finishes on reads the
same one. Finishing consumes it: a session is judged once.
"""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from treadle_common import names

MAX_TTL_S = 86_400.0


class OpenSession(BaseModel):
    """`POST /v1/sessions`: open an agent's session against a task of an active run."""

    model_config = ConfigDict(extra="forbid")
    run_id: str = Field(pattern=names.ID_PATTERN, description="The active run it feeds")
    scorer: str = Field(min_length=1, max_length=256, description="The reward-service scorer")
    task_json: str = Field(
        "{}", max_length=1 << 20, description="The task as the scorer reads it (the answer...)"
    )
    group_id: str | None = Field(
        None, max_length=256, description="GRPO group (default: the session id)"
    )
    task_id: str | None = Field(None, max_length=256, description="Default: the session id")
    session_id: str | None = Field(
        None,
        pattern=names.NAME_PATTERN,
        max_length=names.NAME_MAX,
        description="The id the agent sends as `X-Treadle-Session` (default: a new one)",
    )
    ttl_s: float = Field(3600.0, gt=0, le=MAX_TTL_S, description="Unfinished, it expires")


class Issued(BaseModel):
    """What a session was opened against, as stored."""

    run_id: str
    scorer: str
    task_json: str
    group_id: str
    task_id: str


def binding(req: OpenSession) -> tuple[str, Issued]:
    """The session id (the caller's or a new one) and what it is bound to."""
    sid = req.session_id or f"s-{uuid.uuid4().hex}"
    issued = Issued(
        run_id=req.run_id,
        scorer=req.scorer,
        task_json=req.task_json,
        group_id=req.group_id or sid,
        task_id=req.task_id or sid,
    )
    return sid, issued


async def store(redis: Redis, sid: str, issued: Issued, ttl_s: float) -> bool:
    """Keep the binding for `ttl_s`; False if `sid` is already bound (never overwritten)."""
    key = names.issued_session(sid)
    return bool(await redis.set(key, issued.model_dump_json(), nx=True, px=int(ttl_s * 1000)))


async def lookup(redis: Redis, sid: str) -> Issued | None:
    raw = await redis.get(names.issued_session(sid))
    return None if raw is None else Issued.model_validate_json(raw)
