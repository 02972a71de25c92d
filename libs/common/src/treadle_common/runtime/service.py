"""The standard service lifecycle every Treadle service runs under.

    runtime = ServiceRuntime("reward", settings)
    runtime.add_check("nats", runtime.nats_check)      # ready only when dependencies answer
    runtime.on_drain(worker.drain)                     # SIGTERM: stop intake, finish, exit
    await runtime.serve(worker.run())                  # HTTP (+ gRPC) + heartbeats + main loop

Every service gets `/healthz` (process alive), `/readyz` (every dependency answers; 503 with
the reason otherwise), `/metrics` (Prometheus) and `/v1/info`, a heartbeat every few seconds
into the NATS KV bucket `treadle_heartbeats`, and `grpc.health.v1` on its gRPC server.

Every other endpoint is checked against the caller's bearer token (`treadle_common.auth.policy`):
HTTP routes by one app-wide dependency that reads each route's declared roles, gRPC methods
by one interceptor over the policy the service passes to `make_grpc_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import nats
import redis.asyncio as aioredis
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from treadle_common import __version__, names
from treadle_common.api.ops import Liveness, Readiness, ServiceInfo
from treadle_common.auth import infra as infra_auth
from treadle_common.auth import policy as auth
from treadle_common.auth import tls
from treadle_common.auth.infra import redact
from treadle_common.auth.interceptor import ServerAuth
from treadle_common.auth.middleware import IDENTITY, Authenticate, declared_roles
from treadle_common.config.settings import Settings
from treadle_common.runtime import errors, grpc_options, metrics, tracing
from treadle_common.runtime.body_limit import BodyLimit
from treadle_common.runtime.logs import configure_logging, get_logger
from treadle_common.runtime.progress import Progress

log = get_logger(__name__)
Check = Callable[[], Awaitable[None]]


class PortInUseError(OSError):
    def __init__(self, service: str, kind: str, host: str, port: int):
        super().__init__(f"{service}: {kind} port {host}:{port} is already in use")


def bind_socket(service: str, kind: str, host: str, port: int) -> socket.socket:
    """The listening socket, created as `IPPROTO_TCP` explicitly: asyncio sets TCP_NODELAY on
    an accepted connection only when its socket says so (`proto == IPPROTO_TCP`; a socket made
    with proto 0 does not). Without it, every keep-alive response after the first waited
    ~40 ms: uvicorn writes headers and body separately, and Nagle held the body until the
    client's delayed ACK of the headers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUseError(service, kind, host, port) from exc
    return sock


class AuthConfigError(ValueError):
    """Auth is on and its token table is missing or malformed: the service does not start."""


_NO_FASTAPI_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)
"""FastAPI's own OpenTelemetry (0.165 and later: a span and metrics for every HTTP request,
on by itself once a tracer provider is set, as `tracing.setup` does) is off: Treadle traces
tasks across hops (`tracing`) and counts requests in Prometheus (`metrics`). Its wrapper
around every send cost rollout's streamed OpenAI responses about 0.3 ms of the event loop
per request. Older FastAPI (vLLM's venv pins one) has none to turn off."""

_BEARER = HTTPBearer(auto_error=False, description="A Treadle token (`TREADLE_TOKEN`)")


async def _invalid_request(_request: Request, exc: Exception) -> JSONResponse:
    """422 naming each invalid field: where, what and why, without echoing the input back
    (it may be large, or hold values JSON cannot carry, such as NaN)."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors]
    return JSONResponse({"detail": detail}, status_code=422)


async def _refused(_request: Request, exc: Exception) -> JSONResponse:
    """An `auth.AuthError` raised below a route (e.g. another tenant's resource): its status
    and message."""
    assert isinstance(exc, auth.AuthError)
    return JSONResponse({"detail": exc.message}, status_code=exc.status)


class SignalFreeUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the runtime owns SIGTERM/SIGINT (also for an
    endpoint a service serves besides its own, e.g. the env-gateway's loopback policy)."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


try:  # redis-py 7+: DriverInfo; before: lib_name/lib_version (None: nothing sent)
    from redis.driver_info import DriverInfo  # noqa: F401

    _NO_CLIENT_INFO: dict[str, Any] = {"driver_info": None}
except ImportError:
    _NO_CLIENT_INFO = {"lib_name": None, "lib_version": None}
try:  # and no maintenance-notification handshake (CLIENT MAINT_NOTIFICATIONS, RESP3)
    from redis.maint_notifications import MaintNotificationsConfig

    _NO_CLIENT_INFO["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
except ImportError:
    pass


class ServiceRuntime:
    def __init__(self, service: str, settings: Settings, *, uses_redis: bool = False):
        self.service = service
        self.settings = settings
        self.started_at = time.time()
        self.draining = False
        self.stop_event = asyncio.Event()
        try:
            self.authorizer = auth.Authorizer(settings.token_table())
        except ValueError as exc:
            raise AuthConfigError(f"{service}: {exc}") from None
        try:
            self.tls = tls.server_tls(settings.tls_cert_file, settings.tls_key_file)
            if uses_redis:
                settings.refuse_redis_without_credentials()
        except ValueError as exc:
            raise AuthConfigError(f"{service}: {exc}") from None
        self.app = self._make_app()
        self._redis: aioredis.Redis | None = (
            # no CLIENT SETINFO on connect: a service's ACL user may not run CLIENT
            aioredis.from_url(settings.redis_url, socket_timeout=10, **_NO_CLIENT_INFO)
            if uses_redis
            else None
        )
        self.nats: NATS | None = None
        self._nats_error = "not connected yet"
        self._nats_connected = asyncio.Event()
        self._checks: dict[str, Check] = {"nats": self.nats_check}
        if uses_redis:
            self._checks["redis"] = self.redis_check
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self._info: Callable[[], dict[str, Any]] = dict
        self._info_model: type[ServiceInfo] = ServiceInfo
        self.grpc_server: grpc.aio.Server | None = None
        self.grpc_health = health.aio.HealthServicer()
        self.progress = Progress(service, settings.stall_after_s)
        self._add_routes()
        configure_logging(service, settings.log_level, settings.log_json)
        if warning := settings.transport_warning():
            log.warning(warning)
        tracing.setup(
            service,
            settings.traces,
            settings.trace_dir or settings.state_dir / "traces",
            settings.instance,
            settings.otlp_endpoint,
            sample=settings.trace_sample,
        )

    def _make_app(self) -> FastAPI:
        """The HTTP app: every route behind the token check, errors answered in one place
        (validation 422, `auth.AuthError`, `errors.ServiceError`), bodies capped."""
        service, settings = self.service, self.settings
        app = FastAPI(
            title=f"treadle {service}",
            version=__version__,
            dependencies=[Depends(self._authorize)],
            openapi_url=None,  # served below, behind a token like every other route
            docs_url=None,
            redoc_url=None,
            **_NO_FASTAPI_TELEMETRY,
        )
        app.add_exception_handler(RequestValidationError, _invalid_request)
        app.add_exception_handler(auth.AuthError, _refused)
        app.add_exception_handler(errors.ServiceError, errors.http_response)
        app.add_middleware(
            BodyLimit,
            max_bytes=int(settings.max_body_mb * 1024 * 1024),
            on_refuse=metrics.DROPPED.labels(service, "request", "body_too_large").inc,
        )
        app.add_middleware(  # outermost: a stranger's body is never read
            Authenticate,
            routes=lambda: app.routes,
            identify=self._identify,
            on_refuse=lambda status: auth.REFUSED.labels(service, "http", str(status)).inc(),
        )
        return app

    # -- configuration ---------------------------------------------------------------------
    def add_check(self, name: str, check: Check) -> None:
        self._checks[name] = check

    def on_drain(self, hook: Callable[[], Awaitable[None]]) -> None:
        self._drain_hooks.append(hook)

    def set_info(
        self, info: Callable[[], dict[str, Any]], model: type[ServiceInfo] = ServiceInfo
    ) -> None:
        """The service's own `/v1/info` fields; `model` (a `ServiceInfo`) is their shape."""
        self._info, self._info_model = info, model

    def make_grpc_server(self, policy: auth.GrpcPolicy) -> grpc.aio.Server:
        """The service's gRPC server; `policy` names who may call each of its methods."""
        interceptor = ServerAuth(self.service, self.authorizer, policy)
        self.grpc_server = grpc.aio.server(
            options=grpc_options.SERVER_OPTIONS, interceptors=[interceptor]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.grpc_health, self.grpc_server)
        return self.grpc_server

    @property
    def redis(self) -> aioredis.Redis:
        """The service's Redis client (a service built with `uses_redis`)."""
        if self._redis is None:
            raise RuntimeError(f"{self.service} was built without Redis (uses_redis=False)")
        return self._redis

    # -- dependency checks -----------------------------------------------------------------
    async def redis_check(self) -> None:
        await self.redis.ping()

    async def nats_check(self) -> None:
        if self.nats is None or not self.nats.is_connected:
            raise ConnectionError(f"NATS {redact(self.settings.nats_url)}: {self._nats_error}")

    async def readiness(self) -> dict[str, str]:
        async def run(check: Check) -> str:
            try:
                await asyncio.wait_for(check(), timeout=2.0)
                return "ok"
            except Exception as exc:  # a readiness probe reports every failure as text
                return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

        results = await asyncio.gather(*(run(c) for c in self._checks.values()))
        return dict(zip(self._checks, results, strict=True))

    async def wait_nats(self) -> NATS:
        await self._nats_connected.wait()
        assert self.nats is not None
        return self.nats

    # -- HTTP routes -------------------------------------------------------------------------
    def _identify(self, token: str | None, declared: list[str] | None, what: str) -> auth.Identity:
        return self.authorizer.identify(token, auth.parse_roles(declared), what)

    async def _authorize(
        self,
        request: Request,
        _credentials: HTTPAuthorizationCredentials | None = Depends(_BEARER),  # OpenAPI's
    ) -> None:
        """Every route: the caller the `Authenticate` middleware found (it checked the token
        against the route's `x-treadle-roles` before the body was read), as `request.state`;
        a request that reached a route without it is refused."""
        who = request.scope.get("state", {}).get(IDENTITY)
        if who is None:
            route = request.scope.get("route")
            if declared_roles(route) != [auth.PUBLIC]:
                raise HTTPException(403, "this request passed no authentication; refused")
            who = auth.ANONYMOUS
        request.state.role, request.state.identity = who.role, who
        auth.CALLER.set(who)

    def _add_routes(self) -> None:
        app = self.app

        @app.get(
            "/healthz",
            tags=["ops"],
            openapi_extra=auth.public(),
            response_model=Liveness,
            responses={503: {"model": Liveness}},
        )
        async def healthz() -> JSONResponse:
            """Alive and making progress: 503 naming the wedged stages otherwise."""
            wedged = self.progress.wedged(self.settings.liveness_stall_s)
            if wedged:
                body = Liveness(status="stalled", service=self.service, stages=list(wedged))
                return JSONResponse(body.model_dump(), status_code=503)
            return JSONResponse(Liveness(status="ok", service=self.service).model_dump())

        @app.get(
            "/readyz",
            tags=["ops"],
            openapi_extra=auth.public(),
            response_model=Readiness,
            responses={503: {"model": Readiness}},
        )
        async def readyz() -> JSONResponse:
            checks = await self.readiness()
            ready = not self.draining and all(v == "ok" for v in checks.values())
            metrics.READY.labels(self.service).set(1 if ready else 0)
            body = Readiness(ready=ready, draining=self.draining, checks=checks)
            return JSONResponse(body.model_dump(), status_code=200 if ready else 503)

        @app.get("/openapi.json", include_in_schema=False, openapi_extra=auth.roles(auth.ANY))
        async def openapi() -> JSONResponse:
            """The service's OpenAPI document (each route's roles in `x-treadle-roles`)."""
            return JSONResponse(app.openapi())

        @app.get(
            "/metrics",
            tags=["ops"],
            openapi_extra=auth.roles(auth.ANY),
            response_class=PlainTextResponse,
        )
        async def prometheus() -> Response:
            """Prometheus' text exposition format."""
            body, content_type = metrics.render()
            return Response(body, media_type=content_type)

    def _add_info_route(self) -> None:
        """`/v1/info`, in the shape the service declared (`set_info`, before it starts)."""
        app = self.app

        @app.get(
            "/v1/info",
            tags=["ops"],
            openapi_extra=auth.roles(auth.ANY),
            response_model=self._info_model,
        )
        async def info() -> ServiceInfo:
            return self._info_model(
                service=self.service,
                version=__version__,
                instance=self.settings.instance,
                uptime_s=round(time.time() - self.started_at, 3),
                progress=self.progress.snapshot(),
                **self._info(),
            )

    # -- background tasks --------------------------------------------------------------------
    async def _on_nats_error(self, exc: Exception) -> None:
        """nats-py's connection errors (a server restarting): one line, no traceback; the
        client reconnects by itself and /readyz says NATS is down meanwhile."""
        self._nats_error = f"{type(exc).__name__}: {exc}"
        log.warning("nats error", error=self._nats_error)

    async def _on_nats_disconnected(self) -> None:
        self._nats_error = "disconnected; reconnecting"
        if not self.stop_event.is_set():  # not our own drain at shutdown
            log.warning("nats disconnected; reconnecting")

    async def _on_nats_reconnected(self) -> None:
        log.info("nats reconnected")

    async def _connect_nats(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.nats = await nats.connect(
                    self.settings.nats_url,
                    name=f"{self.service}-{self.settings.instance}",
                    inbox_prefix=infra_auth.inbox_prefix_of(self.settings.nats_url),
                    connect_timeout=2,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    allow_reconnect=True,
                    error_cb=self._on_nats_error,
                    disconnected_cb=self._on_nats_disconnected,
                    reconnected_cb=self._on_nats_reconnected,
                    tls=tls.client_context(),
                )
                self._nats_connected.set()
                return
            except Exception as exc:  # keep trying; /readyz reports the last error
                self._nats_error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(1.0)

    async def _heartbeat(self) -> None:
        kv: KeyValue | None = None
        key = f"{self.service}.{self.settings.instance}".replace(":", "_")
        while not self.stop_event.is_set():
            try:
                nc = await self.wait_nats()
                if kv is None:
                    kv = await nc.jetstream().create_key_value(
                        bucket=names.HEARTBEAT_BUCKET, ttl=30
                    )
                beat = {"service": self.service, "ts": time.time(), "draining": self.draining}
                await kv.put(key, json.dumps(beat).encode())
            except Exception as exc:
                log.warning("heartbeat failed", error=str(exc))
                kv = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), self.settings.heartbeat_interval_s)

    # -- run ---------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)

    async def serve(self, *mains: Awaitable[None]) -> None:
        """Serve HTTP (+gRPC), heartbeat, run `mains`; on SIGTERM drain and return."""
        host = self.settings.host
        http_port = self.settings.port(self.service, "http")
        http_sock = bind_socket(self.service, "http", host, http_port)
        if self.grpc_server is not None:
            grpc_port = self.settings.port(self.service, "grpc")
            address = f"{host}:{grpc_port}"
            bound = (
                self.grpc_server.add_secure_port(address, self.tls.grpc_credentials())
                if self.tls is not None
                else self.grpc_server.add_insecure_port(address)
            )
            if bound == 0:
                raise PortInUseError(self.service, "grpc", host, grpc_port)
            await self.grpc_server.start()
            await self.grpc_health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._add_info_route()
        self._install_signals()
        # what startup made (modules, models, servers) lives as long as the process: moved out
        # of the collector's reach, so a full collection does not stop the event loop to scan
        # the hundreds of thousands of objects torch, transformers and grpc bring
        gc.collect()
        gc.freeze()
        server = SignalFreeUvicorn(
            uvicorn.Config(
                self.app,
                log_level="warning",
                lifespan="off",
                timeout_keep_alive=names.HTTP_KEEPALIVE_S,
                ssl_certfile=self.tls.cert_file if self.tls is not None else None,
                ssl_keyfile=self.tls.key_file if self.tls is not None else None,
            )
        )
        tasks = [
            asyncio.create_task(server.serve(sockets=[http_sock]), name="http"),
            asyncio.create_task(self._connect_nats(), name="nats-connect"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self.progress.watch(self.stop_event), name="stall-detector"),
            *(asyncio.create_task(self._run_main(m), name="main") for m in mains),
        ]
        log.info(
            "service started",
            http=http_port,
            grpc=self.settings.grpc_port,
            tls=self.tls is not None,
        )
        stopper = asyncio.create_task(self.stop_event.wait())
        mains_tasks = [t for t in tasks if t.get_name() == "main"]
        done, _ = await asyncio.wait([stopper, *mains_tasks], return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in done if t is not stopper and t.exception() is not None]
        await self._shutdown(server, tasks)
        if failed:
            raise failed[0].exception()  # type: ignore[misc]

    async def _shutdown(self, server: SignalFreeUvicorn, tasks: list[asyncio.Task]) -> None:
        log.info("draining")
        self.draining = True
        self.stop_event.set()
        if self.grpc_server is not None:
            await self.grpc_health.enter_graceful_shutdown()
        for hook in self._drain_hooks:
            try:
                await asyncio.wait_for(hook(), self.settings.drain_timeout_s)
            except Exception as exc:
                log.error("drain hook failed", error=repr(exc))
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=2.0)
        server.should_exit = True
        for task in tasks:
            if task.get_name() != "http":
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.nats is not None:
            with contextlib.suppress(Exception):
                await self.nats.drain()
        if self._redis is not None:
            await self._redis.aclose()
        await asyncio.to_thread(tracing.flush)
        log.info("stopped")

    async def _run_main(self, main: Awaitable[None]) -> None:
        """A main that returns normally leaves the service serving until SIGTERM."""
        await main
        await self.stop_event.wait()


@dataclass
class Service:
    """What every service's `app.build(settings)` returns: its runtime (HTTP and gRPC
    servers, health, NATS, Redis, heartbeats) and the loops it runs beside serving."""

    runtime: ServiceRuntime
    loops: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Started once the servers listen; a loop that returns ends nothing."""
    on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Run after the service drained and stopped (release engines, clients)."""

    async def serve(self) -> None:
        """Serve until SIGTERM (drained), then close."""
        try:
            await self.runtime.serve(*(loop() for loop in self.loops))
        finally:
            for close in self.on_close:
                await close()


def run_service(
    app_module: str,
    settings_class: type[Settings],
    prepare: Callable[[Any], None] | None = None,
) -> None:
    """Entry point of every service's `__main__`: its settings (from the environment) first,
    heavy imports after; then `await app_module.build(settings)` serves until SIGTERM.
    `prepare(settings)` runs between the two (rollout starts its engine process there).
    `kill -USR1 <pid>` makes a service write every thread's stack to its log (a stuck one
    says where it is stuck), and go on."""
    import faulthandler
    import importlib

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    settings = settings_class()
    if prepare is not None:
        prepare(settings)
    app = importlib.import_module(app_module)

    async def main() -> None:
        service: Service = await app.build(settings)
        await service.serve()

    try:
        asyncio.run(main())
    except (PortInUseError, AuthConfigError) as exc:
        raise SystemExit(f"error: {exc}") from exc
