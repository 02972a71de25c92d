"""Inside the `unshare` sandbox, before the untrusted code: runs as root in fresh
mount/pid/net namespaces (made by `unshare`), then locks itself down and execs the code.

    python -m treadle_env_gateway.sandbox.bootstrap WORKDIR PYTHON LIMITS_JSON UID READY_FD

1. a minimal root (`minimal_root`): an empty read-only tmpfs holding only `/usr` (read-only,
   nosuid) with the merged-/usr links, a fresh `/proc` of this pid namespace, the few harmless
   devices, an unwritable `/tmp`, and at `/work`, the only writable place, a tmpfs of
   `disk_bytes` holding a copy of WORKDIR's files (so a full disk is the sandbox's own). The
   host's other files (the repo, models, the state dir, `/etc`) are not there at all;
2. fork; the child chroots into it, sets resource limits (CPU seconds, address space,
   processes, file size, open files, no core), no_new_privs (a setuid binary gains
   nothing) and the seccomp filter (`seccomp.py`), drops to UID (the sandbox's own, with
   the same gid and no supplementary groups), writes one byte to READY_FD (the runner's
   only sign that the sandbox is up: what fails after it is the code's) and execs
   `PYTHON -I main.py` in `/work` with a clean environment;
3. this process stays PID 1 and exits with the child's status (128 + signal when it was
   killed), which ends every process the code left behind.
Any failure before the ready byte exits with code 125 and a line on stderr; the runner
tells a sandbox error by the missing byte alone, never by an exit code or text the code
could produce itself.

`LIMIT_AND_RUN` is the same last step for backends that make the namespaces and drop
privileges themselves (bubblewrap): set the limits, exec the code.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import sys
from pathlib import Path

from treadle_env_gateway.sandbox import seccomp

SETUP_FAILED = 125
ROOT_CANDIDATES = ("/mnt", "/srv", "/media", "/opt")  # where the minimal root is assembled
DEVICES = ("null", "zero", "full", "random", "urandom")
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/work",
    "TMPDIR": "/work",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38

LIMIT_AND_RUN = """\
import json, os, resource, sys
limits = json.loads(sys.argv[1])
for name, value in (
    ("RLIMIT_CPU", (limits["cpu_seconds"], limits["cpu_seconds"] + 1)),
    ("RLIMIT_AS", (limits["memory_bytes"],) * 2),
    ("RLIMIT_NPROC", (limits["max_processes"],) * 2),
    ("RLIMIT_FSIZE", (limits["max_file_bytes"],) * 2),
    ("RLIMIT_NOFILE", (limits["max_open_files"],) * 2),
    ("RLIMIT_CORE", (0, 0)),
):
    resource.setrlimit(getattr(resource, name), value)
with open("/proc/self/oom_score_adj", "w") as f:  # the OOM killer's first pick, never the gateway
    f.write("1000")
if len(sys.argv) > 2:  # tell the runner the sandbox is up: what fails from here is the code's
    os.write(int(sys.argv[2]), b"1")
    os.close(int(sys.argv[2]))
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    if _libc.mount(source.encode(), target.encode(), fstype and fstype.encode(), flags,
                   data.encode() or None) != 0:  # fmt: skip
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def _bind_readonly(source: str, target: str) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def minimal_root(workdir: str, disk_bytes: int, uid: int) -> str:
    """Assemble the sandbox's root (see the module docstring); returns its path."""
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    root = next(p for p in ROOT_CANDIDATES if os.path.isdir(p) and not workdir.startswith(p))
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    top = Path(root)
    (top / "usr").mkdir()
    _bind_readonly("/usr", str(top / "usr"))
    for name in ("bin", "lib", "lib64", "sbin"):
        host = Path("/") / name
        if host.is_symlink():
            (top / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            (top / name).mkdir()
            _bind_readonly(str(host), str(top / name))
    (top / "proc").mkdir()
    _mount("proc", str(top / "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    (top / "dev").mkdir()
    for device in DEVICES:
        (top / "dev" / device).touch()
        _mount(f"/dev/{device}", str(top / "dev" / device), None, MS_BIND)
    (top / "tmp").mkdir(mode=0o755)
    work = top / "work"
    work.mkdir()
    _mount("tmpfs", str(work), "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_bytes},mode=700")
    for item in Path(workdir).iterdir():
        shutil.copyfile(item, work / item.name)
        os.chown(work / item.name, uid, uid)
    os.chown(work, uid, uid)
    _mount("none", root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return root


def set_limits(limits: dict) -> None:
    with open("/proc/self/oom_score_adj", "w") as f:  # the OOM killer's first pick
        f.write("1000")
    cpu = int(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_code(root: str, python: str, limits: dict, uid: int, ready_fd: int) -> None:
    """In the child: into the minimal root, limits, drop to the sandbox's own uid, exec the
    code. Never returns."""
    try:
        os.chroot(root)
        os.chdir("/work")
        set_limits(limits)
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        seccomp.load()  # the calls the code has no use for (seccomp.py): EPERM
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.write(ready_fd, b"1")
        os.close(ready_fd)
        os.execve(python, [python, "-I", "main.py"], ENV)
    except Exception as exc:  # the sandbox itself failed: report it as such
        print(f"sandbox setup failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    os._exit(SETUP_FAILED)


def main() -> None:
    """PID 1 of the sandbox's pid namespace: build the root, start the code in a child, wait.
    When this process exits, the kernel kills every process left in the namespace."""
    workdir, python, limits = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    uid, ready_fd = int(sys.argv[4]), int(sys.argv[5])
    try:
        root = minimal_root(workdir, int(limits["disk_bytes"]), uid)
    except Exception as exc:
        print(f"sandbox setup failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(SETUP_FAILED)
    child = os.fork()
    if child == 0:
        run_code(root, python, limits, uid, ready_fd)
    os.close(ready_fd)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sys.exit(128 + os.WTERMSIG(status))
    sys.exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
