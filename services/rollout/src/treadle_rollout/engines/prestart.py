"""Start the engine process (`process_main`) before the service's own heavy imports, so that
the two processes import torch and transformers at the same time instead of one after the
other (about 4 s of every rollout start on a 2-core machine). Standard library only: this
module is imported before them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from treadle_rollout.engines import cpus

_started: tuple[str, subprocess.Popen, socket.socket] | None = None


def options_for(settings: Any) -> dict[str, Any]:
    """The engine process's options from `RolloutSettings` (what `ProcessEngine` sends)."""
    model_dir = Path(settings.rollout_model)
    split = cpus.split(settings.rollout_engine_cpus, settings.torch_threads)
    return {
        "model_dir": str(model_dir),
        "model_name": settings.rollout_model_name or model_dir.name,
        "swap_policy": settings.rollout_swap_policy,
        "max_batch": settings.rollout_max_batch,
        "max_context": settings.rollout_max_context,
        "prefix_cache_mb": settings.rollout_prefix_cache_mb,
        "logit_noise": settings.rollout_fault_logit_noise,
        "torch_threads": settings.torch_threads,
        "cpus": split[0] if split else None,
        "log_level": settings.log_level,
        "log_json": settings.log_json,
    }


def _key(options: dict[str, Any]) -> str:
    return json.dumps(options, sort_keys=True)


def spawn(options: dict[str, Any]) -> tuple[subprocess.Popen, socket.socket]:
    """The engine process, and the service's end of its socket."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "treadle_rollout.engines.process_main",
            str(theirs.fileno()),
            json.dumps(options),
        ],
        pass_fds=[theirs.fileno()],
    )
    if options.get("cpus"):  # at once, before its interpreter starts threads
        os.sched_setaffinity(proc.pid, options["cpus"])
    theirs.close()
    return proc, ours


def prestart(options: dict[str, Any]) -> None:
    """Start the engine process now; `ProcessEngine.start` with the same options takes it."""
    global _started
    if _started is not None:
        _started[2].close()  # the earlier one exits
    proc, sock = spawn(options)
    _started = (_key(options), proc, sock)


def take(options: dict[str, Any]) -> tuple[subprocess.Popen, socket.socket] | None:
    """The engine process `prestart` started with these options, if any. One started with
    other options is let go (its socket closed: it exits)."""
    global _started
    started, _started = _started, None
    if started is None:
        return None
    key, proc, sock = started
    if key != _key(options):
        sock.close()
        return None
    return proc, sock
