"""A training step under `torch.profiler` (`trainer.profile_steps`), and the named phases a
step's trace shows.

    with profiled(run_dir / "profile", step, backend.device):
        train_batch(...)        # its phases: treadle.pack, treadle.forward_backward, ...

writes `step-N.json.gz` (the trace: Perfetto or chrome://tracing) and `step-N.txt` (the
phases' totals, then the operators by self time: on the device first where training runs on
CUDA, then on the CPU). The phases (`phase`) are `record_function` ranges: a few
microseconds when nothing profiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from treadle_common.runtime.logs import get_logger

log = get_logger(__name__)
ROWS = 40
"""Operators per table in `step-N.txt`."""

phase = record_function
"""A named range of a step (`treadle.forward_backward`, ...) in a profiled step's trace."""


@contextmanager
def profiled(directory: Path, step: int, device: str, phases: str = "treadle.") -> Iterator[None]:
    """Profile what runs inside on this thread (and on the GPU where `device` is CUDA); write
    the trace and the tables once it is done. `phases`: the prefix of the named ranges whose
    totals head the tables."""
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, record_shapes=True) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()  # the step's last kernels inside the profile
    directory.mkdir(parents=True, exist_ok=True)
    trace, table = directory / f"step-{step}.json.gz", directory / f"step-{step}.txt"
    prof.export_chrome_trace(str(trace))
    table.write_text(tables(prof, cuda, phases))
    log.info("profiled a step", step=step, trace=str(trace), table=str(table))


def tables(prof: profile, cuda: bool, phases: str = "treadle.") -> str:
    """The named phases' totals (what they call included), then the operators by self device
    time (CUDA) and by self CPU time."""
    events = prof.key_averages()
    named = sorted((e for e in events if e.key.startswith(phases)), key=lambda e: e.key)
    totals = "".join(
        f"{e.key:<32} {e.count:>5} calls {e.cpu_time_total / 1e3:>11.1f} ms CPU"
        f" {e.device_time_total / 1e3:>11.1f} ms device\n"
        for e in named
    )
    sorts = [*(["self_device_time_total"] if cuda else []), "self_cpu_time_total"]
    by_self = [f"# by {key}\n{events.table(sort_by=key, row_limit=ROWS)}" for key in sorts]
    return "\n\n".join([f"# phases (totals)\n{totals}", *by_self])
