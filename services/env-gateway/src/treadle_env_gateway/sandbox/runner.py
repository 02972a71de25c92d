"""The sandbox runner: spawn, limit, time out, truncate, kill everything, classify.

    result = await Sandbox(base_dir).run(code)   # -> SandboxResult(status=ok|failed|timeout|...)

    result = await Sandbox(base_dir).run_tests(code, tests)   # the verdict is the harness's

`unshare --net --mount --pid --fork --kill-child --mount-proc` gives the code its own mounts,
process tree (and a `/proc` that shows only it) and an empty network (loopback only);
`bootstrap.py` then mounts tmpfs over world-writable dirs, sets rlimits and drops to a uid of
its own: every sandbox runs as a different uid (from `UID_BASE`), in a work dir only that uid
may read, so a sandbox cannot read a sibling's files and a fork bomb's process limit (per uid)
starves only itself. The wall-clock timeout kills the whole process group; because the code
is in its own pid namespace, killing it kills every process it started, including ones that
tried to outlive the step.

Fail closed: where the kernel refuses a network namespace, nothing runs; every run is a
`sandbox_error` saying why, never code with the host's network.

`run_tests` runs the task's tests and the model's code in two sandboxes: the code behind a
small server (`server.py`) that answers calls to its functions, the tests in a harness
(`harness.py`) whose calls the runner relays and whose last line is the verdict. The code
never runs where the verdict is written, so printing a success line, exiting 0 early or
patching the test's functions cannot pass.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

SETUP_FAILED = 125  # bootstrap's exit code when the sandbox itself could not be set up
UID_BASE = 200_000
UID_COUNT = 50_000
"""Sandboxes run as uids UID_BASE.. (no passwd entry), one per concurrent sandbox."""
LINE_LIMIT = 4 * 2**20  # one protocol line (a call's arguments or value) at most
NO_NETNS = (
    "network namespaces are unavailable here (unshare --net failed): the sandbox does not run "
    "code with the host's network"
)


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
    verdict: str | None = None
    """`run_tests`: the harness's `pass` / `fail` (None when it gave none)."""

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
        self.python = python or find_python()
        self._free_uids = collections.deque(range(UID_BASE, UID_BASE + UID_COUNT))

    def _command(self, workdir: str, limits: Limits, uid: int) -> list[str]:
        namespaces = ["--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
        bootstrap = [
            sys.executable,
            "-m",
            "treadle_env_gateway.sandbox.bootstrap",
            workdir,
            self.python,
            json.dumps(asdict(limits)),
            str(uid),
        ]
        return ["unshare", *namespaces, *bootstrap]

    @contextlib.contextmanager
    def _box(self, files: dict[str, str]) -> Iterator[tuple[str, int]]:
        """A work dir holding `files`, readable only by a uid of its own; removed after."""
        uid = self._free_uids.popleft()
        workdir = tempfile.mkdtemp(prefix="box-", dir=self.base_dir)
        try:
            for name, text in files.items():
                (Path(workdir) / name).write_text(text)
                os.chown(Path(workdir) / name, uid, uid)
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
            yield workdir, uid
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            self._free_uids.append(uid)

    def _refused(self, started: float) -> SandboxResult:
        return SandboxResult("sandbox_error", None, "", NO_NETNS, time.monotonic() - started, False)

    async def _spawn(
        self, workdir: str, limits: Limits, uid: int, stdin: int
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *self._command(workdir, limits, uid),
            stdin=stdin,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            limit=LINE_LIMIT,
        )

    async def run(
        self, code: str, files: dict[str, str] | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        """Run `code` as `main.py` (beside `files`); its exit status is the result."""
        limits = limits or self.limits
        started = time.monotonic()
        if not self.network_isolated:
            return self._refused(started)
        try:
            with self._box({**(files or {}), "main.py": code}) as (workdir, uid):
                return await self._run(workdir, uid, limits, started)
        except OSError as exc:
            return self._error(exc, started)

    def _error(self, exc: Exception, started: float) -> SandboxResult:
        return SandboxResult(
            "sandbox_error",
            None,
            "",
            f"{type(exc).__name__}: {exc}",
            time.monotonic() - started,
            self.network_isolated,
        )

    async def _run(self, workdir: str, uid: int, limits: Limits, started: float) -> SandboxResult:
        proc = await self._spawn(workdir, limits, uid, asyncio.subprocess.DEVNULL)
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

    async def run_tests(self, code: str, tests: str, limits: Limits | None = None) -> SandboxResult:
        """The task's `tests` against the model's `code`, each in a sandbox of its own; `ok`
        only when the harness's verdict is `pass` (see the module's docstring)."""
        limits = limits or self.limits
        started = time.monotonic()
        if not self.network_isolated:
            return self._refused(started)
        try:
            names = free_names(tests)
        except SyntaxError as exc:
            return SandboxResult(
                "failed", None, "", f"tests do not parse: {exc}", 0.0, self.network_isolated
            )
        here = Path(__file__).parent
        solution_files = {"main.py": (here / "server.py").read_text(), "solution.py": code}
        harness_files = {
            "main.py": (here / "harness.py").read_text(),
            "tests.py": tests,
            "entry_points.json": json.dumps(names),
        }
        try:
            with (
                self._box(solution_files) as (solution_dir, solution_uid),
                self._box(harness_files) as (harness_dir, harness_uid),
            ):
                pipe = asyncio.subprocess.PIPE
                solution = await self._spawn(solution_dir, limits, solution_uid, pipe)
                harness = await self._spawn(harness_dir, limits, harness_uid, pipe)
                return await self._judge(solution, harness, limits, started)
        except OSError as exc:
            return self._error(exc, started)

    async def _judge(
        self,
        solution: asyncio.subprocess.Process,
        harness: asyncio.subprocess.Process,
        limits: Limits,
        started: float,
    ) -> SandboxResult:
        assert solution.stderr is not None and harness.stderr is not None
        errors = asyncio.gather(
            _read_capped(solution.stderr, limits.max_output_bytes),
            _read_capped(harness.stderr, limits.max_output_bytes),
        )
        timed_out = False
        verdict: dict = {}
        try:
            verdict = await asyncio.wait_for(_relay(solution, harness), limits.wall_seconds)
        except TimeoutError:
            timed_out = True
        finally:
            _kill_group(solution.pid)
            _kill_group(harness.pid)
        await asyncio.gather(solution.wait(), harness.wait())
        (solution_err, cut_solution), (harness_err, cut_harness) = await errors
        passed = verdict.get("verdict") == "pass"
        detail = verdict.get("error") or verdict.get("load_error") or ""
        setup = [
            err
            for proc, err in ((solution, solution_err), (harness, harness_err))
            if proc.returncode == SETUP_FAILED and "sandbox setup failed" in err
        ]
        if setup:
            status = "sandbox_error"
        elif timed_out:
            status = "timeout"
        elif passed:
            status = "ok"
        elif "MemoryError" in solution_err + detail:
            status = "memory"
        else:
            status = "failed"
        return SandboxResult(
            status,
            solution.returncode,
            detail,
            "\n".join(setup) or solution_err + ("\n" + harness_err if harness_err else ""),
            time.monotonic() - started,
            self.network_isolated,
            truncated=cut_solution or cut_harness,
            verdict=verdict.get("verdict"),
        )


def free_names(tests: str) -> list[str]:
    """The names `tests` uses without defining them, builtins aside: what the solution must
    provide (each becomes a proxy in the harness). Parsed, never run."""
    tree = ast.parse(tests)
    bound = {
        node.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)
    }
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    used = {
        node.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }
    return sorted(used - bound - set(dir(builtins)) - {"SolutionError"})


async def _relay(solution: asyncio.subprocess.Process, harness: asyncio.subprocess.Process) -> dict:
    """Carry the harness's calls to the solution and the answers back, until the verdict.
    A solution that fails to load, stops answering or garbles a line fails its calls; a
    harness that ends without a verdict fails the run."""
    assert solution.stdout is not None and solution.stdin is not None
    assert harness.stdout is not None and harness.stdin is not None
    loaded = _parse(await solution.stdout.readline())
    if not loaded.get("ready"):
        error = loaded.get("load_error") or "the solution exited before it loaded"
        return {"verdict": "fail", "load_error": f"solution: {error}"}
    while line := await harness.stdout.readline():
        message = _parse(line)
        if "verdict" in message:
            return message
        if "call" not in message:
            return {"verdict": "fail", "error": "harness: malformed line"}
        try:
            solution.stdin.write(json.dumps(message).encode() + b"\n")
            await solution.stdin.drain()
            reply = _parse(await solution.stdout.readline())
        except (ConnectionError, ValueError) as exc:  # the solution is gone, or a line too long
            reply = {"error": f"solution: {type(exc).__name__}: {exc}"}
        if not ("value" in reply or "error" in reply):
            reply = {"error": "the solution stopped answering"}
        harness.stdin.write(json.dumps(reply).encode() + b"\n")
        await harness.stdin.drain()
    return {"verdict": "fail", "error": "the harness ended without a verdict"}


def _parse(line: bytes) -> dict:
    try:
        value = json.loads(line) if line else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


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
