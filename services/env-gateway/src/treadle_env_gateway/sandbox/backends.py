"""Where sandboxed code runs: three backends behind one interface, chosen by setting
(`TREADLE_ENV_SANDBOX`), each failing closed.

| backend   | for                                    | isolation                                   |
|-----------|----------------------------------------|---------------------------------------------|
| `unshare` | a root gateway on a dev box            | mount/pid/net namespaces, a root of only    |
|           |                                        | `/usr` and the work dir, a uid per sandbox  |
| `bwrap`   | a non-root gateway (Kubernetes)        | bubblewrap: user/pid/net/ipc/uts namespaces,|
|           |                                        | the same minimal root                       |
| `docker`  | a gateway beside a Docker engine       | a throwaway container: no network, read-only|
|           | (compose mounts the socket)            | root, no capabilities, cgroup limits        |

Every backend: no network, a fresh `/proc`, no host files but the read-only runtime, only the
sandbox's own work dir writable, no setuid (no_new_privs), rlimits, its own uid (and, under
`unshare` and a root `bwrap`, its own host uid, so a fork bomb's process limit is its own).

`unavailable()` says why a backend cannot run here (None when it can); the `Sandbox` then
answers every run `sandbox_error` with that reason: never a silent downgrade to less
isolation, never `failed` (a reward of 0 the model did not earn).

A backend turns a `Box` (the files, and for the local backends a host work dir) into a
running `Proc`: stdin/stdout/stderr streams, `wait()` and `kill()`, which ends everything
the code started.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from treadle_env_gateway.sandbox import bootstrap, seccomp
from treadle_env_gateway.sandbox.limits import Limits

LINE_LIMIT = 4 * 2**20  # one protocol line (a call's arguments or value) at most
BACKENDS = ("unshare", "bwrap", "docker")
INSIDE_WORKDIR = "/work"
SANDBOX_ENV = bootstrap.ENV


@dataclass
class Box:
    files: dict[str, str]
    uid: int
    workdir: str | None = None
    """The host directory holding `files` (the local backends); None for `docker`, whose
    files travel over the container's stdin."""


class Writer(Protocol):
    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...


class Proc(Protocol):
    stdin: Writer | None
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader

    @property
    def returncode(self) -> int | None: ...

    @property
    def oom_killed(self) -> bool:
        """Killed by its memory cgroup (the `docker` backend's backstop to RLIMIT_AS)."""
        ...

    @property
    def setup_failed(self) -> bool:
        """(after it exited) The sandbox never reached the code: its own failure."""
        ...

    async def wait(self) -> int: ...
    async def kill(self) -> None: ...


class Backend(Protocol):
    name: str

    def unavailable(self) -> str | None: ...
    def box(self, files: dict[str, str], uid: int) -> contextlib.AbstractContextManager[Box]: ...
    async def spawn(self, box: Box, limits: Limits, interactive: bool) -> Proc: ...


def find_python() -> str:
    """The stdlib interpreter the code runs on: under /usr (the only host tree a sandbox
    sees) and executable by anyone."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and os.stat(os.path.realpath(candidate)).st_mode & 0o001:
            return candidate
    raise RuntimeError("no world-executable /usr/bin/python3 for the sandbox (install python3)")


class _Local:
    """A sandbox that is a local process tree (its own session): `kill` ends the group."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        assert proc.stdout is not None and proc.stderr is not None
        self.stdin: Writer | None = proc.stdin
        self.stdout: asyncio.StreamReader = proc.stdout
        self.stderr: asyncio.StreamReader = proc.stderr

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    oom_killed = False
    ready_fd: int | None = None
    """Read end of a pipe the sandbox writes one byte to just before it execs the code (bwrap):
    none means the sandbox itself failed to start (its own error, not the code's)."""

    @property
    def setup_failed(self) -> bool:
        if self.ready_fd is None:
            return False
        os.set_blocking(self.ready_fd, False)
        try:
            return os.read(self.ready_fd, 1) != b"1"
        except BlockingIOError:
            return True

    async def wait(self) -> int:
        return await self.proc.wait()

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def __del__(self) -> None:
        if self.ready_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.ready_fd)


class _LocalBackend:
    """A work dir per box under `base_dir`, owned by the box's uid and readable by it alone."""

    name = "local"

    def __init__(self, base_dir: Path, python: str | None = None):
        self.base_dir = Path(base_dir)
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.base_dir.chmod(0o755)
        self.python = python or find_python()
        self.root = os.geteuid() == 0
        self._probe: str | None | bool = False

    def unavailable(self) -> str | None:
        if self._probe is False:
            self._probe = self._check()
        return self._probe  # type: ignore[return-value]

    def _check(self) -> str | None:
        raise NotImplementedError

    @contextlib.contextmanager
    def box(self, files: dict[str, str], uid: int) -> Iterator[Box]:
        workdir = tempfile.mkdtemp(prefix="box-", dir=self.base_dir)
        owner = uid if self.root else os.geteuid()
        try:
            for name, text in files.items():
                (Path(workdir) / name).write_text(text)
                if self.root:
                    os.chown(Path(workdir) / name, owner, owner)
            if self.root:
                os.chown(workdir, owner, owner)
            os.chmod(workdir, 0o700)
            yield Box(files, uid, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _exec(self, argv: list[str], interactive: bool, **kwargs: Any) -> Proc:
        """Start `argv` in a session of its own, with none of the gateway's environment (a
        sandbox's PID 1 keeps the environment it was started with, readable in /proc)."""
        program = shutil.which(argv[0]) or argv[0]
        proc = await asyncio.create_subprocess_exec(
            program,
            *argv[1:],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            stdin=asyncio.subprocess.PIPE if interactive else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            limit=LINE_LIMIT,
            **kwargs,
        )
        return _Local(proc)


class UnshareBackend(_LocalBackend):
    """`unshare --net --mount --pid --fork --kill-child --mount-proc`, then `bootstrap.py`
    (still root, inside) builds the minimal root, sets limits and no_new_privs, and drops to
    the box's uid. Needs root."""

    name = "unshare"

    def _check(self) -> str | None:
        if not self.root:
            return "the unshare sandbox needs a root gateway (use bwrap or docker otherwise)"
        if shutil.which("unshare") is None:
            return "unshare (util-linux) is not installed"
        if reason := seccomp.unavailable():
            return reason
        probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "true"])
        if probe.returncode != 0:
            return (
                "namespaces are unavailable here (unshare --net --mount --pid failed): the "
                "sandbox does not run code with the host's network or files"
            )
        return None

    async def spawn(self, box: Box, limits: Limits, interactive: bool) -> Proc:
        assert box.workdir is not None
        namespaces = ["--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
        argv = [
            "unshare",
            *namespaces,
            sys.executable,
            "-m",
            "treadle_env_gateway.sandbox.bootstrap",
            box.workdir,
            self.python,
            json.dumps(asdict(limits)),
            str(box.uid),
        ]
        return await self._exec(argv, interactive)


class BwrapBackend(_LocalBackend):
    """bubblewrap in new user/pid/net/ipc/uts/cgroup namespaces; works without root where the
    kernel allows unprivileged user namespaces. A root gateway starts each bwrap as the box's
    own uid, so every sandbox is a different host uid too."""

    name = "bwrap"

    def _check(self) -> str | None:
        if shutil.which("bwrap") is None:
            return "bubblewrap (bwrap) is not installed"
        if reason := seccomp.unavailable():
            return reason
        self._filter = seccomp.bpf()
        if self.root and shutil.which("setpriv") is None:
            return "a root gateway starts bwrap as each sandbox's uid with setpriv (util-linux)"
        probe = subprocess.run(  # the namespaces and a fresh /proc, as every run makes them
            ["bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr", *_runtime_links()]
            + ["--proc", "/proc", "true"],
            capture_output=True,
            text=True,
        )
        if self.root and (unreachable := _not_traversable(self.base_dir)):
            return (
                f"{unreachable} is closed to other users, so the sandboxes' own uids cannot "
                f"reach their work dirs under {self.base_dir} (chmod o+x it, or move the "
                "state dir)"
            )
        if probe.returncode != 0:
            return (
                "bubblewrap cannot make its namespaces or mount a /proc here (in a container: "
                "it needs a seccomp profile allowing user namespaces and an unmasked /proc): "
                f"{probe.stderr.strip()[-300:]}"
            )
        return None

    _filter = b""
    """The seccomp filter as BPF (built once, by `_check`)."""

    def argv(self, box: Box, limits: Limits, ready_fd: int, filter_fd: int) -> list[str]:
        assert box.workdir is not None
        env = [arg for key, value in SANDBOX_ENV.items() for arg in ("--setenv", key, value)]
        return [
            "bwrap",
            "--unshare-all",  # user, ipc, pid, net, uts, cgroup
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--uid",
            str(box.uid),
            "--gid",
            str(box.uid),
            "--hostname",
            "sandbox",
            "--ro-bind",
            "/usr",
            "/usr",
            *_runtime_links(),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--dir",
            "/tmp",
            "--bind",
            box.workdir,
            INSIDE_WORKDIR,
            "--remount-ro",  # the root (and /tmp) read-only: the work dir is the one to write
            "/",
            "--seccomp",  # seccomp.py's filter, applied just before the code runs
            str(filter_fd),
            "--chdir",
            INSIDE_WORKDIR,
            "--clearenv",
            *env,
            "--",
            self.python,
            "-I",
            "-c",
            bootstrap.LIMIT_AND_RUN,
            json.dumps(asdict(limits)),
            str(ready_fd),
        ]

    async def spawn(self, box: Box, limits: Limits, interactive: bool) -> Proc:
        # a root gateway drops to the box's uid with setpriv, after the exec: Popen's own
        # user=/group= would make it fork() rather than vfork(), and a fork runs gRPC's
        # atfork handlers in the child (seen: a poller thread there, then no sandbox)
        owner = (
            ["setpriv", f"--reuid={box.uid}", f"--regid={box.uid}", "--clear-groups", "--"]
            if self.root
            else []
        )
        ready, ready_w = os.pipe()
        filter_fd = os.memfd_create("treadle-seccomp")  # bwrap reads it once, from its start
        try:
            os.write(filter_fd, self._filter)
            os.lseek(filter_fd, 0, os.SEEK_SET)
            argv = [*owner, *self.argv(box, limits, ready_w, filter_fd)]
            proc = await self._exec(argv, interactive, pass_fds=(ready_w, filter_fd))
        except BaseException:
            os.close(ready)
            raise
        finally:
            os.close(ready_w)
            os.close(filter_fd)
        assert isinstance(proc, _Local)
        proc.ready_fd = ready
        return proc


def _not_traversable(path: Path) -> Path | None:
    """The first directory from / down to `path` that others may not enter, if any."""
    for here in reversed([path.resolve(), *path.resolve().parents]):
        if not here.stat().st_mode & 0o001:
            return here
    return None


def _runtime_links() -> list[str]:
    """/bin, /lib, /lib64, /sbin as on the host: symlinks into /usr (merged /usr), or
    read-only binds."""
    args: list[str] = []
    for name in ("bin", "lib", "lib64", "sbin"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


# --- docker ------------------------------------------------------------------------------

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


class _Container:
    """A running sandbox container, attached: the engine's multiplexed stream demuxed into
    stdout/stderr readers; stdin is the attach socket's write half."""

    def __init__(self, backend: DockerBackend, cid: str, writer: asyncio.StreamWriter):
        self.backend, self.cid = backend, cid
        self._writer = writer
        self.stdin: Writer | None = writer
        self.stdout = asyncio.StreamReader(limit=LINE_LIMIT)
        self.stderr = asyncio.StreamReader(limit=LINE_LIMIT)
        self.returncode: int | None = None
        self.oom_killed = False
        self.setup_failed = False  # the engine refuses a container it cannot start
        self._pump: asyncio.Task | None = None

    def start_pump(self, reader: asyncio.StreamReader) -> None:
        self._pump = asyncio.create_task(self._demux(reader))

    async def _demux(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header = await reader.readexactly(8)
                kind, size = struct.unpack(">BxxxL", header)
                chunk = await reader.readexactly(size)
                (self.stderr if kind == 2 else self.stdout).feed_data(chunk)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.stdout.feed_eof()
            self.stderr.feed_eof()

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


class DockerBackend:
    """One throwaway container per run through the Docker SDK: `--network none`, read-only
    root, every capability dropped, no-new-privileges, the engine's default seccomp profile,
    a cgroup capping memory, processes and CPU, the box's uid, and only a private tmpfs to
    write in. Files go in over stdin (no host path is shared, so it also works when the
    gateway itself is a container talking to the engine through its socket)."""

    name = "docker"
    LABEL = "treadle.sandbox"

    def __init__(self, image: str, python: str = "python3", cpus: float = 1.0):
        self.image, self.python, self.cpus = image, python, cpus
        self._api: Any = None
        self._pulled = False
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="docker")

    def unavailable(self) -> str | None:
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
            tmpfs={INSIDE_WORKDIR: f"size={max(limits.max_file_bytes, 2**20) * 2},mode=1777"},
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


def make_backend(
    name: str, base_dir: Path, image: str = "python:3.11-slim-bookworm", python: str | None = None
) -> Backend:
    if name == "unshare":
        return UnshareBackend(base_dir, python)
    if name == "bwrap":
        return BwrapBackend(base_dir, python)
    if name == "docker":
        return DockerBackend(image)
    raise ValueError(f"unknown sandbox backend {name!r} (one of {', '.join(BACKENDS)})")
