"""One episode: chat-templated turns against the env-gateway, scored by the reward service.

Token bookkeeping is exact (see `transcript.py`): the trajectory's tokens are exactly the
tokens the engine saw and produced.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import grpc

from treadle_common.clients.env import EnvClient, EnvRequestError
from treadle_common.clients.reward import RewardClient
from treadle_common.proto.treadle.v1 import env_pb2, reward_pb2, task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_common.runtime import tracing
from treadle_common.runtime.logs import get_logger
from treadle_common.runtime.progress import Stage
from treadle_rollout import metrics
from treadle_rollout.engines.base import ContextOverflow, Engine, Generation, Sampling
from treadle_rollout.played import PlayedEpisodes, PlayedSampling
from treadle_rollout.policies import RunPolicies
from treadle_rollout.transcript import TemplateNotPrefixStable, Transcript

log = get_logger(__name__)


class EpisodeRunner:
    def __init__(
        self,
        engine: Engine,
        tokenizer,
        env: EnvClient,
        reward: RewardClient,
        replica: str,
        generate_stage: Stage | None = None,
        played: PlayedEpisodes | None = None,
        policies: RunPolicies | None = None,
    ):
        """`played` answers the model calls of played envs' episodes (`Session.played`, e.g.
        `verifiers` environments); without it they fail."""
        self.played = played
        self.policies = policies
        self.generate_stage = generate_stage or Stage("rollout", "generate")
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env
        self.reward = reward
        self.replica = replica

    def _adapter(self, task: task_pb2.Task) -> str | None:
        """The adapter a task's run samples through (a LoRA run's policy), or None."""
        if self.policies is not None and self.policies.is_adapter(task.model):
            return task.model
        return None

    async def run(
        self, task: task_pb2.Task, sample_index: int, gate: asyncio.Future | None = None
    ) -> tpb.Trajectory:
        """Play one episode of `task`. `gate`, when given, is awaited after the env session is
        open and the prompt rendered, before the first generation (the weights it needs)."""
        metrics.EPISODES_IN_FLIGHT.inc()
        try:
            with tracing.tracer().start_as_current_span("rollout.episode") as span:
                traj = await self._run(task, sample_index, gate)
                tracing.inject_proto(traj.trace)  # the trainer's spans join this trace
                span.set_attributes(
                    {
                        "treadle.trajectory_id": traj.trajectory_id,
                        "treadle.sample_index": sample_index,
                        "treadle.status": tpb.TrajectoryStatus.Name(traj.status),
                        "treadle.reward": traj.reward,
                        "treadle.num_tokens": len(traj.tokens),
                        "treadle.error": traj.error,
                    }
                )
        finally:
            metrics.EPISODES_IN_FLIGHT.dec()
        for phase in ("queue", "generate", "env", "reward", "total"):
            metrics.PHASE.labels(phase).observe(getattr(traj.timings, f"{phase}_s"))
        return traj

    async def _run(
        self, task: task_pb2.Task, sample_index: int, gate: asyncio.Future | None
    ) -> tpb.Trajectory:
        started = time.time()
        backoff = 0.25
        while True:
            traj = self._trajectory(task, sample_index, started)
            t = Transcript(self.tokenizer)
            try:
                info = await self._play(task, sample_index, t, traj, gate)
                break
            except (grpc.aio.AioRpcError, EnvRequestError) as exc:
                if not (_gateway_gone(exc) and time.time() - started < ENV_RETRY_S):
                    return self._env_failed(exc, traj, t, started)
            except _SandboxFailure as exc:
                return _failed(traj, t, tpb.TRAJECTORY_STATUS_SANDBOX_ERROR, str(exc), started)
            except _EnvFailure as exc:
                return _failed(traj, t, tpb.TRAJECTORY_STATUS_ENV_ERROR, str(exc), started)
            except (_EngineFailure, TemplateNotPrefixStable) as exc:
                return _failed(traj, t, tpb.TRAJECTORY_STATUS_ENGINE_ERROR, str(exc), started)
            # the gateway went away (restarting: its sessions are gone): play it again
            metrics.EPISODE_RETRIES.inc()
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, 4.0)
        return await self._score(task, traj, t, info, started)

    def _trajectory(self, task: task_pb2.Task, sample_index: int, started: float):
        traj = tpb.Trajectory(
            # one id per (task, sample): a task played twice yields the same ids, which the
            # trainer trains once
            trajectory_id=f"{task.task_id}/{sample_index}",
            group_id=task.task_id,
            task_id=task.task_id,
            run_id=task.run_id,
            env=task.env,
            sample_index=sample_index,
            rollout_replica=self.replica,
        )
        traj.timings.queue_s = max(0.0, started - task.created_at)
        return traj

    def _env_failed(
        self, exc: Exception, traj: tpb.Trajectory, t: Transcript, started: float
    ) -> tpb.Trajectory:
        if isinstance(exc, grpc.aio.AioRpcError):
            unreachable = exc.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            where = GATEWAY_UNREACHABLE if unreachable else "env-gateway"
            return _failed(
                traj,
                t,
                tpb.TRAJECTORY_STATUS_ENV_ERROR,
                f"{where}: {exc.code().name}: {exc.details()}",
                started,
            )
        return _failed(traj, t, tpb.TRAJECTORY_STATUS_ENV_ERROR, f"env-gateway: {exc}", started)

    async def _score(
        self, task: task_pb2.Task, traj: tpb.Trajectory, t: Transcript, info: dict, started: float
    ) -> tpb.Trajectory:
        reward_start = time.time()
        with tracing.tracer().start_as_current_span("rollout.score"):  # the hop, as seen here
            result = await self.reward.score(
                t.score_request(task.scorer, task.payload_json, info, task.scorer_options_json)
            )
        traj.timings.reward_s = time.time() - reward_start
        if result.status != reward_pb2.SCORE_STATUS_OK:
            status = reward_pb2.ScoreStatus.Name(result.status)
            return _failed(
                traj,
                t,
                tpb.TRAJECTORY_STATUS_REWARD_ERROR,
                f"reward {status}: {result.message}",
                started,
            )
        traj.reward = result.reward
        traj.reward_breakdown.update(result.breakdown)
        if traj.status == tpb.TRAJECTORY_STATUS_UNSPECIFIED:
            traj.status = tpb.TRAJECTORY_STATUS_OK
        _fill(traj, t, started)
        return traj

    async def _play(
        self,
        task: task_pb2.Task,
        sample_index: int,
        t: Transcript,
        traj: tpb.Trajectory,
        gate: asyncio.Future | None,
    ) -> dict:
        env_start = time.time()
        try:
            session = await self.env.create(
                task.env,
                json.loads(task.payload_json or "{}"),
                seed=sample_index,
                options=json.loads(task.env_options_json or "{}"),
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # no such env: playing again won't help
                raise _EnvFailure(f"env-gateway: NOT_FOUND: {exc.details()}") from exc
            raise
        traj.timings.env_s += time.time() - env_start
        if session.played:
            return await self._played(task, sample_index, session.session_id, t, traj, gate)
        sampling = Sampling(
            temperature=task.sampling.temperature,
            top_p=task.sampling.top_p or 1.0,
            max_new_tokens=task.sampling.max_new_tokens or 16,
            seed=task.sampling.seed + sample_index if task.sampling.seed else None,
            priority=task.created_at or time.time(),  # oldest task first
            last_turn=task.max_turns <= 1,
            adapter=self._adapter(task),
        )
        info: dict = {}
        closed = False
        try:
            t.add_messages(_messages(session.observation))
            if gate is not None:
                await asyncio.shield(gate)  # shared by the group: one episode must not cancel it
            for turn in range(max(1, task.max_turns)):
                gen = await self._generate(t, sampling, traj, turn)
                if gen is None:
                    break
                text = t.add_generation(gen)
                traj.num_turns = turn + 1
                env_start = time.time()
                step = await self.env.step(session.session_id, text, close_when_done=True)
                closed = step.done
                traj.timings.env_s += time.time() - env_start
                info = _stepped(task, step, traj)
                if step.done:
                    break
                t.close_turn(gen)  # before the env's reply
                t.add_messages(_messages(step.observation))
            else:
                traj.status = tpb.TRAJECTORY_STATUS_TRUNCATED
        finally:
            if not closed:
                await self.env.close_session(session.session_id)
        return info

    async def _generate(
        self, t: Transcript, sampling: Sampling, traj: tpb.Trajectory, turn: int
    ) -> Generation | None:
        """One turn's generation, timed; None when the context is full (the episode ends)."""
        gen_start = time.time()
        try:
            with (
                tracing.tracer().start_as_current_span("rollout.generate") as span,
                self.generate_stage.track(),
            ):
                gen = await self.engine.generate(t.tokens, sampling)
                span.set_attributes(
                    {
                        "treadle.turn": turn,
                        "treadle.new_tokens": len(gen.tokens),
                        "treadle.version": gen.versions[-1] if gen.versions else -1,
                    }
                )
        except ContextOverflow as exc:  # the context is full: the episode ends here
            traj.status = tpb.TRAJECTORY_STATUS_TRUNCATED
            traj.error = str(exc)
            return None
        except Exception as exc:  # the engine's failure becomes a trajectory status
            raise _EngineFailure(f"{type(exc).__name__}: {exc}") from exc
        traj.timings.generate_s += time.time() - gen_start
        return gen

    async def _played(
        self,
        task: task_pb2.Task,
        sample_index: int,
        gateway_session: str,
        t: Transcript,
        traj: tpb.Trajectory,
        gate: asyncio.Future | None,
    ) -> dict:
        """A played env's episode: the env runs its own loop in the gateway, its model calls
        come back over `Play` and are answered by `played.py`, recorded into `t`."""
        if self.played is None:
            await self.env.close_session(gateway_session)
            raise _EnvFailure(f"env {task.env} is played; this rollout has no OpenAI API")
        try:
            if gate is not None:
                await asyncio.shield(gate)
        except BaseException:
            await self.env.close_session(gateway_session)  # a Play closes it; none began
            raise
        run = PlayedSampling(
            temperature=task.sampling.temperature,
            top_p=task.sampling.top_p or 1.0,
            max_tokens=task.sampling.max_new_tokens or 16,
            seed=task.sampling.seed + sample_index if task.sampling.seed else None,
            model=self._adapter(task),
        )
        result = await self._play_through(self.played, task, gateway_session, run, t, traj)
        return _stepped(task, result, traj)  # the whole episode's outcome, as a step's

    async def _play_through(
        self,
        played: PlayedEpisodes,
        task: task_pb2.Task,
        gateway_session: str,
        run: PlayedSampling,
        t: Transcript,
        traj: tpb.Trajectory,
    ):
        """The gateway's `Play` of one episode, its model calls answered and timed."""
        recorded = played.open(t)
        play_start = time.time()
        generate_s = 0.0

        async def answer(request: env_pb2.ModelRequest) -> env_pb2.ModelResponse:
            nonlocal generate_s
            start = time.time()
            with self.generate_stage.track():
                status, content_type, body = await played.answer(
                    recorded, request.method, request.path, request.body, run
                )
            generate_s += time.time() - start
            if status >= 400:  # the env's request was refused: say why, here too
                metrics.PLAYED_REFUSED.labels(str(status)).inc()
                log.warning(
                    "played env's model call refused",
                    env=task.env,
                    status=status,
                    body=body[:500].decode(errors="replace"),
                )
            return env_pb2.ModelResponse(status=status, content_type=content_type, body=body)

        sampling = {"temperature": run.temperature, "top_p": run.top_p}
        sampling["max_tokens"] = run.max_tokens
        try:
            model = run.model or played.model_name
            return await self.env.play(gateway_session, model, sampling, answer)
        finally:
            traj.num_turns = played.close(recorded)
            traj.timings.generate_s += generate_s
            traj.timings.env_s += max(0.0, time.time() - play_start - generate_s)


GATEWAY_UNREACHABLE = "env-gateway unreachable"
"""How an episode's error starts when the gateway itself did not answer (infrastructure, not
the env's failure: the env's circuit breaker does not count it)."""
ENV_RETRY_S = 60.0
"""An episode whose env-gateway went away (restarting) is played again, from the start, for
up to this long (jittered backoff); after that it fails as `env_error`."""


def _gateway_gone(exc: Exception) -> bool:
    """The gateway is unreachable, or restarted and forgot the episode's session."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
    return isinstance(exc, EnvRequestError) and exc.code == grpc.StatusCode.NOT_FOUND.name


class _EngineFailure(RuntimeError):
    pass


class _EnvFailure(RuntimeError):
    pass


class _SandboxFailure(RuntimeError):
    pass


def _stepped(task: task_pb2.Task, step, traj: tpb.Trajectory) -> dict:
    """An env step's (or a played episode's) outcome: its info (the env's own reward in it,
    for the `env_reward` scorer); its failure raised."""
    traj.sandbox_runs += step.sandbox_runs
    if step.status == "env_error":
        raise _EnvFailure(f"env {task.env} raised: {step.error}")
    if step.status == "sandbox_error":
        raise _SandboxFailure(f"sandbox failed: {step.error}")
    info = json.loads(step.info_json or "{}")
    if step.has_reward:
        info.setdefault("reward", step.reward)
    return info


def _messages(observation) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in observation.messages]


def _fill(traj: tpb.Trajectory, t: Transcript, started: float) -> None:
    t.fill(traj)
    traj.timings.total_s = time.time() - started


def _failed(
    traj: tpb.Trajectory,
    t: Transcript,
    status: tpb.TrajectoryStatus,
    error: str,
    started: float,
) -> tpb.Trajectory:
    traj.status = status
    traj.error = error
    _fill(traj, t, started)
    return traj
