"""Inside the sandbox, before the untrusted code: runs as root in fresh mount/pid/net
namespaces (made by `unshare`), then locks itself down and execs the code.

    python -m treadle_env_gateway.sandbox.bootstrap WORKDIR PYTHON LIMITS_JSON UID

1. private mounts: WORKDIR bound at /mnt, an empty tmpfs over every world-writable directory
   (/tmp, /var/tmp, /dev/shm, ...), so the only writable place left is the code's directory;
2. resource limits (CPU seconds, address space, processes, file size, open files, no core);
3. drop to UID (the sandbox's own, with the same gid and no supplementary groups); a clean
   environment (no host secrets);
4. fork: the child execs `PYTHON -I main.py` in WORKDIR (an interpreter `nobody` may run,
   /usr/bin/python3); this process stays PID 1 and exits with the child's status (128 + signal
   when it was killed), which ends every process the code left behind.
Any failure before the exec exits with code 125 and a line on stderr (a sandbox error, not
the code's).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

SETUP_FAILED = 125
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")
MOUNT_POINTS = ("/mnt", "/srv", "/media", "/opt")  # where the code's directory appears


def private_mounts(workdir: str) -> str:
    """Bind WORKDIR to a fixed mount point, then hide every world-writable directory under
    an empty tmpfs. Returns where the code's directory is inside the sandbox."""
    subprocess.run(["mount", "--make-rprivate", "/"], check=True, capture_output=True)
    inside = next(p for p in MOUNT_POINTS if os.path.isdir(p))
    subprocess.run(["mount", "--bind", workdir, inside], check=True, capture_output=True)
    for path in WORLD_WRITABLE:
        if os.path.isdir(path):
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m,mode=755", "tmpfs", path],
                check=True,
                capture_output=True,
            )
    return inside


def set_limits(limits: dict) -> None:
    cpu = int(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_code(workdir: str, python: str, limits: dict, uid: int) -> None:
    """In the child: limits, drop to the sandbox's own uid, exec the code. Never returns."""
    try:
        set_limits(limits)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        os.chdir(workdir)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        os.execve(python, [python, "-I", "main.py"], env)
    except Exception as exc:  # the sandbox itself failed: report it as such
        print(f"sandbox setup failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    os._exit(SETUP_FAILED)


def main() -> None:
    """PID 1 of the sandbox's pid namespace: set up mounts, start the code in a child, wait.
    When this process exits, the kernel kills every process left in the namespace."""
    workdir, python, limits = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    uid = int(sys.argv[4])
    try:
        workdir = private_mounts(workdir)
    except Exception as exc:
        print(f"sandbox setup failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(SETUP_FAILED)
    child = os.fork()
    if child == 0:
        run_code(workdir, python, limits, uid)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sys.exit(128 + os.WTERMSIG(status))
    sys.exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
