"""Ranks 1..N of a `torchrun` job: they build the backend rank 0 chose and run each command it
broadcasts on their part (the protocol is `ranks.py`)."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from treadle_trainer.backends.factory import build_follower
from treadle_trainer.backends.group import init_distributed, leave
from treadle_trainer.backends.ranks import RankedBackend, receive
from treadle_trainer.backends.spec import BackendSpec


def follow() -> None:
    """Ranks 1..N of a torchrun job: build and drive backends as rank 0 commands.

    SIGTERM is ignored: a stop reaches the whole process group, and rank 0 drains its run (which
    needs every rank) and then tells the followers to leave. If rank 0 dies instead, their next
    collective fails, and torchrun's SIGKILL follows its SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    init_distributed()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend: RankedBackend | None = None
    while True:
        op, header = receive(device)
        if op == "ping":  # rank 0 is alive and idle
            continue
        if op == "build":
            backend = build_follower(BackendSpec(**header))
        elif op == "shutdown":
            break
        elif backend is None:
            raise RuntimeError(f"command {op!r} before build")
        elif not backend.run_command(op, header):
            backend = None
    dist.barrier()  # both sides leave together; a one-sided teardown aborts gloo's peer
    dist.destroy_process_group()
    leave(0)
