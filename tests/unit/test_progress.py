"""The stall detector's bookkeeping: pending work without progress, and recovery."""

import time

import pytest

from treadle_common.progress import Progress

pytestmark = pytest.mark.unit


def test_a_stage_stalls_only_while_work_is_pending():
    progress = Progress("svc", stall_after_s=0.05)
    queue = progress.stage("queue", pending=lambda: pending)
    worker = progress.stage("work")
    pending = 0
    time.sleep(0.1)
    assert progress.check() == []  # long idle, but nothing was waiting
    pending = 3
    assert progress.check() == []  # work just arrived: idle time starts now
    time.sleep(0.1)
    assert progress.check() == ["queue"]
    assert progress.snapshot()["queue"] == {
        "pending": 3,
        "done": 0,
        "idle_s": pytest.approx(0.1, abs=0.1),
        "stalled": True,
    }
    queue.tick()
    assert progress.check() == []  # progress resets the clock
    pending = 0
    with worker.track():
        time.sleep(0.1)
        assert progress.check() == ["work"] and worker.pending() == 1
    assert progress.check() == [] and worker.done == 1
