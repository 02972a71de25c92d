"""A run's recorded schedule: what each step trained, in the run's directory, for replay.

    {output_dir}/{run_id}/schedule/run.json          the run's config, the model it started
                                                     from, the trainer's torch threads
    {output_dir}/{run_id}/schedule/step-NNNNNN.binpb one `ScheduleStep` per step: the groups
                                                     the step took (every trajectory, in feed
                                                     order), the version they were judged
                                                     against, the torch RNG state, what
                                                     training returned, the weights' SHA-256
                                                     at checkpoints and at the last step

A step redone after a resume overwrites its file (each is written whole, then renamed into
place), so the schedule is always the run's as it stands. `replay.py` reads it back.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from pydantic import BaseModel, Field

from treadle_common.config.recipe import RunConfig
from treadle_common.proto.treadle.v1 import schedule_pb2
from treadle_trainer.batches import Group

HEADER = "run.json"


class ScheduleHeader(BaseModel):
    config: RunConfig
    model_dir: str = Field(description="The HF directory the run's backend was built from")
    torch_threads: int = Field(description="torch.get_num_threads() of the trainer")
    deterministic: bool = Field(
        description="Whether torch's deterministic algorithms were on (bit-for-bit replay)"
    )
    ranks: int = Field(
        1,
        ge=1,
        description="The trainer's torchrun ranks (FSDP, Megatron); a replay runs on as many",
    )


def schedule_dir(run_dir: Path) -> Path:
    return run_dir / "schedule"


def step_path(run_dir: Path, step: int) -> Path:
    return schedule_dir(run_dir) / f"step-{step:06d}.binpb"


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors by name: name, dtype, shape and bytes of each."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def header_for(config: RunConfig, model_dir: Path) -> ScheduleHeader:
    return ScheduleHeader(
        config=config,
        model_dir=str(model_dir),
        torch_threads=torch.get_num_threads(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        ranks=int(os.environ.get("WORLD_SIZE", "1")),
    )


def write_header(run_dir: Path, header: ScheduleHeader) -> None:
    _write(schedule_dir(run_dir) / HEADER, header.model_dump_json(indent=1).encode())


def recorded_groups(groups: list[Group]) -> list[schedule_pb2.RecordedGroup]:
    return [
        schedule_pb2.RecordedGroup(
            group_id=g.group_id,
            entries=[
                schedule_pb2.RecordedEntry(
                    entry_id=e.entry_id, trajectory=e.traj, invalid=e.invalid or ""
                )
                for e in g.entries
            ],
        )
        for g in groups
    ]


def write_step(run_dir: Path, record: schedule_pb2.ScheduleStep) -> None:
    _write(step_path(run_dir, record.step), record.SerializeToString())


def read_header(run_dir: Path) -> ScheduleHeader:
    folder = schedule_dir(run_dir)
    if not (folder / HEADER).exists():
        raise FileNotFoundError(f"{folder} holds no recorded schedule ({HEADER})")
    return ScheduleHeader.model_validate_json((folder / HEADER).read_text())


def read(run_dir: Path) -> tuple[ScheduleHeader, list[schedule_pb2.ScheduleStep]]:
    """The run's header and its steps in order (steps 1..N, none missing)."""
    folder = schedule_dir(run_dir)
    header = read_header(run_dir)
    steps = [
        schedule_pb2.ScheduleStep.FromString(p.read_bytes())
        for p in sorted(folder.glob("step-*.binpb"))
    ]
    numbers = [s.step for s in steps]
    if numbers != list(range(1, len(steps) + 1)):
        raise ValueError(f"{folder}: steps {numbers} are not 1..{len(steps)}")
    return header, steps
