"""The gateway reaps what its sandboxes leave: it becomes a child subreaper.

A sandbox's outer process (bwrap's monitor) can exit before the namespace's PID 1 it
started, which is then orphaned. An orphan goes to the nearest subreaper among its
ancestors, else to PID 1: in a container whose PID 1 is the gateway nothing would wait for
it, and on a host whose PID 1 does not reap, the pid slot leaks. As a subreaper the gateway
receives its sandboxes' orphans wherever it runs, and the backend waits for each one it
started (`backends._Local._reap_inner`), by pidfd, never for a pid it does not know.
"""

from __future__ import annotations

import ctypes

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans of this process's descendants come to it (Linux `prctl`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
