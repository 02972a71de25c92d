"""Every endpoint of every service refuses a missing token, a wrong token and a role its
policy does not name; and lets a role it names through.

Routes come from each service's own OpenAPI document and gRPC methods from the service
descriptors of every `treadle.v1` proto, so a new route or method without a policy fails here
(the runtime refuses it too: fail closed).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import socket
import urllib.parse

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2

from tests.support.services import ADMIN, TOKENS, start_service
from treadle_common.auth import policy as auth
from treadle_common.proto.treadle import v1 as proto_v1

pytestmark = pytest.mark.integration

WRONG = "not-a-token-of-this-stack-0000000000"
GRPC_POLICIES = {
    "weight-store": "treadle_weight_store.grpc",
    "env-gateway": "treadle_env_gateway.grpc",
    "rollout": "treadle_rollout.grpc",
}


@pytest.fixture(scope="module")
def stack(infra, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    store = start_service("weight-store", infra, tmp, TREADLE_WEIGHT_STORE_DIR=str(tmp / "ws"))
    gateway = start_service("env-gateway", infra, tmp)
    addrs = {
        "TREADLE_WEIGHT_STORE_ADDR": store.grpc_addr or "",
        "TREADLE_ENV_GATEWAY_ADDR": gateway.grpc_addr or "",
    }
    reward = start_service("reward", infra, tmp)
    rollout = start_service("rollout", infra, tmp, TREADLE_ROLLOUT_MODEL=str(tiny_model), **addrs)
    trainer = start_service("trainer", infra, tmp, **addrs)
    procs = {
        "weight-store": store,
        "env-gateway": gateway,
        "reward": reward,
        "rollout": rollout,
        "trainer": trainer,
    }
    yield procs
    for proc in reversed(procs.values()):
        proc.stop_checked()


def operations(base_url: str) -> list[tuple[str, str, list[str] | None, str | None]]:
    """(method, path, the roles it takes, the format of its refusals) of every route."""
    spec = httpx.get(f"{base_url}/openapi.json", headers=ADMIN, timeout=10).json()
    found = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            found.append((method.upper(), path, op.get(auth.ROLES_KEY), op.get(auth.ERRORS_KEY)))
    return found


def refusal_message(answer: httpx.Response, errors: str | None) -> str:
    """A refusal's message, from the body in the route's declared format."""
    if errors == "openai":  # OpenAI's error shape, what its clients parse
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"], error
        return error["message"]
    return answer.json()["detail"]


@pytest.mark.parametrize("service", ["weight-store", "env-gateway", "reward", "rollout", "trainer"])
def test_every_http_route_checks_token_and_role(stack, service):
    base = stack[service].http
    ops = operations(base)
    assert len(ops) >= 4, ops
    undeclared = [f"{m} {p}" for m, p, roles, _ in ops if not roles]
    assert not undeclared, f"routes without an access policy: {undeclared}"
    with httpx.Client(base_url=base, timeout=30) as http:
        for method, path, declared, errors in ops:
            url = re.sub(r"\{[^}]+\}", "x", path)
            what = f"{service} {method} {path}"
            if declared == [auth.PUBLIC]:
                assert path in ("/healthz", "/readyz"), f"{what} is public"
                continue
            allowed = auth.parse_roles(declared)
            assert allowed is not None
            for token in (None, WRONG):
                answer = http.request(method, url, headers=auth.bearer(token))
                assert answer.status_code == 401, (what, token, answer.text)
                assert answer.headers["www-authenticate"] == "Bearer"
                assert "bearer token" in refusal_message(answer, errors), (what, answer.text)
            for role in auth.Role:
                answer = http.request(method, url, headers=auth.bearer(TOKENS[role]), json={})
                if role in allowed:
                    assert answer.status_code not in (401, 403), (what, role, answer.text)
                else:
                    assert answer.status_code == 403, (what, role, answer.text)
                    assert role.value in refusal_message(answer, errors), (what, answer.text)


@pytest.mark.parametrize("service", ["weight-store", "env-gateway", "reward", "rollout", "trainer"])
def test_a_stranger_is_refused_before_its_body_is_read(stack, service):
    """The headers of a POST (another request where a service has none) announcing a 1 MB
    body, none of which ever arrives: without a token, or with a role the route does not
    take, the answer comes at once, 401/403, never after a validator read the body."""
    url = urllib.parse.urlsplit(stack[service].http)
    ops = sorted(  # POSTs first: the routes that read a body
        (op for op in operations(stack[service].http) if op[2] != [auth.PUBLIC]),
        key=lambda op: op[0] != "POST",
    )
    closed_to_read = [op for op in ops if auth.Role.read.value not in (op[2] or [])]
    cases = [(ops[0], None, 401)] + [(op, TOKENS["read"], 403) for op in closed_to_read[:1]]
    for (method, path, *_), token, status in cases:
        path = re.sub(r"\{[^}]+\}", "x", path)
        with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
            auth_line = f"Authorization: Bearer {token}\r\n" if token else ""
            conn.sendall(
                f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"{auth_line}Content-Length: 1000000\r\n\r\n".encode()
            )
            answer = conn.recv(65536).decode(errors="replace")  # times out if it waits for a body
        assert answer.startswith(f"HTTP/1.1 {status}"), (service, path, answer[:300])


def test_docs_and_openapi_need_a_token(stack):
    base = stack["reward"].http
    assert httpx.get(f"{base}/openapi.json").status_code == 401
    assert httpx.get(f"{base}/docs").status_code == 404
    assert httpx.get(f"{base}/healthz").status_code == 200
    assert httpx.get(f"{base}/readyz").status_code == 200


def proto_services() -> dict[str, list]:
    """Every service of every `treadle.v1` proto: full name -> its method descriptors."""
    found = {}
    for module in pkgutil.iter_modules(proto_v1.__path__):
        if module.name.endswith("_pb2"):
            pb2 = importlib.import_module(f"{proto_v1.__name__}.{module.name}")
            for svc in pb2.DESCRIPTOR.services_by_name.values():
                found[svc.full_name] = list(svc.methods)
    return found


def test_every_grpc_method_has_a_policy():
    declared = {}
    for module in GRPC_POLICIES.values():
        declared.update(importlib.import_module(module).POLICY)
    methods = {f"/{name}/{m.name}" for name, ms in proto_services().items() for m in ms}
    assert methods, "no gRPC services found"
    assert methods == set(declared), sorted(methods ^ set(declared))


async def _call(channel: grpc.aio.Channel, method, token: str | None) -> grpc.StatusCode:
    """Call `method` with an empty message (a client stream: none, since a message still
    being sent when the server refuses the call ends it as INTERNAL on the client's side);
    the status it ends with."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    kwargs = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(path, **kwargs)(iter(()), metadata=metadata, timeout=5)
            async for _ in call:
                pass
        elif method.client_streaming:
            await channel.stream_unary(path, **kwargs)(iter(()), metadata=metadata, timeout=5)
        elif method.server_streaming:
            async for _ in channel.unary_stream(path, **kwargs)(b"", metadata=metadata, timeout=5):
                pass
        else:
            await channel.unary_unary(path, **kwargs)(b"", metadata=metadata, timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", sorted(GRPC_POLICIES))
async def test_every_grpc_method_checks_token_and_role(stack, service):
    policy = importlib.import_module(GRPC_POLICIES[service]).POLICY
    names = {path.split("/")[1] for path in policy}
    methods = [m for name in names for m in proto_services()[name]]
    async with grpc.aio.insecure_channel(stack[service].grpc_addr) as channel:
        for method in methods:
            allowed = policy[f"/{method.containing_service.full_name}/{method.name}"]
            for token in (None, WRONG):
                code = await _call(channel, method, token)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (method.name, token, code)
            for role in auth.Role:
                code = await _call(channel, method, TOKENS[role])
                denied = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
                if role in allowed:
                    assert code not in denied, (method.name, role, code)
                else:
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (method.name, role, code)
        # probes stay open: no token, and the answer is SERVING
        health = await channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_service_without_tokens_refuses_to_start(infra, tmp_path, monkeypatch):
    monkeypatch.delenv("TREADLE_AUTH_TOKENS_FILE")
    with pytest.raises(RuntimeError, match="auth is on but no tokens are configured"):
        start_service("reward", infra, tmp_path)


def test_production_refuses_auth_off_and_default_secrets():
    from treadle_common.config.settings import Settings
    from treadle_weight_store.settings import WeightStoreSettings

    creds = {
        "redis_url": "redis://:pw@redis:6379",
        "nats_url": "nats://u:pw@nats:4222",
        "transport_security": "mesh",
    }
    with pytest.raises(ValueError, match="production needs TLS between services"):
        Settings(environment="production", **{**creds, "transport_security": "tls"})
    tls = {f"tls_{f}_file": f"/run/tls/{f}.pem" for f in ("cert", "key", "ca")}
    assert Settings(environment="production", **{**creds, "transport_security": "tls", **tls})
    said = Settings(environment="production", **creds).transport_warning() or ""
    assert "in clear" in said and "mesh" in said
    with pytest.raises(ValueError, match="TREADLE_AUTH=off is refused in production"):
        Settings(environment="production", auth="off", **creds)
    with pytest.raises(ValueError, match="TREADLE_REDIS_URL must carry credentials"):
        Settings(environment="production", **{**creds, "redis_url": "redis://redis:6379"})
    with pytest.raises(ValueError, match="TREADLE_NATS_URL must carry credentials"):
        Settings(environment="production", **{**creds, "nats_url": "nats://nats:4222"})
    with pytest.raises(ValueError, match="TREADLE_S3_ACCESS_KEY/SECRET_KEY must be set"):
        WeightStoreSettings(environment="production", weight_store_backend="s3", **creds)
    assert Settings(environment="production", **creds).auth == "on"
    assert WeightStoreSettings(environment="production", **creds)  # local backend: no S3


def test_a_server_holds_hashes_and_still_knows_every_caller():
    """What compose, k8s and `treadle up` give servers: each token's SHA-256, never a token;
    a presented token is hashed and found, tenants kept; a malformed hash is refused."""
    raw = {
        "admin": "admin-token-0123456789",
        "trainer": [{"token": "tenant-a-trainer-0123", "tenant": "a"}, "fleet-trainer-012345"],
    }
    hashed = auth.TokenTable.hashed(raw)
    assert "admin-token-0123456789" not in json.dumps(hashed)
    table = auth.TokenTable.parse(json.dumps(hashed), "hashed")
    assert table.role_of("admin-token-0123456789") is auth.Role.admin
    a = table.identify("tenant-a-trainer-0123")
    assert a is not None and a.role is auth.Role.trainer and a.tenant == "a"
    assert table.identify("fleet-trainer-012345").tenant == auth.DEFAULT_TENANT  # type: ignore[union-attr]
    assert table.role_of(hashed["admin"]) is None  # the hash itself is no token
    assert table.token_of(auth.Role.admin) is None  # nothing to hand out
    with pytest.raises(ValueError, match="64 lowercase hex"):
        auth.TokenTable.parse('{"admin": "sha256:abc"}', "bad")


def test_token_table_rejects_short_tokens_and_unknown_roles():
    with pytest.raises(ValueError, match="at least 16"):
        auth.TokenTable.parse('{"admin": "short"}', "test")
    with pytest.raises(ValueError, match="auth tokens from test"):
        auth.TokenTable.parse('{"root": "' + "x" * 20 + '"}', "test")
    table = auth.TokenTable.parse('{"admin": ["' + "a" * 20 + '", "' + "b" * 20 + '"]}', "t")
    assert table.role_of("b" * 20) is auth.Role.admin
    assert table.role_of("c" * 20) is None


@pytest.mark.parametrize("run_id", ["a:b", "../etc", "UPPER", "x" * 64, "-dash", "a.b"])
def test_a_hostile_run_id_is_refused_at_the_api_edge(stack, run_id):
    trainer = stack["trainer"].http
    body = {"run_id": run_id, "model": {"path": "/nonexistent", "name": "m"}}
    answer = httpx.post(f"{trainer}/v1/runs", json=body, headers=ADMIN, timeout=10)
    assert answer.status_code == 422, answer.text
    assert "run_id" in answer.text
    if "/" not in run_id:
        got = httpx.get(f"{trainer}/v1/runs/{run_id}", headers=ADMIN, timeout=10)
        assert got.status_code == 422, got.text
    assert httpx.get(f"{trainer}/v1/runs", headers=ADMIN, timeout=10).json() == []
