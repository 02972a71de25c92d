"""Replaying a run's training from its recorded schedule (`schedule.py`), without rollout or
environments, and comparing two runs' schedules.

    schedule/run.json --> the run's backend, built from the model it started from (same seed,
        same torch threads) --> per recorded step: its groups --> `build_batch` (the run's
        own code) --> the recorded RNG state --> `train_batch` --> what it returned and the
        weights' SHA-256 compared with the recording

On the same machine and backend (`single`, with or without LoRA) a replay reproduces the
run's weights bit for bit: with torch's deterministic algorithms on (the trainer's default,
`TREADLE_TRAINER_DETERMINISTIC`), training is a pure function of the recorded batches, the
seed and the thread count. Without them it is not on more than one CPU thread (index
additions sum in any order), and a replay says at which step it first differs.

A run trained on several `torchrun` ranks (`fsdp`, `megatron`) replays on as many: `replay`
starts a torchrun job of its own (`python -m treadle_trainer.replay`, `main`), whose rank 0
replays while the others follow it as they followed the run's trainer; gloo's collectives
(CPU) sum in a fixed order, so that too is bit for bit on the same machine.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from treadle_common.proto.treadle.v1 import schedule_pb2
from treadle_trainer import schedule
from treadle_trainer.backends import BackendSpec, build_backend
from treadle_trainer.batches import Entry, Group
from treadle_trainer.run.step import build_batch
from treadle_trainer.run.stepping import step_params
from treadle_trainer.train import train_batch


class ReplayReport(BaseModel):
    run_id: str
    steps: int = Field(description="Steps replayed")
    recorded_steps: int
    weights_sha256: str = Field(description="The replayed weights' digest after the last step")
    recorded_sha256: str = Field(
        description="The run's own digest after that step ('' where it recorded none)"
    )
    checked_digests: int = Field(description="Steps whose recorded digest was compared")
    identical: bool = Field(
        description="Every step trained the same trajectories, returned the same figures and "
        "(where recorded) the same weights"
    )
    first_divergent_step: int | None = None
    divergence: str | None = Field(None, description="What differed at that step")


class DiffReport(BaseModel):
    runs: list[str]
    steps_compared: int
    first_divergent_step: int | None = None
    divergence: str | None = None


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _groups(record: schedule_pb2.ScheduleStep) -> list[Group]:
    return [
        Group(g.group_id, [Entry(e.entry_id, e.trajectory, e.invalid or None) for e in g.entries])
        for g in record.groups
    ]


def _stats_differ(got: dict, recorded: schedule_pb2.ScheduleStep) -> str | None:
    for key, value in sorted(recorded.stats.items()):
        mine = got.get(key)
        if not isinstance(mine, (int, float)) or not _same(float(mine), value):
            return f"{key}: recorded {value!r}, replayed {mine!r}"
    return None


def replay(run_dir: Path, until: int | None = None) -> ReplayReport:
    """Re-run the training of the run in `run_dir` up to step `until` (all by default), on
    as many ranks as the run trained on."""
    ranks = schedule.read_header(run_dir).ranks
    if ranks > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return _on_ranks(run_dir, until, ranks)
    return _replay_here(run_dir, until)


def _replay_here(run_dir: Path, until: int | None) -> ReplayReport:
    header, recorded = schedule.read(run_dir)
    config, t = header.config, header.config.trainer
    steps = recorded[:until] if until is not None else recorded
    torch.set_num_threads(header.torch_threads)
    torch.use_deterministic_algorithms(header.deterministic, warn_only=True)
    backend = build_backend(BackendSpec.of(t, header.model_dir))
    loss, adam = step_params(config)
    first: tuple[int, str] | None = None
    checked = 0
    digest = ""
    try:
        for record in steps:
            batch = build_batch(_groups(record), record.version, record.max_staleness, t)
            why = None
            if batch.trained != list(record.trained):
                why = "trained other trajectories"
            torch.set_rng_state(
                torch.frombuffer(bytearray(record.torch_rng_state), dtype=torch.uint8)
            )
            stats = train_batch(backend, batch.data, t, loss, adam, record.step)
            why = why or _stats_differ(stats, record)
            if record.weights_sha256 or record is steps[-1]:
                digest = schedule.weights_digest(backend.state_dict_cpu())
            if record.weights_sha256:
                checked += 1
                if digest != record.weights_sha256:
                    why = why or f"weights: recorded {record.weights_sha256}, replayed {digest}"
            if why is not None and first is None:
                first = (record.step, why)
    finally:
        backend.close()
    return ReplayReport(
        run_id=config.run_id,
        steps=len(steps),
        recorded_steps=len(recorded),
        weights_sha256=digest,
        recorded_sha256=steps[-1].weights_sha256 if steps else "",
        checked_digests=checked,
        identical=first is None,
        first_divergent_step=first[0] if first else None,
        divergence=first[1] if first else None,
    )


def trained_digest(record: schedule_pb2.ScheduleStep) -> str:
    """SHA-256 of what a step trained, by content (tokens, mask, behaviour logprobs, reward
    of each trained trajectory, in order): ids differ between runs, contents need not."""
    by_id = {e.trajectory.trajectory_id: e.trajectory for g in record.groups for e in g.entries}
    h = hashlib.sha256()
    for tid in record.trained:
        traj = by_id[tid]
        h.update(struct.pack(f"<{len(traj.tokens)}q", *traj.tokens))
        h.update(struct.pack(f"<{len(traj.loss_mask)}q", *traj.loss_mask))
        h.update(struct.pack(f"<{len(traj.logprobs)}d", *traj.logprobs))
        h.update(struct.pack("<d", traj.reward))
    return h.hexdigest()


def _step_differs(a: schedule_pb2.ScheduleStep, b: schedule_pb2.ScheduleStep) -> str | None:
    if trained_digest(a) != trained_digest(b):
        return "trained other data"
    for key in sorted(set(a.stats) | set(b.stats)):
        if key not in a.stats or key not in b.stats or not _same(a.stats[key], b.stats[key]):
            return f"{key}: {a.stats.get(key)!r} vs {b.stats.get(key)!r}"
    if a.weights_sha256 and b.weights_sha256 and a.weights_sha256 != b.weights_sha256:
        return "weights"
    return None


def diff(run_a: Path, run_b: Path) -> DiffReport:
    """The first step where two runs' schedules differ: what they trained (by content), what
    training returned (loss, gradient norm, drift), or their weights where both recorded
    them."""
    (ha, a), (hb, b) = schedule.read(run_a), schedule.read(run_b)
    runs = [ha.config.run_id, hb.config.run_id]
    for sa, sb in zip(a, b, strict=False):
        why = _step_differs(sa, sb)
        if why is not None:
            return DiffReport(
                runs=runs, steps_compared=sa.step, first_divergent_step=sa.step, divergence=why
            )
    n = min(len(a), len(b))
    if len(a) != len(b):
        return DiffReport(
            runs=runs,
            steps_compared=n,
            first_divergent_step=n + 1,
            divergence=f"one run has {len(a)} steps, the other {len(b)}",
        )
    return DiffReport(runs=runs, steps_compared=n)


def _on_ranks(run_dir: Path, until: int | None, ranks: int) -> ReplayReport:
    """`replay` in a torchrun job of `ranks` processes (`main`), stopped with this call."""
    with tempfile.TemporaryDirectory(prefix="treadle-replay-") as tmp:
        out = Path(tmp) / "report.json"
        job = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        job += ["--nproc-per-node", str(ranks), "-m", "treadle_trainer.replay"]
        job += [str(run_dir), str(out), *([str(until)] if until is not None else [])]
        proc = subprocess.Popen(job, start_new_session=True)
        try:
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: the job's processes go with us
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if code != 0 or not out.exists():
            raise RuntimeError(f"the replay's torchrun job of {ranks} ranks failed ({code})")
        return ReplayReport.model_validate_json(out.read_text())


def main(argv: list[str] | None = None) -> None:
    """`torchrun --nproc-per-node N -m treadle_trainer.replay RUN_DIR OUT [UNTIL]`: rank 0
    replays and writes its report to OUT; ranks 1..N-1 follow it (`backends/follower.py`)."""
    from treadle_trainer.backends.follower import follow
    from treadle_trainer.backends.group import leave
    from treadle_trainer.backends.ranks import shutdown_followers

    parser = argparse.ArgumentParser(prog="python -m treadle_trainer.replay")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("until", type=int, nargs="?")
    args = parser.parse_args(argv)
    if int(os.environ.get("RANK", "0")) > 0:
        follow()
        return
    try:
        args.out.write_text(_replay_here(args.run_dir, args.until).model_dump_json())
    finally:
        shutdown_followers()
    leave(0)


if __name__ == "__main__":
    main()
