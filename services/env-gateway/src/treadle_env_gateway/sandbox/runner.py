"""The sandbox runner: spawn, limit, time out, truncate, kill everything, classify.

    result = await Sandbox(base_dir).run(code)   # -> SandboxResult(status=ok|failed|timeout|...)

`unshare --mount --pid --net --fork --kill-child` gives the code its own mounts, process tree
and an empty network (loopback only); `bootstrap.py` then mounts tmpfs over world-writable
dirs, sets rlimits and drops to `nobody`. The wall-clock timeout kills the whole process
group; because the code is in its own pid namespace, killing it kills every process it
started, including ones that tried to outlive the step. If the kernel refuses a network
namespace, the sandbox runs without one and says so (`network_isolated=False`).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SETUP_FAILED = 125  # bootstrap's exit code when the sandbox itself could not be set up


@dataclass
class Limits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 2**20
    max_processes: int = 32
    max_file_bytes: int = 16 * 2**20
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024


@dataclass
class SandboxResult:
    status: str
    """ok | failed (nonzero exit: a wrong answer) | timeout | memory | crash | sandbox_error"""
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    network_isolated: bool
    truncated: bool = False

    @property
    def infrastructure_error(self) -> bool:
        return self.status == "sandbox_error"


def find_python() -> str:
    """A Python 3 interpreter that `nobody` can execute (the code's stdlib interpreter)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if (
            candidate
            and os.path.exists(candidate)
            and os.stat(os.path.realpath(candidate)).st_mode & 0o001
        ):
            return candidate
    raise RuntimeError("no world-executable python3 for the sandbox (install python3)")


def network_namespaces_work() -> bool:
    probe = subprocess.run(["unshare", "--net", "--fork", "true"], capture_output=True)
    return probe.returncode == 0


class Sandbox:
    def __init__(self, base_dir: Path, limits: Limits | None = None, python: str | None = None):
        self.base_dir = Path(base_dir)
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.base_dir.chmod(0o755)
        self.limits = limits or Limits()
        self.network_isolated = network_namespaces_work()
        self.nobody = pwd.getpwnam("nobody")
        self.python = python or find_python()

    def _command(self, workdir: str, limits: Limits) -> list[str]:
        namespaces = ["--mount", "--pid", "--fork", "--kill-child"]
        if self.network_isolated:
            namespaces.insert(0, "--net")
        bootstrap = [
            sys.executable,
            "-m",
            "treadle_env_gateway.sandbox.bootstrap",
            workdir,
            self.python,
            json.dumps(asdict(limits)),
        ]
        return ["unshare", *namespaces, *bootstrap]

    async def run(
        self, code: str, files: dict[str, str] | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        limits = limits or self.limits
        workdir = tempfile.mkdtemp(prefix="box-", dir=self.base_dir)
        started = time.monotonic()
        try:
            for name, text in {**(files or {}), "main.py": code}.items():
                (Path(workdir) / name).write_text(text)
            for path in [workdir, *(str(Path(workdir) / n) for n in [*(files or {}), "main.py"])]:
                os.chown(path, self.nobody.pw_uid, self.nobody.pw_gid)
            return await self._run(workdir, limits, started)
        except OSError as exc:
            return SandboxResult(
                "sandbox_error",
                None,
                "",
                f"{type(exc).__name__}: {exc}",
                time.monotonic() - started,
                self.network_isolated,
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _run(self, workdir: str, limits: Limits, started: float) -> SandboxResult:
        proc = await asyncio.create_subprocess_exec(
            *self._command(workdir, limits),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        reads = asyncio.gather(
            _read_capped(proc.stdout, limits.max_output_bytes),
            _read_capped(proc.stderr, limits.max_output_bytes),
        )
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), limits.wall_seconds)
        except TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)
        await proc.wait()
        (stdout, cut_out), (stderr, cut_err) = await reads
        status = classify(proc.returncode, stderr, timed_out)
        return SandboxResult(
            status,
            proc.returncode,
            stdout,
            stderr,
            time.monotonic() - started,
            self.network_isolated,
            truncated=cut_out or cut_err,
        )


def classify(returncode: int | None, stderr: str, timed_out: bool) -> str:
    if timed_out or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "timeout"
    if returncode == SETUP_FAILED and "sandbox setup failed" in stderr:
        return "sandbox_error"
    if "MemoryError" in stderr:
        return "memory"
    if returncode == 0:
        return "ok"
    if returncode is not None and (returncode < 0 or returncode > 128):
        return "crash"  # killed by a signal (segfault, abort, ...)
    return "failed"


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[str, bool]:
    """Read everything (so the child never blocks on a full pipe), keep the first `cap` bytes."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        kept += chunk[:room]
        truncated |= len(chunk) > room
    return kept.decode(errors="replace"), truncated


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
