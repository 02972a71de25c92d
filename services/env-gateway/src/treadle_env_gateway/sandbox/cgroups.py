"""Whole-box caps for the local backends: a cgroup per sandbox run capping the memory of all
its processes together (tmpfs work dir included), its processes and its CPU.

Rlimits bind one process each (32 processes of 512 MiB are 16 GiB); a cgroup binds the box.
The gateway makes them where it may write a cgroup filesystem (a root gateway on a host):
cgroup v2 (memory.max, pids.max, cpu.max) or v1 (the memory, pids and cpu hierarchies), under
its own cgroup in `treadle-sandboxes/`. A sandbox joins its cgroup before anything of it runs
(`prefix`: a shell that writes its pid into each `cgroup.procs`, then execs the backend's
command), so every process it starts is inside. Where no cgroup can be made (a non-root
gateway in a container, whose own container limit then holds the boxes together) the boxes
have their rlimits and `oom_score_adj` 1000 (the kernel's first pick), and `find` says why.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from treadle_env_gateway.sandbox.limits import Limits

ROOT = Path("/sys/fs/cgroup")
PARENT = "treadle-sandboxes"
HELPERS = 8
"""Processes beside the code's own in a box (the backend's bwrap/unshare, its init)."""
CPU_PERIOD_US = 100_000


@dataclass
class BoxCgroup:
    """One run's cgroup (one directory per v1 hierarchy, or one v2 directory)."""

    dirs: list[Path]
    v2: bool

    def prefix(self) -> list[str]:
        """argv before the backend's command: join this cgroup, then exec the command."""
        procs = ",".join(str(d / "cgroup.procs") for d in self.dirs)
        join = 'IFS=,; for f in $1; do echo $$ > "$f" || exit 125; done; shift; exec "$@"'
        return ["/bin/sh", "-c", join, "sh", procs]

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill(self) -> None:
        """SIGKILL whatever is still in it (a process that left the backend's group)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @property
    def oom_killed(self) -> bool:
        """Its memory limit killed one of its processes."""
        events = self.dirs[0] / ("memory.events" if self.v2 else "memory.oom_control")
        try:
            fields = dict(line.split() for line in events.read_text().splitlines())
        except (OSError, ValueError):
            return False
        return int(fields.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()


class Cgroups:
    """Where this gateway makes its boxes' cgroups; `find` returns None where it cannot."""

    _ids = itertools.count()
    """Box numbers, unique in this process whatever the number of `Cgroups` made (two with a
    counter each once named two live boxes alike, and one's removal took the other's)."""

    def __init__(self, parents: list[Path], v2: bool):
        self.parents, self.v2 = parents, v2

    @classmethod
    def find(cls) -> Cgroups | None:
        try:
            found = cls._v2() if (ROOT / "cgroup.controllers").exists() else cls._v1()
            probe = found.box(Limits())  # every file it needs, writable, or nothing
            probe.remove()
            return found
        except (OSError, ValueError):
            return None

    @classmethod
    def _v2(cls) -> Cgroups:
        own = _own_cgroup("")
        parent = ROOT / own.lstrip("/")
        # the boxes' parent beside this process's cgroup (a cgroup with processes may not
        # hand controllers to children), so under the one above it
        top = parent.parent / PARENT
        top.mkdir(exist_ok=True)
        (top / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        return cls([top], v2=True)

    @classmethod
    def _v1(cls) -> Cgroups:
        parents = []
        for controller in ("memory", "pids", "cpu"):
            top = ROOT / controller / _own_cgroup(controller).lstrip("/") / PARENT
            top.mkdir(exist_ok=True)
            parents.append(top)
        return cls(parents, v2=False)

    def box(self, limits: Limits) -> BoxCgroup:
        name = f"box-{os.getpid()}-{next(self._ids)}"
        dirs = [p / name for p in self.parents]
        box = BoxCgroup(dirs, self.v2)
        try:
            for d in dirs:
                d.mkdir()
            memory = limits.memory_bytes + limits.disk_bytes  # the tmpfs is the box's memory
            pids = limits.max_processes + HELPERS
            if self.v2:
                (dirs[0] / "memory.max").write_text(str(memory))
                (dirs[0] / "memory.swap.max").write_text("0")
                (dirs[0] / "pids.max").write_text(str(pids))
                (dirs[0] / "cpu.max").write_text(f"{CPU_PERIOD_US} {CPU_PERIOD_US}")
            else:
                (dirs[0] / "memory.limit_in_bytes").write_text(str(memory))
                (dirs[1] / "pids.max").write_text(str(pids))
                (dirs[2] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (dirs[2] / "cpu.cfs_quota_us").write_text(str(CPU_PERIOD_US))
        except OSError:
            box.remove()
            raise
        return box


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path in `controller`'s hierarchy ("" : the v2 one)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller in controllers.split(",")) if controller else controllers == "":
            return path
    raise ValueError(f"no {controller or 'v2'} cgroup for this process")
