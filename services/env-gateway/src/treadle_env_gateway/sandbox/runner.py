"""The sandbox runner: spawn, limit, time out, truncate, kill everything, classify.

    result = await Sandbox(base_dir).run(code)   # -> SandboxResult(status=ok|failed|timeout|...)

    result = await Sandbox(base_dir).run_tests(code, tests)   # the verdict is the harness's

Where the code runs is a backend (`backends.py`: `unshare`, `bwrap` or `docker`), each
giving it no network, a fresh `/proc`, none of the host's files but the read-only runtime, a
work dir of its own (no sandbox can read another's), rlimits, no_new_privs and a uid of its
own. The wall-clock timeout kills everything the code started, including processes that
tried to outlive the step.

Fail closed: where the chosen backend cannot run (no namespaces, no bubblewrap, no Docker
engine or image), nothing runs; every run is a `sandbox_error` saying why, never code with
less isolation and never a `failed` the model did not earn.

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
import signal
import time
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge

from treadle_env_gateway.sandbox.backends import (
    LINE_LIMIT,
    Backend,
    Proc,
    find_python,
)
from treadle_env_gateway.sandbox.factory import make_backend
from treadle_env_gateway.sandbox.limits import Limits

__all__ = ["Limits", "Sandbox", "SandboxResult", "find_python"]

UID_BASE = 200_000
UID_COUNT = 50_000
"""Sandboxes run as uids UID_BASE.. (no passwd entry), one per concurrent sandbox."""


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
    backend: str = ""

    @property
    def infrastructure_error(self) -> bool:
        return self.status == "sandbox_error"


RUNNING = Gauge("treadle_env_sandbox_runs", "Sandboxed runs of this gateway, by state", ["state"])
QUEUED = Counter(
    "treadle_env_sandbox_queued_total",
    "Runs that waited for a free slot (the gateway's cap on concurrent runs was reached)",
)

RUNS: ContextVar[list[int] | None] = ContextVar("treadle_sandbox_runs", default=None)
"""Where a session's step counts the programs it runs (`sessions.py`; usage accounting)."""


def _counted() -> None:
    counter = RUNS.get()
    if counter is not None:
        counter[0] += 1


class Sandbox:
    """Runs code in a `backend` (`unshare`, `bwrap` or `docker`: see `backends`); where the
    backend cannot run here, every run is a `sandbox_error` saying why."""

    def __init__(
        self,
        base_dir: Path,
        limits: Limits | None = None,
        python: str | None = None,
        backend: str | Backend = "unshare",
        image: str = "python:3.11-slim-bookworm",
        max_concurrent: int = 8,
    ):
        self.base_dir = Path(base_dir)
        self.max_concurrent = max_concurrent
        self._slots = asyncio.Semaphore(max_concurrent)
        self.limits = limits or Limits()
        self.backend = (
            make_backend(backend, self.base_dir, image, python)
            if isinstance(backend, str)
            else backend
        )
        self._free_uids = collections.deque(range(UID_BASE, UID_BASE + UID_COUNT))

    @property
    def network_isolated(self) -> bool:
        return self.backend.unavailable() is None

    @contextlib.asynccontextmanager
    async def _slot(self):  # type: ignore[no-untyped-def]
        """One of the gateway's `max_concurrent` runs (a test run's two sandboxes are one):
        past them a run waits its turn, counted, instead of every hostile program at once
        competing for the gateway's own memory and process slots."""
        if self._slots.locked():
            QUEUED.inc()
        RUNNING.labels("waiting").inc()
        try:
            await self._slots.acquire()
        finally:
            RUNNING.labels("waiting").dec()
        RUNNING.labels("running").inc()
        try:
            yield
        finally:
            RUNNING.labels("running").dec()
            self._slots.release()

    @contextlib.contextmanager
    def _box(self, files: dict[str, str]):  # type: ignore[no-untyped-def]
        """A work dir holding `files`, for a uid of its own; removed after."""
        uid = self._free_uids.popleft()
        try:
            with self.backend.box(files, uid) as box:
                yield box
        finally:
            self._free_uids.append(uid)

    def _result(
        self,
        status: str,
        stderr: str,
        started: float,
        *,
        exit_code: int | None = None,
        stdout: str = "",
        truncated: bool = False,
        verdict: str | None = None,
    ) -> SandboxResult:
        return SandboxResult(
            status,
            exit_code,
            stdout,
            stderr,
            time.monotonic() - started,
            self.backend.unavailable() is None,
            truncated=truncated,
            verdict=verdict,
            backend=self.backend.name,
        )

    async def _refusal(self, started: float) -> SandboxResult | None:
        reason = await self.backend.ready()
        if reason is None:
            return None
        return self._result("sandbox_error", f"sandbox ({self.backend.name}): {reason}", started)

    def _error(self, exc: Exception, started: float) -> SandboxResult:
        detail = f"sandbox ({self.backend.name}): {type(exc).__name__}: {exc}"
        return self._result("sandbox_error", detail, started)

    async def run(
        self, code: str, files: dict[str, str] | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        """Run `code` as `main.py` (beside `files`); its exit status is the result."""
        _counted()
        limits = limits or self.limits
        started = time.monotonic()
        if refused := await self._refusal(started):
            return refused
        try:
            async with self._slot():
                with self._box({**(files or {}), "main.py": code}) as box:
                    proc = await self.backend.spawn(box, limits, interactive=False)
                    try:
                        return await self._run(proc, limits, started)
                    finally:
                        proc.close()
        except Exception as exc:  # the backend failed (engine gone, fork failed): not the code
            return self._error(exc, started)

    async def _run(self, proc: Proc, limits: Limits, started: float) -> SandboxResult:
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
            await proc.kill()
        await proc.wait()
        (stdout, cut_out), (stderr, cut_err) = await reads
        status = classify(proc.returncode, stderr, timed_out, proc.oom_killed)
        if proc.setup_failed:
            status = "sandbox_error"
        return self._result(
            status,
            stderr,
            started,
            exit_code=proc.returncode,
            stdout=stdout,
            truncated=cut_out or cut_err,
        )

    async def run_tests(self, code: str, tests: str, limits: Limits | None = None) -> SandboxResult:
        """The task's `tests` against the model's `code`, each in a sandbox of its own; `ok`
        only when the harness's verdict is `pass` (see the module's docstring)."""
        _counted()
        limits = limits or self.limits
        started = time.monotonic()
        if refused := await self._refusal(started):
            return refused
        try:
            names = free_names(tests)
        except SyntaxError as exc:
            return self._result("failed", f"tests do not parse: {exc}", started)
        here = Path(__file__).parent
        solution_files = {"main.py": (here / "server.py").read_text(), "solution.py": code}
        harness_files = {
            "main.py": (here / "harness.py").read_text(),
            "tests.py": tests,
            "entry_points.json": json.dumps(names),
        }
        try:
            async with self._slot():
                return await self._tests_boxed(solution_files, harness_files, limits, started)
        except Exception as exc:
            return self._error(exc, started)

    async def _tests_boxed(
        self, solution_files: dict, harness_files: dict, limits: Limits, started: float
    ) -> SandboxResult:
        with self._box(solution_files) as solution_box, self._box(harness_files) as harness_box:
            solution, harness = await asyncio.gather(
                self.backend.spawn(solution_box, limits, interactive=True),
                self.backend.spawn(harness_box, limits, interactive=True),
                return_exceptions=True,
            )
            spawned = [p for p in (solution, harness) if not isinstance(p, BaseException)]
            try:
                if len(spawned) < 2:
                    for proc in spawned:
                        await proc.kill()
                    raise next(p for p in (solution, harness) if isinstance(p, BaseException))
                return await self._judge(solution, harness, limits, started)  # type: ignore[arg-type]
            finally:
                for proc in spawned:
                    proc.close()

    async def _judge(
        self, solution: Proc, harness: Proc, limits: Limits, started: float
    ) -> SandboxResult:
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
            # what the relay left unread, read to the end: a pipe whose reader stopped past
            # its limit never sees its end, and asyncio's wait() waits for every pipe's
            procs = (solution, harness)
            leftovers = [asyncio.ensure_future(_read_capped(p.stdout, 0)) for p in procs]
            await asyncio.gather(solution.kill(), harness.kill())
        await asyncio.gather(solution.wait(), harness.wait(), *leftovers)
        (solution_err, cut_solution), (harness_err, cut_harness) = await errors
        passed = verdict.get("verdict") == "pass"
        detail = verdict.get("error") or verdict.get("load_error") or ""
        sides = ((solution, solution_err), (harness, harness_err))
        setup = [err for proc, err in sides if proc.setup_failed]  # the pipe's word alone
        if setup:
            status = "sandbox_error"
        elif timed_out:
            status = "timeout"
        elif passed:
            status = "ok"
        elif "MemoryError" in solution_err + detail or solution.oom_killed:
            status = "memory"
        else:
            status = "failed"
        return self._result(
            status,
            "\n".join(setup) or solution_err + ("\n" + harness_err if harness_err else ""),
            started,
            exit_code=solution.returncode,
            stdout=detail,
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


async def _relay(solution: Proc, harness: Proc) -> dict:
    """Carry the harness's calls to the solution and the answers back, until the verdict.
    A solution that fails to load, stops answering or garbles a line fails its calls; a
    harness that ends without a verdict fails the run."""
    assert solution.stdin is not None and harness.stdin is not None
    try:
        loaded = _parse(await _line(solution.stdout, "solution"))
        if not loaded.get("ready"):
            error = loaded.get("load_error") or "the solution exited before it loaded"
            return {"verdict": "fail", "load_error": f"solution: {error}"}
        while line := await _line(harness.stdout, "harness"):
            message = _parse(line)
            if "verdict" in message:
                return message
            if "call" not in message:
                return {"verdict": "fail", "error": "harness: malformed line"}
            try:
                solution.stdin.write(json.dumps(message).encode() + b"\n")
                await solution.stdin.drain()
                reply = _parse(await _line(solution.stdout, "solution"))
            except ConnectionError as exc:  # the solution is gone
                reply = {"error": f"solution: {type(exc).__name__}: {exc}"}
            if not ("value" in reply or "error" in reply):
                reply = {"error": "the solution stopped answering"}
            harness.stdin.write(json.dumps(reply).encode() + b"\n")
            await harness.stdin.drain()
    except _Overlong as exc:
        return {"verdict": "fail", "error": str(exc)}
    return {"verdict": "fail", "error": "the harness ended without a verdict"}


class _Overlong(Exception):
    """A protocol line past `LINE_LIMIT`: the failure of the side that wrote it."""


async def _line(stream: asyncio.StreamReader, who: str) -> bytes:
    """One protocol line, at most `LINE_LIMIT` bytes (the stream's own limit): a longer
    one is `who`'s failure, never the sandbox's."""
    try:
        return await stream.readline()
    except ValueError as exc:  # asyncio's LimitOverrunError, as readline raises it
        raise _Overlong(f"{who}: a protocol line longer than {LINE_LIMIT} bytes") from exc


def _parse(line: bytes) -> dict:
    try:
        value = json.loads(line) if line else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def classify(returncode: int | None, stderr: str, timed_out: bool, oom: bool = False) -> str:
    if oom:
        return "memory"
    if timed_out or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "timeout"
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
