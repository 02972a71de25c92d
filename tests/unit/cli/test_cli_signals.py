"""A stop that C code swallowed is raised again (treadle_cli.signals)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SCRIPT = """
import sys, time
from types import SimpleNamespace
from treadle_cli import signals
signals.unwind_on_sigterm()
try:
    # what grpc's callback wrapper does with an exception it cannot raise: writes it off
    swallowed = KeyboardInterrupt("stopped by signal 15")
    sys.unraisablehook(SimpleNamespace(exc_type=KeyboardInterrupt, exc_value=swallowed,
                                       exc_traceback=None, err_msg=None, object=None))
    for _ in range(200):
        time.sleep(0.01)
    print("went on")
except KeyboardInterrupt:
    print("unwound")
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_stop_swallowed_by_a_c_callback_is_raised_again(sigint):
    """Also where SIGINT is ignored: a command a shell without job control started in the
    background (where Python drops an interrupt sent as SIGINT)."""

    def start() -> None:
        if sigint == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, preexec_fn=start
    )
    assert out.stdout.strip() == "unwound", out.stdout + out.stderr


LOOP_SCRIPT = """
import asyncio, os, signal
from treadle_cli import signals
signals.unwind_on_sigterm()

async def a_callback_that_writes_off_errors():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10000):  # the handler runs here, inside the try
            pass
    except BaseException:
        pass  # what grpc.aio's own callbacks do with what they cannot raise

async def other_work():
    try:
        await asyncio.sleep(60)
    finally:
        print("other task cleaned up")

async def main():
    other = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    await a_callback_that_writes_off_errors()
    for _ in range(100):
        await asyncio.sleep(0.01)
    print("went on")

try:
    asyncio.run(main())
except KeyboardInterrupt:
    print("unwound")
"""


def test_a_stop_during_an_asyncio_loop_is_raised_between_callbacks():
    """SIGTERM landing inside code that writes every exception off (grpc.aio's callbacks):
    the stop is still raised, from the loop, and asyncio.run cancels the other tasks."""
    out = subprocess.run(
        [sys.executable, "-c", LOOP_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split("\n")[:2] == ["other task cleaned up", "unwound"], (
        out.stdout + out.stderr
    )
