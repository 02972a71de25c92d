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
import contextlib
import os
from dataclasses import dataclass
from typing import Protocol

from treadle_env_gateway.sandbox import bootstrap
from treadle_env_gateway.sandbox.limits import Limits

LINE_LIMIT = 4 * 2**20  # one protocol line (a call's arguments or value) at most
REAP_GRACE_S = 2.0
"""How long a killed sandbox's outer process has to reap its inner ones and exit."""
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
    def close(self) -> None:
        """(after `kill`, `wait` and the reads) Let go of its pipes, read to the end or not."""
        ...


class Backend(Protocol):
    name: str

    def unavailable(self) -> str | None: ...
    async def ready(self) -> str | None:
        """`unavailable()` without blocking the event loop (checked again now and then)."""
        ...

    def box(self, files: dict[str, str], uid: int) -> contextlib.AbstractContextManager[Box]: ...
    async def spawn(self, box: Box, limits: Limits, interactive: bool) -> Proc: ...


def find_python() -> str:
    """The stdlib interpreter the code runs on: under /usr (the only host tree a sandbox
    sees) and executable by anyone."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and os.stat(os.path.realpath(candidate)).st_mode & 0o001:
            return candidate
    raise RuntimeError("no world-executable /usr/bin/python3 for the sandbox (install python3)")
