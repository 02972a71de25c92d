"""Shared plumbing of the `treadle bench` workloads: a server process next to the client,
real Treadle service processes, and identity (de)serializers for the raw-bytes baselines."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx

from treadle_cli.infra import Infra, free_port_range, terminate
from treadle_cli.settings import CliSettings
from treadle_common.auth.policy import Role, TokenTable
from treadle_common.config.settings import Settings


def identity(data: bytes) -> bytes:
    return data


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server_process(
    module: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """`python -m module args...` (with `env` added to this environment), once it printed
    `ready`; terminated on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", (
            f"{module} did not start"
        )
        yield proc
    finally:
        proc.terminate()
        proc.wait()


async def serve(server: grpc.aio.Server, port: int) -> None:
    """Listen on 127.0.0.1:port, say `ready`, serve until terminated."""
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def start_service(
    module: str,
    env: dict[str, str],
    http_port: int,
    *,
    log: Path | None = None,
    ready_path: str = "/readyz",
    timeout_s: float = 120.0,
    ranks: int = 1,
) -> subprocess.Popen:
    """`python -m module` with `env` added (under `torchrun` with `ranks` > 1); returns once
    `ready_path` answers 200."""
    launch = [sys.executable, "-m", module]
    if ranks > 1:
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        launch = [sys.executable, *torchrun, "-m", module]
    output = open(log, "wb") if log else contextlib.nullcontext(subprocess.DEVNULL)
    with output as out:  # the child keeps its own copy of the file
        proc = subprocess.Popen(
            launch,
            env={**os.environ, **env, "TREADLE_HTTP_PORT": str(http_port)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                detail = log.read_text()[-2000:] if log else ""
                raise RuntimeError(f"{module} exited with {proc.returncode}\n{detail}")
            try:
                url = f"http://127.0.0.1:{http_port}{ready_path}"
                if httpx.get(url, timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{module} did not answer {ready_path} in {timeout_s}s")
    except BaseException:  # not ready, or interrupted while it started: it stops
        terminate(proc.pid)
        raise


def private_stack(tmp: Path) -> CliSettings:
    """Settings of a `treadle up` stack of the bench's own under `tmp`: its own state dir, a
    redis and a nats of its own and free service ports (never a stack the user runs)."""
    return CliSettings(
        state_dir=tmp / "state",
        redis_url=f"redis://127.0.0.1:{free_port_range(1)}",
        nats_url=f"nats://127.0.0.1:{free_port_range(1)}",
        base_port=free_port_range(8),
    )


@contextlib.contextmanager
def bench_auth() -> Iterator[None]:
    """Auth on, as deployed: a fresh token table for the services this bench starts
    (`TREADLE_AUTH_TOKENS`, inherited by children) and its admin token for the bench's own
    clients (`TREADLE_TOKEN`); the caller's environment is restored after."""
    table = TokenTable.generate()
    saved = {k: os.environ.get(k) for k in ("TREADLE_AUTH_TOKENS", "TREADLE_TOKEN")}
    os.environ["TREADLE_AUTH_TOKENS"] = json.dumps(table)
    os.environ["TREADLE_TOKEN"] = table[Role.admin]
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def infra_with_weight_store(tmp: Path) -> Iterator[tuple[Infra, dict[str, str], list]]:
    """Private redis + nats and a weight-store process; yields (the infra, whose `url_for`
    gives a service its own NATS and Redis user; the TREADLE_* env every further service
    needs, with the admin's NATS user and no Redis URL; the list of processes to add yours
    to: all stopped on exit)."""
    settings = Settings(
        state_dir=tmp / "infra",
        redis_url=f"redis://127.0.0.1:{free_port()}",
        nats_url=f"nats://127.0.0.1:{free_port()}",
    )
    infra = Infra(settings)
    procs: list[subprocess.Popen] = []
    with bench_auth():
        try:
            infra.up()
            ws_http, ws_grpc = free_port(), free_port()
            common = {  # Redis: a service that uses it adds its own user's URL
                "TREADLE_NATS_URL": infra.url_for("nats"),
                "TREADLE_STATE_DIR": str(tmp / "state"),
                "TREADLE_LOG_LEVEL": "WARNING",
                "TREADLE_WEIGHT_STORE_ADDR": f"127.0.0.1:{ws_grpc}",
                "TREADLE_TRAINER_PATH_ROOTS": json.dumps([str(tmp.resolve())]),
            }
            procs.append(
                start_service(
                    "treadle_weight_store",
                    {
                        **common,
                        "TREADLE_GRPC_PORT": str(ws_grpc),
                        "TREADLE_NATS_URL": infra.url_for("nats", "weight-store"),
                    },
                    ws_http,
                    log=tmp / "weight-store.log",
                    ready_path="/healthz",
                )
            )
            yield infra, common, procs
        finally:
            for proc in reversed(procs):
                terminate(proc.pid, timeout_s=20)
            infra.down()
