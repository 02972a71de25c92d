"""gRPC `treadle.v1.EnvGateway`: the data plane rollout uses to step environments.

Besides one call per hop (`CreateSession`, `Step`, `CloseSession`), a group's hops go in one
call each: `CreateSessions` (one task, a seed per episode), `StepMany` (any sessions; results
stream back as soon as their steps are done, the ones that finished together in one
message, so a slow tool call delays only its own episode) and `CloseSessions`. A step with
`close_when_done` closes its session when it ends the episode, so a finished episode needs
no close hop at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from asyncio import FIRST_COMPLETED

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from treadle_common.auth import policy as auth
from treadle_common.auth.policy import ANY, ROLLOUT, WORKERS
from treadle_common.proto.treadle.v1 import env_pb2 as pb
from treadle_common.proto.treadle.v1 import env_pb2_grpc
from treadle_common.runtime import metrics, tracing
from treadle_common.runtime.errors import ServiceError, grpc_abort
from treadle_common.runtime.progress import Stage
from treadle_env_gateway.envs.base import (
    Action,
    EnvError,
    Message,
    ModelReply,
    ToolCall,
)
from treadle_env_gateway.sessions import SERVICE, SessionManager

POLICY = auth.grpc_policy(
    pb,
    "EnvGateway",
    ListEnvs=ANY,
    SampleTasks=WORKERS,
    CreateSession=ROLLOUT,
    Step=ROLLOUT,
    CloseSession=ROLLOUT,
    CreateSessions=ROLLOUT,
    StepMany=ROLLOUT,
    CloseSessions=ROLLOUT,
    Play=ROLLOUT,
)
"""Sessions are rollout's (it plays the episodes; reward's code scorer runs tests through a
session with rollout's token); the trainer samples tasks; anyone authenticated lists envs."""


def parse_json(text: str, what: str) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EnvError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise EnvError(f"{what} must be a JSON object")
    return value


def observation_pb(messages: list[Message]) -> pb.Observation:
    return pb.Observation(
        messages=[
            pb.Message(role=m.role, content=m.content, tool_call_id=m.tool_call_id)
            for m in messages
        ]
    )


def tool_call_from_pb(call: pb.ToolCall) -> ToolCall:
    """A malformed call is kept, with its error, so the env can answer it as an observation."""
    try:
        return ToolCall(
            call.id, call.name, parse_json(call.arguments_json, f"tool call {call.name} arguments")
        )
    except EnvError as exc:
        return ToolCall(call.id, call.name, {}, error=str(exc))


def action_from_pb(action: pb.Action) -> Action:
    return Action(text=action.text, tool_calls=[tool_call_from_pb(c) for c in action.tool_calls])


def step_pb(result) -> pb.StepResponse:
    return pb.StepResponse(
        observation=observation_pb(result.observation),
        has_reward=result.reward is not None,
        reward=result.reward or 0.0,
        done=result.done,
        info_json=json.dumps(result.info),
        status=result.status,
        error=result.error,
        sandbox_runs=result.sandbox_runs,
    )


@contextlib.asynccontextmanager
async def _as_status(context: grpc.aio.ServicerContext, method: str):
    parent = tracing.from_grpc(context.invocation_metadata())
    with tracing.tracer().start_as_current_span(
        f"env.{method}", context=parent, kind=SpanKind.SERVER
    ) as span:
        try:
            yield span
            metrics.REQUESTS.labels(SERVICE, method, "ok").inc()
        except ServiceError as exc:
            metrics.REQUESTS.labels(SERVICE, method, type(exc).__name__).inc()
            span.set_status(Status(StatusCode.ERROR, exc.message))
            await grpc_abort(context, exc)


class EnvGatewayServicer(env_pb2_grpc.EnvGatewayServicer):
    def __init__(self, sessions: SessionManager, stage: Stage | None = None):
        self.sessions = sessions
        self.stage = stage or Stage(SERVICE, "step")

    async def ListEnvs(self, request, context):
        return pb.ListEnvsResponse(envs=sorted(self.sessions.envs))

    async def SampleTasks(self, request: pb.SampleTasksRequest, context):
        async with _as_status(context, "SampleTasks"):
            options = parse_json(request.options_json, "options_json")
            tasks = await self.sessions.sample_tasks(
                request.env, request.num_tasks, request.seed, request.split, options
            )
            return pb.SampleTasksResponse(tasks_json=[json.dumps(t) for t in tasks])

    async def CreateSession(self, request: pb.CreateSessionRequest, context):
        async with _as_status(context, "CreateSession") as span:
            span.set_attribute("treadle.env", request.env)
            task = parse_json(request.task_json, "task_json")
            options = parse_json(request.options_json, "options_json")
            session, observation = await self.sessions.create(
                request.env, task, request.seed, options
            )
            return self._session_pb(session, observation)

    def _session_pb(self, session, observation: list[Message]) -> pb.Session:
        tools = [
            pb.ToolSpec(
                name=t["function"]["name"],
                description=t["function"].get("description", ""),
                parameters_json=json.dumps(t["function"].get("parameters", {})),
            )
            for t in session.env.tools
        ]
        return pb.Session(
            session_id=session.session_id,
            replica=self.sessions.replica,
            observation=observation_pb(observation),
            tools=tools,
            played=session.env.played,
        )

    async def CreateSessions(self, request: pb.CreateSessionsRequest, context):
        """All or nothing: if one session cannot be created, none stays open."""
        async with _as_status(context, "CreateSessions") as span:
            span.set_attributes({"treadle.env": request.env, "treadle.count": len(request.seeds)})
            task = parse_json(request.task_json, "task_json")
            options = parse_json(request.options_json, "options_json")
            created = []
            try:
                for seed in request.seeds:
                    created.append(await self.sessions.create(request.env, task, seed, options))
            except BaseException:
                for session, _ in created:
                    await self.sessions.close(session.session_id)
                raise
            return pb.CreateSessionsResponse(
                sessions=[self._session_pb(s, obs) for s, obs in created]
            )

    async def _step(self, request: pb.StepRequest) -> pb.StepResponse:
        with self.stage.track():
            action = action_from_pb(request.action)
            result = await self.sessions.step(request.session_id, action)
        if request.close_when_done and result.done:
            await self.sessions.close(request.session_id)
        return step_pb(result)

    async def Step(self, request: pb.StepRequest, context):
        async with _as_status(context, "Step"):
            return await self._step(request)

    async def StepMany(self, request: pb.StepManyRequest, context):
        """Every step at once; results stream back in the order they finish, the steps that
        finished together in one message. A step the gateway refuses is an item with status
        `request_error`, not the end of the call."""
        parent = tracing.from_grpc(context.invocation_metadata())
        # not the current span: this generator yields, and a caller that goes away closes it
        # from another context, where a current span could not be detached
        span = tracing.tracer().start_span("env.StepMany", context=parent, kind=SpanKind.SERVER)
        span.set_attribute("treadle.count", len(request.steps))
        try:

            async def one(index: int, step: pb.StepRequest) -> pb.StepManyItem:
                try:
                    with tracing.item_span("env.Step", step.trace):
                        result = await self._step(step)
                except ServiceError as exc:
                    metrics.REQUESTS.labels(SERVICE, "Step", type(exc).__name__).inc()
                    return pb.StepManyItem(
                        index=index,
                        result=pb.StepResponse(status="request_error", error=exc.message),
                        code=exc.grpc_status.name,
                    )
                metrics.REQUESTS.labels(SERVICE, "Step", "ok").inc()
                return pb.StepManyItem(index=index, result=result)

            running = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(request.steps)]
            pending = set(running)
            try:
                while pending:  # one message per wake-up: each stream message costs ~1 ms
                    done, pending = await asyncio.wait(pending, return_when=FIRST_COMPLETED)
                    items = sorted((task.result() for task in done), key=lambda i: i.index)
                    yield pb.StepManyResults(items=items)
            finally:  # the caller went away: stop the steps still running
                for task in running:
                    task.cancel()
        finally:
            span.end()

    async def Play(self, requests, context):
        """A played episode: the env's model calls go up this call as `request`s, rollout's
        answers come back on it; the last message is the `result`. The session closes when
        the call ends, however it ends."""
        parent = tracing.from_grpc(context.invocation_metadata())
        span = tracing.tracer().start_span("env.Play", context=parent, kind=SpanKind.SERVER)
        relay = _PlayRelay(requests)
        session_id = ""
        try:
            try:
                first = await relay.first()
                session_id = first.session_id
                span.set_attribute("treadle.session_id", session_id)
                sampling = parse_json(first.sampling_json, "sampling_json")
                self.sessions.get(session_id)
            except ServiceError as exc:
                metrics.REQUESTS.labels(SERVICE, "Play", type(exc).__name__).inc()
                await grpc_abort(context, exc)
                return
            play = asyncio.ensure_future(
                self.sessions.play(session_id, relay, first.model, sampling)
            )
            try:
                async for message in relay.down(play):
                    yield message
            except ServiceError as exc:
                metrics.REQUESTS.labels(SERVICE, "Play", type(exc).__name__).inc()
                await grpc_abort(context, exc)
                return
            finally:
                play.cancel()
            metrics.REQUESTS.labels(SERVICE, "Play", "ok").inc()
        finally:
            relay.stop()
            if session_id:
                await self.sessions.close(session_id)
            span.end()

    async def CloseSession(self, request: pb.CloseSessionRequest, context):
        async with _as_status(context, "CloseSession"):
            await self.sessions.close(request.session_id)
            return pb.CloseSessionResponse()

    async def CloseSessions(self, request: pb.CloseSessionsRequest, context):
        async with _as_status(context, "CloseSessions"):
            for session_id in request.session_ids:
                await self.sessions.close(session_id)
            return pb.CloseSessionResponse()


class PlayAborted(RuntimeError):
    """Rollout ended the Play call before answering the env's model call."""


class _PlayRelay:
    """Both directions of one `Play` call: the env's model requests go into `outbox` (sent
    down by `down`), rollout's answers resolve them by id."""

    def __init__(self, requests):
        self.requests = requests
        self.outbox: asyncio.Queue[pb.PlayDown] = asyncio.Queue()
        self.waiting: dict[int, asyncio.Future[pb.ModelResponse]] = {}
        self.next_id = 0
        self.reader: asyncio.Task | None = None

    async def first(self) -> pb.PlayStart:
        async for message in self.requests:
            if message.WhichOneof("kind") != "start":
                raise EnvError("a Play call starts with `start`")
            self.reader = asyncio.ensure_future(self._read())
            return message.start
        raise EnvError("a Play call starts with `start`; it sent nothing")

    async def _read(self) -> None:
        try:
            async for message in self.requests:
                if message.WhichOneof("kind") == "response":
                    future = self.waiting.pop(message.response.id, None)
                    if future is not None and not future.done():
                        future.set_result(message.response)
        except Exception:  # noqa: S110  (the call was aborted or went away: ended below)
            pass
        finally:  # rollout is gone: the env's pending calls fail
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(PlayAborted("rollout ended the Play call"))
            self.waiting.clear()

    async def request(self, method: str, path: str, body: bytes) -> ModelReply:
        self.next_id += 1
        future: asyncio.Future[pb.ModelResponse] = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = future
        message = pb.ModelRequest(id=self.next_id, method=method, path=path, body=body)
        await self.outbox.put(pb.PlayDown(request=message))
        response = await future
        return ModelReply(response.status, response.content_type, response.body)

    async def down(self, play: asyncio.Future):
        """The messages to send: model requests as they come, then the result."""
        while True:
            getter = asyncio.ensure_future(self.outbox.get())
            done, _ = await asyncio.wait({getter, play}, return_when=FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
                continue
            getter.cancel()
            while not self.outbox.empty():  # never happens in order, but lose nothing
                yield self.outbox.get_nowait()
            yield pb.PlayDown(result=step_pb(play.result()))
            return

    def stop(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
