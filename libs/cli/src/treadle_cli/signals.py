"""SIGTERM stops a command the way Ctrl-C does: everything it started is stopped.

Python's default SIGTERM ends the process at once, skipping every `finally`: a `treadle bench`
or `treadle run` killed that way left its whole private stack running (the supervisor, five
services, Redis, NATS, each in a session of its own). Here SIGTERM raises KeyboardInterrupt
in the main thread, so the commands unwind through the same cleanup as Ctrl-C; a second
SIGTERM while that cleanup runs is ignored rather than cutting it short.
"""

from __future__ import annotations

import signal
from types import FrameType


def _once(signum: int, _frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, _ignored)  # a Python handler: not inherited across exec
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def _ignored(_signum: int, _frame: FrameType | None) -> None:
    pass


def unwind_on_sigterm() -> None:
    """From now on, the first SIGTERM unwinds this (main) thread like Ctrl-C."""
    signal.signal(signal.SIGTERM, _once)
