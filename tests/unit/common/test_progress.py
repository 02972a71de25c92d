"""The stall detector's bookkeeping: pending work without progress, and recovery."""

import time

import pytest

from treadle_common.runtime.progress import Progress

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


def test_healthz_fails_while_a_liveness_stage_makes_no_progress():
    """/healthz is 503, naming the stage, once work this process alone can advance stood
    still past the liveness limit; a stage that waits on other services never fails it."""
    from fastapi.testclient import TestClient

    from treadle_common.config.settings import Settings
    from treadle_common.runtime.service import ServiceRuntime

    runtime = ServiceRuntime("svc", Settings(liveness_stall_s=0.05))
    waiting = runtime.progress.stage("batches", pending=lambda: 1)  # waits on another service
    work = runtime.progress.stage("train", liveness=True)
    client = TestClient(runtime.app)
    time.sleep(0.1)
    assert client.get("/healthz").status_code == 200 and waiting.pending() == 1
    with work.track():
        assert client.get("/healthz").status_code == 200  # just started
        time.sleep(0.1)
        response = client.get("/healthz")
        assert response.status_code == 503
        assert response.json() == {"status": "stalled", "service": "svc", "stages": ["train"]}
        work.tick()
        assert client.get("/healthz").status_code == 200  # progress again
    assert Progress("svc", 1.0).wedged(0) == []  # 0 turns the check off
