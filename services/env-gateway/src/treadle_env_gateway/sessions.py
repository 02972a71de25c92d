"""Sessions: one `Env` instance per session, steps serialized, idle sessions expire.

Session ids are `{replica}:{uuid}` so that, with several gateway replicas, a client can
route a step to the replica that owns the session.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from treadle_common.runtime import metrics
from treadle_common.runtime.logs import get_logger
from treadle_env_gateway import faults
from treadle_env_gateway.envs import registry
from treadle_env_gateway.envs.base import (
    Action,
    Env,
    EnvError,
    Message,
    Model,
    PlayedEnv,
    StepResult,
    UnknownEnv,
)
from treadle_env_gateway.errors import CapacityExceeded, EnvCrashed, UnknownSession
from treadle_env_gateway.faults import Faults
from treadle_env_gateway.latency import Latency, latency_from
from treadle_env_gateway.sandbox.runner import RUNS as sandbox_runs
from treadle_env_gateway.settings import EnvGatewaySettings

log = get_logger(__name__)

SERVICE = "env-gateway"


@dataclass
class Session:
    session_id: str
    env_name: str
    env: Env
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    done: bool = False
    latency: Latency | None = None
    fault: str | None = None
    """Why the session's first step fails (an injected fault, `faults.py`), or None."""


class InjectedFault(RuntimeError):
    """A failure the session's `faults` option asked for."""


class SessionManager:
    def __init__(
        self,
        replica: str,
        max_sessions: int = 1024,
        idle_ttl_s: float = 600.0,
        max_action_chars: int = 65_536,
        env_modules: tuple[str, ...] = (),
        settings: EnvGatewaySettings | None = None,
    ):
        self.replica = replica
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.max_action_chars = max_action_chars
        self.envs = registry(env_modules)
        for cls in self.envs.values():
            cls.configure(settings or EnvGatewaySettings())
        self.sessions: dict[str, Session] = {}
        self.faults = Faults()

    def env_class(self, name: str) -> type[Env]:
        try:
            return self.envs[name]
        except KeyError:
            raise UnknownEnv(f"unknown env {name!r}; known: {sorted(self.envs)}") from None

    async def sample_tasks(
        self, env: str, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict]:
        if num_tasks < 0 or num_tasks > 100_000:
            raise EnvError(f"num_tasks must be in [0, 100000], got {num_tasks}")
        faults.parse(options)  # a run's malformed `faults` fails its start, not its episodes
        tasks = self.env_class(env).sample_tasks(num_tasks, seed, split or "train", options)
        # an env whose tasks live in another process (verifiers-v1) answers them async
        return await tasks if inspect.isawaitable(tasks) else tasks

    async def create(
        self, env_name: str, task: dict[str, Any], seed: int, options: dict[str, Any]
    ) -> tuple[Session, list[Message]]:
        cls = self.env_class(env_name)
        if len(self.sessions) >= self.max_sessions:
            metrics.DROPPED.labels(SERVICE, "session", "capacity").inc()
            raise CapacityExceeded(
                f"{len(self.sessions)} sessions open; the limit is {self.max_sessions}"
            )
        env = cls(options)
        # delays differ per task and sample, and repeat exactly for the same (task, seed)
        episode = f"{json.dumps(task, sort_keys=True)}:{seed}"
        latency = latency_from(options, episode)
        fault = self.faults.check(options, episode)  # injected failures (option `faults`)
        try:
            observation = await env.reset(task, seed)
        except EnvError:
            raise
        except Exception as exc:
            metrics.DROPPED.labels(SERVICE, "session", "env_error").inc()
            raise EnvCrashed(
                f"env {env_name!r} failed to reset: {type(exc).__name__}: {exc}"
            ) from exc
        session = Session(
            f"{self.replica}:{uuid.uuid4().hex}", env_name, env, latency=latency, fault=fault
        )
        self.sessions[session.session_id] = session
        return session, observation

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSession(
                f"no session {session_id!r} (closed, expired or never created)"
            ) from None

    async def step(self, session_id: str, action: Action) -> StepResult:
        """One step. Malformed tool calls are answered without reaching the env; an env that
        raises ends its session with `env_error` (the gateway stays up)."""
        session = self.get(session_id)
        size = len(action.text) + sum(len(str(c.arguments)) for c in action.tool_calls)
        if size > self.max_action_chars:
            raise EnvError(
                f"action of {size} characters exceeds the limit of {self.max_action_chars}"
            )
        async with session.lock:
            if session.done:
                raise EnvError(f"session {session_id} is done; create a new one")
            session.last_used = time.monotonic()
            if session.latency is not None:
                await session.latency.wait()
            problems = self._malformed_calls(session.env, action)
            if problems:
                return StepResult(
                    problems, done=False, info={"malformed_tool_calls": len(problems)}
                )
            runs = [0]
            counting = sandbox_runs.set(runs)
            try:
                if session.fault is not None:
                    raise InjectedFault(session.fault)
                result = await session.env.step(action)
                result.sandbox_runs = runs[0]
            except EnvError:
                raise
            except Exception as exc:  # the env's bug ends its session, not the gateway
                session.done = True
                metrics.DROPPED.labels(SERVICE, "session", "env_error").inc()
                log.error("env raised", env=session.env_name, error=repr(exc))
                return StepResult(
                    [], done=True, status="env_error", error=f"{type(exc).__name__}: {exc}"
                )
            finally:
                sandbox_runs.reset(counting)
            session.done = result.done
            return result

    @staticmethod
    def _malformed_calls(env: Env, action: Action) -> list[Message]:
        known = {tool["function"]["name"] for tool in env.tools}
        problems = []
        for call in action.tool_calls:
            error = call.error or (
                "" if call.name in known else f"unknown tool {call.name!r}; tools: {sorted(known)}"
            )
            if error:
                problems.append(Message("tool", f"error: {error}", tool_call_id=call.id))
        return problems

    async def play(
        self, session_id: str, model: Model, model_name: str, sampling: dict[str, Any]
    ) -> StepResult:
        """Play a played env's whole episode against `model`. An env that raises ends its
        session with `env_error` (the gateway stays up)."""
        session = self.get(session_id)
        env = session.env
        if not isinstance(env, PlayedEnv):
            raise EnvError(f"env {session.env_name!r} is stepped, not played: use Step")
        async with session.lock:
            if session.done:
                raise EnvError(f"session {session_id} is done; create a new one")
            session.last_used = time.monotonic()
            runs = [0]
            counting = sandbox_runs.set(runs)
            try:
                result = await env.play(model, model_name, sampling)
                result.sandbox_runs = runs[0]
            except EnvError:
                raise
            except Exception as exc:
                metrics.DROPPED.labels(SERVICE, "session", "env_error").inc()
                log.error("played env raised", env=session.env_name, error=repr(exc))
                result = StepResult(
                    [], done=True, status="env_error", error=f"{type(exc).__name__}: {exc}"
                )
            finally:
                sandbox_runs.reset(counting)
            session.done = True
            session.last_used = time.monotonic()
            return result

    async def close(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            await session.env.close()

    async def shutdown(self) -> None:
        """The gateway stops: every env class ends what it started."""
        for cls in set(self.envs.values()):
            await cls.shutdown()

    async def expire_idle(self) -> int:
        now = time.monotonic()
        stale = [s for s, sess in self.sessions.items() if now - sess.last_used > self.idle_ttl_s]
        for session_id in stale:
            await self.close(session_id)
            metrics.DROPPED.labels(SERVICE, "session", "idle_ttl").inc()
        return len(stale)
