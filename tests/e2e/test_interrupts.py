"""A command stopped mid-way stops everything it started: each `treadle bench` and
`treadle run` gets SIGTERM once its processes are up (a private stack: supervisor, services,
Redis, NATS; or its servers), and afterwards none of them is left running."""

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.support.cli import TREADLE
from tests.support.services import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MARK = "TREADLE_TEST_STOP_MARK"
"""Set in the command's environment: every process it starts inherits it."""
R = ROOT / "recipes"
COMMANDS = {
    # name: (arguments, processes up before the signal)
    "run": (["run", str(R / "skeleton.yaml"), "--set", "trainer.num_steps=100000"], 6),
    "bench-e2e": (["bench", "e2e", "--steps", "1000", "--no-quality"], 6),
    "bench-step": (["bench", "step", "--steps", "1000"], 6),
    "bench-learn": (["bench", "learn", "--seeds", "0", "--recipe", str(R / "demo.yaml")], 6),
    "bench-multirun": (["bench", "multirun", "--runs", "2", "--recipe", str(R / "demo.yaml")], 6),
    "bench-chaos": (["bench", "chaos", "--recipe", str(R / "chaos.yaml")], 6),
    "bench-rollout": (["bench", "rollout"], 3),
    "bench-trainer": (["bench", "trainer"], 3),
    "bench-tinker": (["bench", "tinker"], 3),
    "bench-weights": (["bench", "weights"], 1),
    "bench-env": (["bench", "env"], 1),
    "bench-reward": (["bench", "reward"], 2),
}


def _started(mark: str, root: int) -> dict[int, float]:
    """pid -> start time of every live process the command started: its descendants, and
    whatever carries its mark (a process in a session of its own whose parent exited)."""
    found: dict[int, float] = {}
    for proc in psutil.process_iter(["environ", "create_time", "status"]):
        try:
            marked = (proc.info["environ"] or {}).get(MARK) == mark
        except psutil.Error:
            continue
        if marked and proc.pid != root and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found[proc.pid] = proc.info["create_time"]
    try:
        for child in psutil.Process(root).children(recursive=True):
            if child.status() != psutil.STATUS_ZOMBIE:
                found[child.pid] = child.create_time()
    except psutil.Error:
        pass
    return found


def _running(procs: dict[int, float]) -> list[str]:
    alive = []
    for pid, created in procs.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            continue
    return alive


@pytest.mark.parametrize(
    ("name", "sig"),
    [(name, signal.SIGTERM) for name in COMMANDS] + [("run", signal.SIGKILL)],
    ids=[*COMMANDS, "run-sigkill"],
)
def test_stopped_mid_way_it_leaves_no_process_running(name, sig, cli_env, tmp_path):
    """SIGTERM: the command unwinds and stops what it started. SIGKILL (nothing runs in the
    command any more): the stack it started sees its owner gone and stops itself."""
    args, up = COMMANDS[name]
    mark = uuid.uuid4().hex
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        cmd = subprocess.Popen(
            [TREADLE, *args],
            env={**cli_env, MARK: mark},
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 300
        while len(started := _started(mark, cmd.pid)) < up:
            assert cmd.poll() is None, f"{name} ended before it was stopped:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"{name}: {len(started)} processes up"
            time.sleep(0.5)
        time.sleep(2)  # mid-way: whatever it starts next is starting too
        started.update(_started(mark, cmd.pid))
        cmd.send_signal(sig)
        cmd.wait(timeout=180)
        deadline = time.monotonic() + 30  # a process may still be exiting
        while (left := _running({**started, **_started(mark, cmd.pid)})) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert left == [], f"{name} left processes running:\n" + "\n".join(left)
        assert cmd.returncode != 0  # it was stopped, not finished
    finally:
        if cmd.poll() is None:
            cmd.kill()
        for pid in _started(mark, cmd.pid):  # a failed run leaves nothing either
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]
