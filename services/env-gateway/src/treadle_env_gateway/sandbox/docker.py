"""The `docker` backend: one throwaway container per run through the Docker SDK (see
`backends.py` for what every backend guarantees)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from typing import Any

from treadle_env_gateway.sandbox import bootstrap
from treadle_env_gateway.sandbox.backends import (
    INSIDE_WORKDIR,
    LINE_LIMIT,
    SANDBOX_ENV,
    Box,
    Proc,
    Writer,
)
from treadle_env_gateway.sandbox.limits import Limits

UNPACK = (
    """\
import json, os
size = b""
while not size.endswith(b"\\n"):
    size += os.read(0, 1)
data = b""
while len(data) < int(size):
    data += os.read(0, int(size) - len(data))
for name, text in json.loads(data).items():
    with open(os.path.join("/work", os.path.basename(name)), "w") as f:
        f.write(text)
os.chdir("/work")
"""
    + bootstrap.LIMIT_AND_RUN
)
"""The container's first program: read the box's files (a length line, then JSON) from
stdin with unbuffered reads, write them into the tmpfs work dir, set the rlimits (the
engine's own `ulimits` would bind its runtime's setup too) and exec the code, which inherits
the rest of stdin."""


class _Flow:
    """What a demuxed StreamReader takes for its transport: the reader pauses it when its
    buffer passes twice its limit and resumes it once read down to the limit, so the demux
    stops reading the engine's stream (and the container blocks on its write) instead of
    buffering whatever the code writes."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()

    def pause_reading(self) -> None:
        self.open.clear()

    def resume_reading(self) -> None:
        self.open.set()


class _Container:
    """A running sandbox container, attached: the engine's multiplexed stream demuxed into
    stdout/stderr readers (each holding at most about twice `LINE_LIMIT`: `_Flow`); stdin is
    the attach socket's write half."""

    def __init__(self, backend: DockerBackend, cid: str, writer: asyncio.StreamWriter):
        self.backend, self.cid = backend, cid
        self._writer = writer
        self.stdin: Writer | None = writer
        self.stdout = asyncio.StreamReader(limit=LINE_LIMIT)
        self.stderr = asyncio.StreamReader(limit=LINE_LIMIT)
        self._flows = {id(self.stdout): _Flow(), id(self.stderr): _Flow()}
        self.stdout.set_transport(self._flows[id(self.stdout)])  # type: ignore[arg-type]
        self.stderr.set_transport(self._flows[id(self.stderr)])  # type: ignore[arg-type]
        self.returncode: int | None = None
        self.oom_killed = False
        self.setup_failed = False  # the engine refuses a container it cannot start
        self._killed = False
        self._pump: asyncio.Task | None = None

    def start_pump(self, reader: asyncio.StreamReader) -> None:
        self._pump = asyncio.create_task(self._demux(reader))

    async def _demux(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header = await reader.readexactly(8)
                kind, size = struct.unpack(">BxxxL", header)
                chunk = await reader.readexactly(size)
                stream = self.stderr if kind == 2 else self.stdout
                flow = self._flows[id(stream)]
                if self._killed and not flow.open.is_set():
                    continue  # killed: what nobody reads any more is dropped
                stream.feed_data(chunk)
                if not self._killed:
                    await flow.open.wait()  # kill() opens it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.stdout.feed_eof()
            self.stderr.feed_eof()

    def _stop_waiting(self) -> None:
        self._killed = True
        for flow in self._flows.values():
            flow.open.set()

    async def wait(self) -> int:
        if self._pump is not None:
            await asyncio.shield(self._pump)
        if self.returncode is None:
            status = await self.backend.call("wait", self.cid)
            self.returncode = int(status.get("StatusCode", -1))
            info = await self.backend.call("inspect_container", self.cid)
            self.oom_killed = bool(info["State"].get("OOMKilled"))
        return self.returncode

    async def kill(self) -> None:
        """Remove the container (killing whatever runs in it)."""
        self._stop_waiting()
        if self.returncode is None:
            with contextlib.suppress(Exception):
                info = await self.backend.call("inspect_container", self.cid)
                if not info["State"]["Running"]:
                    self.returncode = int(info["State"]["ExitCode"])
                    self.oom_killed = bool(info["State"].get("OOMKilled"))
        with contextlib.suppress(Exception):
            await self.backend.call("remove_container", self.cid, force=True)
        if self.returncode is None:
            self.returncode = 128 + signal.SIGKILL
        self._writer.close()

    def close(self) -> None:
        """The attach socket was closed by `kill`; the demux ends with it."""
        self._writer.close()


class DockerBackend:
    """One throwaway container per run through the Docker SDK: `--network none`, read-only
    root, every capability dropped, no-new-privileges, the engine's default seccomp profile,
    a cgroup capping memory, processes and CPU, the box's uid, and only a private tmpfs to
    write in. Files go in over stdin (no host path is shared, so it also works when the
    gateway itself is a container talking to the engine through its socket)."""

    name = "docker"
    LABEL = "treadle.sandbox"

    PROBE_TTL_S = 10.0
    """How long an engine check holds: runs in between do not ask the engine again."""

    def __init__(self, image: str, python: str = "python3", cpus: float = 1.0):
        self.image, self.python, self.cpus = image, python, cpus
        self._api: Any = None
        self._pulled = False
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="docker")
        self._checked: tuple[float, str | None] | None = None
        self._checking: asyncio.Future | None = None

    def unavailable(self) -> str | None:
        """The last engine check's answer (checking now, blocking, if there was none)."""
        if self._checked is None:
            self._checked = (time.monotonic(), self._probe())
        return self._checked[1]

    async def ready(self) -> str | None:
        """`unavailable()` as of at most `PROBE_TTL_S` ago; a check runs in a thread, one at
        a time, never on the event loop (each is a ping and an image lookup, or a pull)."""
        if self._checked is not None and time.monotonic() - self._checked[0] < self.PROBE_TTL_S:
            return self._checked[1]
        if self._checking is None:
            self._checking = asyncio.get_running_loop().run_in_executor(self._pool, self._probe)
        checking = self._checking
        try:
            reason = await asyncio.shield(checking)
        finally:
            if self._checking is checking:
                self._checking = None
        self._checked = (time.monotonic(), reason)
        return reason

    def _probe(self) -> str | None:
        try:
            import docker  # noqa: PLC0415 (only this backend needs the SDK)
        except ImportError:
            return "the docker backend needs the Docker SDK (pip install docker)"
        try:
            if self._api is None:
                self._api = docker.APIClient(
                    **docker.utils.kwargs_from_env(), version="auto", max_pool_size=32
                )
            self._api.ping()
        except Exception as exc:
            self._api = None
            return f"no Docker engine reachable ({type(exc).__name__}: {exc})"
        try:
            self._api.inspect_image(self.image)
        except docker.errors.ImageNotFound:
            if self._pulled:
                return f"the sandbox image {self.image!r} is not on the Docker engine"
            self._pulled = True  # one try: a registry that refuses once will again
            try:
                self._api.pull(self.image)
            except Exception as exc:
                return (
                    f"the sandbox image {self.image!r} is not on the Docker engine and "
                    f"pulling it failed ({type(exc).__name__}: {str(exc)[:200]})"
                )
        return None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, partial(getattr(self._api, method), *args, **kwargs)
        )

    @contextlib.contextmanager
    def box(self, files: dict[str, str], uid: int) -> Iterator[Box]:
        yield Box(files, uid)

    def _config(self, box: Box, limits: Limits) -> dict:
        api = self._api
        host = api.create_host_config(
            network_mode="none",
            read_only=True,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=limits.memory_bytes,
            memswap_limit=limits.memory_bytes,
            pids_limit=limits.max_processes,
            nano_cpus=int(self.cpus * 1e9),
            tmpfs={INSIDE_WORKDIR: f"size={limits.disk_bytes},mode=1777"},
            ipc_mode="private",
            init=True,  # docker-init as PID 1: the code gets signals (SIGXCPU) as anywhere
        )
        return api.create_container_config(
            self.image,
            [self.python, "-I", "-c", UNPACK, json.dumps(asdict(limits))],
            user=f"{box.uid}:{box.uid}",
            environment=SANDBOX_ENV,
            stdin_open=True,  # with detach False: attach stdin, close it when we do
            network_disabled=True,
            labels={self.LABEL: str(os.getpid())},
            host_config=host,
        )

    async def spawn(self, box: Box, limits: Limits, interactive: bool) -> Proc:
        created = await self.call("create_container_from_config", self._config(box, limits))
        cid = created["Id"]
        try:
            params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            sock = await self.call("attach_socket", cid, params=params)
            raw: socket.socket = sock._sock
            reader, writer = await asyncio.open_connection(sock=raw, limit=LINE_LIMIT)
            await self.call("start", cid)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.call("remove_container", cid, force=True)
            raise
        container = _Container(self, cid, writer)
        container.start_pump(reader)
        payload = json.dumps(box.files).encode()
        writer.write(b"%d\n" % len(payload) + payload)
        await writer.drain()
        if not interactive:
            writer.write_eof()
            container.stdin = None
        return container

    def leftovers(self) -> list[str]:
        """This process's sandbox containers still on the engine (for tests)."""
        found = self._api.containers(all=True, filters={"label": f"{self.LABEL}={os.getpid()}"})
        return [c["Id"] for c in found]
