"""The local backends: `unshare` (a root gateway) and `bwrap` (bubblewrap, no root
needed). A sandbox is a process tree of the gateway's own, in its own session and PID
namespace, with a work dir that is a size-capped tmpfs (see `backends.py` for what every
backend guarantees)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from treadle_env_gateway.sandbox import bootstrap, seccomp
from treadle_env_gateway.sandbox.backends import (
    INSIDE_WORKDIR,
    LINE_LIMIT,
    REAP_GRACE_S,
    SANDBOX_ENV,
    Box,
    Proc,
    Writer,
    find_python,
)
from treadle_env_gateway.sandbox.cgroups import BoxCgroup, Cgroups
from treadle_env_gateway.sandbox.limits import Limits

OUTER_GRACE_S = REAP_GRACE_S
"""How long a killed sandbox's outer process has to reap the inner ones and exit before its
whole group is killed (what it did not reap then is the gateway's: `_reap_pidfd`)."""


def _pidfds(pids: list[int]) -> list[int]:
    """A pidfd for each of `pids` still there: each names that very process (not a later one
    given the same pid)."""
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    return fds


_REAPING: set[asyncio.Task] = set()
"""Reaps still waiting for a killed process that took longer than `REAP_GRACE_S` to exit."""


async def _reap_pidfd(pidfd: int) -> None:
    """Reap the process once it has exited if it is this process's child (else ECHILD: its
    parent reaped it), and close the pidfd. Waits at most `REAP_GRACE_S`: a killed process
    that takes longer to exit (a loaded machine) is reaped in the background when it does,
    never left a zombie."""
    task = asyncio.ensure_future(_reap_when_exited(pidfd))
    _REAPING.add(task)
    task.add_done_callback(_REAPING.discard)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), REAP_GRACE_S)


async def _reap_when_exited(pidfd: int) -> None:
    loop = asyncio.get_running_loop()
    exited = loop.create_future()

    def done() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, done)
    try:
        await exited
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 (WNOHANG)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def _group(pgid: int) -> list[int]:
    """The processes of process group `pgid`, from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(entry.name))
    return members


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

    cgroup: BoxCgroup | None = None
    _oom = False

    @property
    def oom_killed(self) -> bool:
        """Its box's cgroup killed a process for memory (where boxes have cgroups)."""
        return self._oom or (self.cgroup is not None and self.cgroup.oom_killed)

    info_fd: int | None = None
    """Read end of bwrap's `--info-fd`: the JSON naming the namespace's PID 1 (`child-pid`),
    which bwrap's monitor does not reap when it exits on the status that PID 1 reports."""
    ready_fd: int | None = None
    """Read end of a pipe the sandbox writes one byte to just before it execs the code (bwrap):
    none means the sandbox itself failed to start (its own error, not the code's)."""

    _ready: bool | None = None
    _stopped_before_ready = False

    def _became_ready(self) -> bool | None:
        """Whether the ready byte came (None: not yet, and the pipe is still open)."""
        if self._ready is None and self.ready_fd is not None:
            os.set_blocking(self.ready_fd, False)
            try:
                self._ready = os.read(self.ready_fd, 1) == b"1"
            except BlockingIOError:
                return None
        return self._ready

    @property
    def setup_failed(self) -> bool:
        """It ended without the ready byte, on its own: a sandbox the runner stopped while it
        was still setting up (the other side of a test run had already decided) did not
        fail."""
        if self.ready_fd is None or self._stopped_before_ready:
            return False
        return not self._became_ready()

    async def wait(self) -> int:
        return await self.proc.wait()

    async def kill(self) -> None:
        """End everything the sandbox started, the inner processes first (the namespace's
        PID 1 takes the code's with it) so that the outer one (bwrap's monitor, `unshare`)
        reaps them and exits on its own. Killed all at once, the inner one is orphaned and
        left a zombie for the machine's PID 1, which in a container is the gateway itself,
        and nothing reaps it. Then the group, whatever is left of it."""
        pid = self.proc.pid
        orphans: list[int] = []  # the inner ones' pidfds: ours to reap if they outlive the outer
        if self.proc.returncode is None:
            self._stopped_before_ready = self.ready_fd is not None and not self._became_ready()
            inner = [p for p in _group(pid) if p != pid]
            orphans = _pidfds(inner)
            for member in inner:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member, signal.SIGKILL)
            if inner:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.proc.wait()), OUTER_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        if self.proc.returncode is None:
            # and what the first look missed: a kill early in the start, before `unshare`
            # forked the inner one, kills both at once (killpg reaches a child forked
            # meanwhile), and the orphaned inner one is the gateway's. The group's id stays
            # taken while any member of it is left, so its members are this sandbox's only.
            orphans += _pidfds([p for p in _group(pid) if p != pid])
        if self.info_fd is not None:
            await self.proc.wait()
            await self._reap_inner()
        if orphans:  # an outer one killed before it reaped them (a loaded machine) left them
            await self.proc.wait()  # to the gateway, the subreaper: reap them, or ECHILD
            await asyncio.gather(*(_reap_pidfd(pidfd) for pidfd in orphans))
        if self.cgroup is not None:
            await self._end_cgroup(self.cgroup)

    def close(self) -> None:
        """asyncio closes a process's transport only once every pipe has reached its end, which
        a pipe nobody reads any more never does (a flood past `LINE_LIMIT` the relay gave up
        on leaves it paused). Left to the garbage collector after the gateway's loop closed,
        its close fails ("Event loop is closed"), so it is closed here, while the loop runs."""
        transport = getattr(self.proc, "_transport", None)  # asyncio keeps it private
        if transport is not None:
            transport.close()

    async def _end_cgroup(self, cgroup: BoxCgroup) -> None:
        """Kill what is left in the box's cgroup (whatever left the backend's group), note
        whether it ran out of memory, and remove it once empty."""
        cgroup.kill()
        await self.proc.wait()
        for _ in range(100):
            if not cgroup.pids():
                break
            await asyncio.sleep(0.02)
        self._oom = cgroup.oom_killed
        cgroup.remove()
        self.cgroup = None

    async def _reap_inner(self) -> None:
        """Reap the namespace's PID 1 that bwrap's monitor left behind: orphaned, it is
        the gateway's (a child subreaper, or PID 1 in its container: `reaping.py`), and
        nothing else would wait for it. Elsewhere it is not ours to reap (ECHILD)."""
        assert self.info_fd is not None
        os.set_blocking(self.info_fd, False)
        try:
            info = json.loads(os.read(self.info_fd, 4096) or b"{}")
            pidfd = os.pidfd_open(int(info["child-pid"]))
        except (BlockingIOError, ValueError, KeyError, ProcessLookupError):
            return  # bwrap never got as far as a namespace, or it is gone already
        finally:
            os.close(self.info_fd)
            self.info_fd = None
        await _reap_pidfd(pidfd)

    def __del__(self) -> None:
        for fd in (self.ready_fd, self.info_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


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
        self._probing = asyncio.Lock()  # many first runs at once: one probe, one `Cgroups`
        self.cgroups: Cgroups | None = None
        """Where each box gets a cgroup of its own (a root gateway with a writable cgroup
        filesystem); None: its rlimits and its container's limit hold it (`cgroups.py`)."""

    def unavailable(self) -> str | None:
        if self._probe is False:
            self._probe = self._check_all()
        return self._probe  # type: ignore[return-value]

    async def ready(self) -> str | None:
        async with self._probing:  # probed once, at the first run, off the event loop
            if self._probe is False:
                self._probe = await asyncio.to_thread(self._check_all)
        return self._probe  # type: ignore[return-value]

    def _check_all(self) -> str | None:
        reason = self._check()
        if reason is None and self.root:
            self.cgroups = Cgroups.find()
        return reason

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

    async def _exec_ready(
        self,
        argv: list[str],
        interactive: bool,
        limits: Limits,
        ready: int,
        ready_w: int,
        *fds: int,
    ) -> Proc:
        """`_exec` in a cgroup of the box's own (where there are cgroups), passing the write
        end of the ready pipe (`ready_w`, and `fds`) to the sandbox and keeping the read end
        (`ready`) for `setup_failed`."""
        cgroup = self.cgroups.box(limits) if self.cgroups is not None else None
        try:
            prefix = cgroup.prefix() if cgroup is not None else []
            proc = await self._exec([*prefix, *argv], interactive, pass_fds=(ready_w, *fds))
        except BaseException:
            os.close(ready)
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            os.close(ready_w)
        assert isinstance(proc, _Local)
        proc.ready_fd, proc.cgroup = ready, cgroup
        return proc


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
        ready, ready_w = os.pipe()
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
            str(ready_w),
        ]
        return await self._exec_ready(argv, interactive, limits, ready, ready_w)


_BWRAP_ISOLATION = ("--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL")
"""New user, ipc, pid, net, uts and cgroup namespaces, no capabilities, a session of its own,
and gone with the gateway."""
_BWRAP_SYSTEM_DIRS = ("--proc", "/proc", "--dev", "/dev", "--dir", "/tmp")


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

    def argv(
        self,
        box: Box,
        limits: Limits,
        ready_fd: int,
        filter_fd: int,
        files: dict[str, int],
        info_fd: int,
    ) -> list[str]:
        """The work dir is a tmpfs of `disk_bytes` (a full one is the sandbox's own), the
        box's `files` copied in from memfds."""
        env = [arg for key, value in SANDBOX_ENV.items() for arg in ("--setenv", key, value)]
        copies = [
            arg
            for name, fd in files.items()
            for arg in ("--file", str(fd), f"{INSIDE_WORKDIR}/{name}")
        ]
        uid = str(box.uid)
        root = ["--ro-bind", "/usr", "/usr", *_runtime_links(), *_BWRAP_SYSTEM_DIRS]
        work = ["--size", str(limits.disk_bytes), "--perms", "0700", "--tmpfs", INSIDE_WORKDIR]
        code = [bootstrap.LIMIT_AND_RUN, json.dumps(asdict(limits)), str(ready_fd)]
        return [
            "bwrap",
            "--info-fd",  # names the namespace's PID 1, for `_Local._reap_inner`
            str(info_fd),
            *_BWRAP_ISOLATION,
            *("--uid", uid, "--gid", uid, "--hostname", "sandbox"),
            *root,
            *work,
            *copies,
            "--remount-ro",  # the root (and /tmp) read-only: the work dir is the one to write
            "/",
            "--seccomp",  # seccomp.py's filter, applied just before the code runs
            str(filter_fd),
            *("--chdir", INSIDE_WORKDIR, "--clearenv", *env),
            *("--", self.python, "-I", "-c", *code),
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
        info, info_w = os.pipe()
        fds = [info_w, _memfd("treadle-seccomp", self._filter)]  # bwrap reads each once
        try:
            files = {name: _memfd(name, text.encode()) for name, text in box.files.items()}
            fds += files.values()
            argv = [*owner, *self.argv(box, limits, ready_w, fds[1], files, info_w)]
            proc = await self._exec_ready(argv, interactive, limits, ready, ready_w, *fds)
        except BaseException:
            os.close(info)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        assert isinstance(proc, _Local)
        proc.info_fd = info
        return proc


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


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
