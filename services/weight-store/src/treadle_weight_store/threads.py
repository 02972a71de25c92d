"""The weight store's blocking work on threads: backend calls (their failures as
`BackendError`), and the writers' low CPU priority."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from treadle_weight_store.errors import BackendError, StoreError


async def io(fn: Callable[..., Any], *args: Any, executor: ThreadPoolExecutor | None = None) -> Any:
    """Run a blocking backend call in a thread; backend failures surface as `BackendError`."""
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    except StoreError:
        raise
    except Exception as exc:  # OSError (disk full, ...), S3Error, connection errors
        raise BackendError(f"storage backend failed: {type(exc).__name__}: {exc}") from exc


def idle_priority() -> None:
    """Writer threads run at the lowest CPU priority: persisting yields to receiving and
    serving (Linux gives each thread its own nice value)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
