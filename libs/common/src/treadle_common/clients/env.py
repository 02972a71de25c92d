"""Env-gateway client (gRPC `treadle.v1.EnvGateway`), used by rollout.

With `batch=True` the per-episode calls (`create`, `step`, `close_session`) made in the same
event-loop turn travel together: the creates of one group as one `CreateSessions`, the steps
as one `StepMany` (each result is handed back as soon as it streams in, so a slow step holds
up only its own episode), the closes as one `CloseSessions`. The episodes of a group start
together and their generations often finish in the same engine step, so a group's hops cost
about one call each instead of one per episode. Callers see the same API either way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import grpc

from treadle_common.clients.coalesce import Coalescer, Pending
from treadle_common.proto.treadle.v1 import env_pb2 as pb
from treadle_common.proto.treadle.v1 import env_pb2_grpc
from treadle_common.runtime import grpc_options, tracing


class EnvRequestError(RuntimeError):
    """The gateway refused one step of a `StepMany` (unknown session, malformed action...)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class EnvClient:
    def __init__(self, address: str, batch: bool = False, token: str | None = None):
        """`batch`: a group's hops go in one call each; `token`: the bearer token it presents
        (default `TREADLE_TOKEN`)."""
        self.address = address
        self.batch = batch
        self.channel = grpc_options.channel(address, token)
        self.stub = env_pb2_grpc.EnvGatewayStub(self.channel)
        self._creates: Coalescer[int, pb.Session] = Coalescer(self._send_creates)
        self._steps: Coalescer[pb.StepRequest, pb.StepResponse] = Coalescer(self._send_steps)
        self._closes: Coalescer[str, None] = Coalescer(self._send_closes)

    async def close(self) -> None:
        await self.channel.close()

    async def list_envs(self) -> list[str]:
        return list((await self.stub.ListEnvs(pb.ListEnvsRequest())).envs)

    async def create(
        self, env: str, task: dict[str, Any], seed: int = 0, options: dict[str, Any] | None = None
    ) -> pb.Session:
        task_json, options_json = json.dumps(task), json.dumps(options or {})
        if self.batch:  # one call per group: same task, same trace (the task's)
            trace_id = tracing.current_trace_id()
            return await self._creates.submit((env, task_json, options_json, trace_id), seed)
        request = pb.CreateSessionRequest(
            env=env, task_json=task_json, seed=seed, options_json=options_json
        )
        return await self.stub.CreateSession(request, timeout=30, metadata=tracing.grpc_metadata())

    async def create_many(
        self, env: str, task_json: str, seeds: list[int], options_json: str
    ) -> list[pb.Session]:
        """The sessions of one group, one per seed, in one call (all or none)."""
        request = pb.CreateSessionsRequest(
            env=env, task_json=task_json, seeds=seeds, options_json=options_json
        )
        response = await self.stub.CreateSessions(
            request, timeout=60, metadata=tracing.grpc_metadata()
        )
        return list(response.sessions)

    async def step(
        self,
        session_id: str,
        text: str = "",
        tool_calls: list[pb.ToolCall] | None = None,
        close_when_done: bool = False,
    ) -> pb.StepResponse:
        """One step; `close_when_done`: the gateway closes the session if the step ends it."""
        action = pb.Action(text=text, tool_calls=tool_calls or [])
        request = pb.StepRequest(
            session_id=session_id, action=action, close_when_done=close_when_done
        )
        if self.batch:  # each step of the batch keeps its episode's trace
            tracing.inject_proto(request.trace)
            return await self._steps.submit(None, request)
        return await self.stub.Step(request, timeout=120, metadata=tracing.grpc_metadata())

    async def close_session(self, session_id: str) -> None:
        if self.batch:
            return await self._closes.submit(None, session_id)
        await self.stub.CloseSession(
            pb.CloseSessionRequest(session_id=session_id),
            timeout=10,
            metadata=tracing.grpc_metadata(),
        )

    async def play(
        self,
        session_id: str,
        model: str,
        sampling: dict[str, Any],
        answer: Callable[[pb.ModelRequest], Awaitable[pb.ModelResponse]],
        timeout_s: float = 1800.0,
    ) -> pb.StepResponse:
        """Play a played session (`Session.played`): every model call the env makes is
        answered by `answer` (concurrently, each as soon as it is ready); returns the env's
        result. The gateway closes the session when the call ends; an episode still playing
        after `timeout_s` ends with `DEADLINE_EXCEEDED`."""
        call = self.stub.Play(timeout=timeout_s, metadata=tracing.grpc_metadata())
        start = pb.PlayStart(session_id=session_id, model=model, sampling_json=json.dumps(sampling))
        tracing.inject_proto(start.trace)
        writing = asyncio.Lock()
        running: set[asyncio.Task] = set()

        async def serve(request: pb.ModelRequest) -> None:
            try:
                response = await answer(request)
            except Exception as exc:  # the env's call gets an answer whatever happened here
                error = {
                    "error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error"}
                }
                response = pb.ModelResponse(
                    status=500, content_type="application/json", body=json.dumps(error).encode()
                )
            response.id = request.id
            async with writing:
                await call.write(pb.PlayUp(response=response))

        try:
            async with writing:
                await call.write(pb.PlayUp(start=start))
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    await call  # the gateway's status, raised as an AioRpcError if it failed
                    raise EnvRequestError("UNAVAILABLE", "the gateway ended Play without a result")
                if message.WhichOneof("kind") == "request":
                    task = asyncio.ensure_future(serve(message.request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                else:
                    return message.result
        finally:
            for task in list(running):
                task.cancel()
            call.cancel()

    # -- the batches ------------------------------------------------------------------------
    async def _send_creates(self, key: Hashable, items: Pending) -> None:
        assert isinstance(key, tuple)
        env, task_json, options_json = (str(part) for part in key[:3])
        sessions = await self.create_many(env, task_json, [s for s, _ in items], options_json)
        for (_, future), session in zip(items, sessions, strict=True):
            if not future.done():
                future.set_result(session)

    async def _send_steps(self, _key: Hashable, items: Pending) -> None:
        request = pb.StepManyRequest(steps=[step for step, _ in items])
        call = self.stub.StepMany(request, timeout=120, metadata=tracing.grpc_metadata())
        async for results in call:
            for item in results.items:
                future = items[item.index][1]
                if future.done():
                    continue
                if item.result.status == "request_error":
                    future.set_exception(EnvRequestError(item.code, item.result.error))
                else:
                    future.set_result(item.result)

    async def _send_closes(self, _key: Hashable, items: Pending) -> None:
        await self.stub.CloseSessions(
            pb.CloseSessionsRequest(session_ids=[s for s, _ in items]),
            timeout=10,
            metadata=tracing.grpc_metadata(),
        )
        for _, future in items:
            if not future.done():
                future.set_result(None)

    async def sample_tasks(
        self, env: str, num_tasks: int, seed: int, split: str = "train", options: dict | None = None
    ) -> list[dict[str, Any]]:
        request = pb.SampleTasksRequest(
            env=env,
            num_tasks=num_tasks,
            seed=seed,
            split=split,
            options_json=json.dumps(options or {}),
        )
        response = await self.stub.SampleTasks(request, timeout=60)
        return [json.loads(t) for t in response.tasks_json]
