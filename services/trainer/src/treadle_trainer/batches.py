"""Batch assembly: trajectories from Redis -> filtered, grouped, advantages, padded tensors."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb

TRAINABLE = (tpb.TRAJECTORY_STATUS_OK, tpb.TRAJECTORY_STATUS_TRUNCATED)


def staleness(traj: tpb.Trajectory, trainer_version: int) -> int:
    """Trainer version now minus the oldest policy version among generated tokens."""
    generated = [v for v in traj.token_versions if v >= 0]
    return trainer_version - min(generated) if generated else 0


def drop_reason(traj: tpb.Trajectory, trainer_version: int, max_staleness: int) -> str | None:
    if traj.status not in TRAINABLE:
        return tpb.TrajectoryStatus.Name(traj.status).removeprefix("TRAJECTORY_STATUS_").lower()
    if staleness(traj, trainer_version) > max_staleness:
        return "stale"
    if not any(traj.loss_mask):
        return "no_generated_tokens"
    return None


def grpo_advantages(trajs: list[tpb.Trajectory], eps: float = 1e-6) -> list[float]:
    """Per trajectory: (reward - group mean) / (group std + eps)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        groups[t.group_id].append(i)
    advantages = [0.0] * len(trajs)
    for members in groups.values():
        rewards = torch.tensor([trajs[i].reward for i in members], dtype=torch.float64)
        centered = rewards - rewards.mean()
        std = rewards.std(unbiased=False) if len(members) > 1 else torch.tensor(0.0)
        for i, a in zip(members, (centered / (std + eps)).tolist(), strict=True):
            advantages[i] = a
    return advantages


@dataclass
class TensorBatch:
    input_ids_B_T: torch.Tensor
    targets_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    attention_B_T: torch.Tensor
    advantages_B: torch.Tensor


def to_tensors(trajs: list[tpb.Trajectory], advantages: list[float], pad_id: int) -> TensorBatch:
    """Right-padded next-token tensors; mask = loss_mask of each target token."""
    length = max(len(t.tokens) for t in trajs) - 1
    shape = (len(trajs), length)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, pad_id, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.float32)
    attention = torch.zeros(shape, dtype=torch.long)
    for b, t in enumerate(trajs):
        n = len(t.tokens) - 1
        tokens = torch.tensor(list(t.tokens), dtype=torch.long)
        input_ids[b, :n] = tokens[:-1]
        targets[b, :n] = tokens[1:]
        mask[b, :n] = torch.tensor(list(t.loss_mask[1:]), dtype=torch.float32)
        attention[b, :n] = 1
    return TensorBatch(
        input_ids, targets, mask, attention, torch.tensor(advantages, dtype=torch.float32)
    )
