"""Agents' recorded sessions, the part of the OpenAI-compatible API that turns a conversation
into training data (no HTTP: the routes are `openai_router.py`'s). A run's driver opens a
session against one of the run's tasks (`issue`, `issued.py`); the agent's chat completions
are recorded into it token-exactly (`chat.py`: `ChatTurns` and `SessionRecorder`);
`finish` makes it a trajectory of the run, scored by the task's scorer, in the same
transaction that counts it. What it is judged against is never the agent's to say
(`_judged_by`)."""

from __future__ import annotations

import time
import uuid

from treadle_common import names
from treadle_common.api.rollout import (
    FinishSession,
    SessionDeleted,
    SessionFinished,
    SessionInfo,
    SessionIssued,
)
from treadle_common.auth import policy as auth
from treadle_common.clients import streams
from treadle_common.fleet import runs as fleet
from treadle_common.proto.treadle.v1 import reward_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout import issued
from treadle_rollout.errors import OpenAIError
from treadle_rollout.transcript import Transcript


class AgentSessions:
    def __init__(self, recorder, redis=None, reward=None):
        self.recorder, self.redis, self.reward = recorder, redis, reward

    async def finish(
        self, session_id: str, body: FinishSession, role: auth.Role | None = None
    ) -> SessionFinished:
        """Turn a recorded session into a trajectory in `treadle:{run}:trajectories` of an
        active run. `role`: the caller's; an `agent` says only that it is done, on a session
        issued against a task (`issued.py`)."""
        if self.redis is None:
            raise OpenAIError(503, "this replica has no Redis connection", type_="server_error")
        session = self.recorder.get(session_id)  # its tenant's alone
        bound = await issued.lookup(self.redis, session_id)
        body = _judged_by(session_id, body, bound, role)
        assert body.run_id is not None
        if not await self.redis.sismember(names.RUNS_KEY, body.run_id):
            raise OpenAIError(404, f"no active run {body.run_id!r}", param="run_id")
        run_tenant = await fleet.tenant_of(self.redis, body.run_id)
        if run_tenant is not None and not auth.caller().may_see(run_tenant):
            raise OpenAIError(403, f"run {body.run_id!r} belongs to another tenant", param="run_id")
        async with session.lock:
            t = session.transcript
            traj = tpb.Trajectory(
                trajectory_id=uuid.uuid4().hex,
                group_id=body.group_id or session_id,
                task_id=body.task_id or session_id,
                run_id=body.run_id,
                env="openai-session",
                num_turns=session.turns,
                status=tpb.TRAJECTORY_STATUS_OK,
            )
            t.fill(traj)
            traj.timings.total_s = time.time() - session.created
            if body.reward is not None:
                traj.reward = body.reward
            else:
                traj.reward = await self._score(body, t)
            async with self.redis.pipeline(transaction=True) as pipe:
                await streams.add(pipe, names.trajectories_stream(body.run_id), traj)
                pipe.hincrby(names.run_state(body.run_id), "trajectories_produced", 1)
                pipe.delete(names.issued_session(session_id))  # judged once
                await pipe.execute()
            del self.recorder.sessions[session_id]
        return SessionFinished(
            trajectory_id=traj.trajectory_id,
            run_id=body.run_id or "",
            num_tokens=len(traj.tokens),
            num_generated=sum(traj.loss_mask),
            reward=traj.reward,
        )

    async def issue(self, req: issued.OpenSession) -> SessionIssued:
        """Open an agent's session against a task of an active run (`issued.py`)."""
        if self.redis is None:
            raise OpenAIError(503, "this replica has no Redis connection", type_="server_error")
        if not await self.redis.sismember(names.RUNS_KEY, req.run_id):
            raise OpenAIError(404, f"no active run {req.run_id!r}", param="run_id")
        run_tenant = await fleet.tenant_of(self.redis, req.run_id)
        if run_tenant is not None and not auth.caller().may_see(run_tenant):
            raise OpenAIError(403, f"run {req.run_id!r} belongs to another tenant", param="run_id")
        sid, bound = issued.binding(req)
        if sid in self.recorder.sessions or not await issued.store(
            self.redis, sid, bound, req.ttl_s
        ):
            raise OpenAIError(409, f"session {sid!r} exists", param="session_id")
        return SessionIssued(session_id=sid, run_id=req.run_id, expires_in_s=req.ttl_s)

    async def _score(self, body: FinishSession, t: Transcript) -> float:
        if self.reward is None:
            raise OpenAIError(503, "this replica has no reward client", type_="server_error")
        assert body.scorer is not None
        result = await self.reward.score(t.score_request(body.scorer, body.task_json or "{}"))
        if result.status != reward_pb2.SCORE_STATUS_OK:
            raise OpenAIError(
                502,
                f"scorer {body.scorer}: {reward_pb2.ScoreStatus.Name(result.status)}: "
                f"{result.message}",
                type_="server_error",
            )
        return result.reward

    def info(self, session_id: str) -> SessionInfo:
        session = self.recorder.get(session_id)
        t = session.transcript
        return SessionInfo(
            session_id=session_id,
            turns=session.turns,
            num_tokens=len(t.tokens),
            num_generated=sum(t.loss_mask),
            versions=sorted({v for v in t.versions if v >= 0}),
            messages=t.messages,
        )

    def discard(self, session_id: str) -> SessionDeleted:
        """A recorded session dropped unfinished: never trained on."""
        self.recorder.get(session_id)
        del self.recorder.sessions[session_id]
        return SessionDeleted(deleted=session_id)


def _judged_by(
    session_id: str, body: FinishSession, bound: issued.Issued | None, role: auth.Role | None
) -> FinishSession:
    """What `session_id` is judged against: its issued binding, or (a trusted caller's
    session that was not issued) what the body names. An agent names nothing."""
    if role is auth.Role.agent and body.names_anything():
        raise OpenAIError(
            403,
            "an agent only says a session is done (an empty body): its run, task, scorer and "
            "group were set when the session was opened (POST /v1/sessions)",
            code="permission_denied",
        )
    if bound is not None:
        if body.names_anything():
            raise OpenAIError(
                400, f"session {session_id!r} was issued against a task: finish it with {{}}"
            )
        return FinishSession(**bound.model_dump())
    if role is auth.Role.agent:
        raise OpenAIError(
            403,
            f"session {session_id!r} was not issued against a task: an agent finishes only "
            "sessions its trainer opened (POST /v1/sessions)",
            code="permission_denied",
        )
    if body.run_id is None:
        raise OpenAIError(
            400, "name the run_id (or open the session against a task)", param="run_id"
        )
    if body.reward is None and not body.scorer:
        raise OpenAIError(400, "give a reward or a scorer", param="reward")
    return body
