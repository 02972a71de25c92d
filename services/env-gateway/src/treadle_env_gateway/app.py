"""Env-gateway service: sessions over gRPC (rollout's data plane) and HTTP (people, tools).

rollout --CreateSession/Step/CloseSession (gRPC)--> EnvGatewayServicer --> SessionManager
trainer --SampleTasks (gRPC)----------------------> Env.sample_tasks (the env's dataset)
people  --/v1/envs, /v1/sessions (HTTP)-----------> SessionManager
"""

from __future__ import annotations

import asyncio

from treadle_common.proto.treadle.v1 import env_pb2_grpc
from treadle_common.runtime.service import Service, ServiceRuntime
from treadle_env_gateway import http
from treadle_env_gateway.grpc import POLICY, EnvGatewayServicer
from treadle_env_gateway.sandbox import reaping
from treadle_env_gateway.sessions import SERVICE, SessionManager
from treadle_env_gateway.settings import EnvGatewaySettings


async def build(settings: EnvGatewaySettings) -> Service:
    reaping.become_subreaper()  # what its sandboxes leave behind is the gateway's to reap
    runtime = ServiceRuntime(SERVICE, settings)
    modules = tuple(m.strip() for m in settings.env_modules.split(",") if m.strip())
    sessions = SessionManager(
        replica=settings.instance,
        max_sessions=settings.env_max_sessions,
        idle_ttl_s=settings.env_idle_ttl_s,
        env_modules=modules,
        settings=settings,
    )
    env_pb2_grpc.add_EnvGatewayServicer_to_server(
        EnvGatewayServicer(sessions, runtime.progress.stage("step", liveness=True)),
        runtime.make_grpc_server(POLICY),
    )
    runtime.set_info(lambda: {"envs": sorted(sessions.envs), "sessions": len(sessions.sessions)})
    runtime.app.state.sessions = sessions
    runtime.app.include_router(http.router)
    return Service(
        runtime, loops=[lambda: expire_loop(runtime, sessions)], on_close=[sessions.shutdown]
    )


async def expire_loop(runtime: ServiceRuntime, sessions: SessionManager) -> None:
    while not runtime.stop_event.is_set():
        await asyncio.sleep(min(5.0, sessions.idle_ttl_s / 2))
        await sessions.expire_idle()
