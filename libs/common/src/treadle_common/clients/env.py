"""Env-gateway client (gRPC `treadle.v1.EnvGateway`), used by rollout."""

from __future__ import annotations

import json
from typing import Any

import grpc

from treadle_common import tracing
from treadle_common.proto.treadle.v1 import env_pb2 as pb
from treadle_common.proto.treadle.v1 import env_pb2_grpc


class EnvClient:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = env_pb2_grpc.EnvGatewayStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def list_envs(self) -> list[str]:
        return list((await self.stub.ListEnvs(pb.ListEnvsRequest())).envs)

    async def create(
        self, env: str, task: dict[str, Any], seed: int = 0, options: dict[str, Any] | None = None
    ) -> pb.Session:
        request = pb.CreateSessionRequest(
            env=env, task_json=json.dumps(task), seed=seed, options_json=json.dumps(options or {})
        )
        return await self.stub.CreateSession(request, timeout=30, metadata=tracing.grpc_metadata())

    async def step(
        self, session_id: str, text: str = "", tool_calls: list[pb.ToolCall] | None = None
    ) -> pb.StepResponse:
        action = pb.Action(text=text, tool_calls=tool_calls or [])
        request = pb.StepRequest(session_id=session_id, action=action)
        return await self.stub.Step(request, timeout=120, metadata=tracing.grpc_metadata())

    async def close_session(self, session_id: str) -> None:
        await self.stub.CloseSession(
            pb.CloseSessionRequest(session_id=session_id),
            timeout=10,
            metadata=tracing.grpc_metadata(),
        )

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
