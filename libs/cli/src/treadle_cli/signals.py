"""SIGTERM stops a command the way Ctrl-C does: everything it started is stopped.

Python's default SIGTERM ends the process at once, skipping every `finally`: a `treadle bench`
or `treadle run` killed that way left its whole private stack running (the supervisor, five
services, Redis, NATS, each in a session of its own). Here SIGTERM raises KeyboardInterrupt
in the main thread, so the commands unwind through the same cleanup as Ctrl-C; a second
SIGTERM while that cleanup runs is ignored rather than cutting it short.

A KeyboardInterrupt raised while the main thread runs a callback from C code (grpc's
completion callbacks) is swallowed there ("Exception ignored in ... functor_run") and the
command would go on as if never stopped. `sys.unraisablehook` sees it written off: the stop is
raised again in the main thread (`_thread.interrupt_main`), until it lands where it unwinds.
It comes back through SIGTERM's handler, which is ours: SIGINT's may be ignored (a command
started in the background by a shell without job control), and then Python would drop it.

While an asyncio loop runs in the main thread the stop is not raised where the signal lands
(that may be inside grpc.aio's own callback, which then never delivers another completion:
`asyncio.run`'s cleanup waited forever on the cancelled calls, or the stop was lost and the
command ran to the end). It is raised from a callback of its own on that loop, between two
callbacks, and `asyncio.run` cancels the tasks and unwinds as for Ctrl-C.
"""

from __future__ import annotations

import _thread
import asyncio
import signal
import sys
from types import FrameType
from typing import Any

_previous_hook = sys.unraisablehook


_redeliver = False
"""A swallowed stop is on its way back (`_raise_again`): the handler raises it once more."""


def _once(signum: int, _frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, _ignored)  # a Python handler: not inherited across exec
    _stop(signum)


def _stop(signum: int) -> None:
    """Raise the stop here, or, while a loop runs in this thread, from the loop's next callback."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise KeyboardInterrupt(f"stopped by signal {signum}") from None
    loop.call_soon_threadsafe(_raise, signum)


def _raise(signum: int) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def _ignored(signum: int, _frame: FrameType | None) -> None:
    """A second SIGTERM during the cleanup is ignored; a swallowed stop is raised again."""
    global _redeliver
    if _redeliver:
        _redeliver = False
        _stop(signum)


def _raise_again(unraisable: Any) -> None:
    """A stop swallowed by C code: deliver it again; anything else as before."""
    global _redeliver
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _redeliver = signal.getsignal(signal.SIGTERM) is _ignored
        _thread.interrupt_main(signal.SIGTERM)  # _once, or _ignored with _redeliver set
        return
    _previous_hook(unraisable)


def unwind_on_sigterm() -> None:
    """From now on, the first SIGTERM unwinds this (main) thread like Ctrl-C."""
    signal.signal(signal.SIGTERM, _once)
    sys.unraisablehook = _raise_again
