"""Batch assembly: trajectories -> validated, grouped, advantages, micro-batches by token budget.

Trajectory --validate--> GroupBuffer (complete GRPO groups, by group id)
    --advantages (grpo | dr_grpo | rloo)--> Datum per trajectory (shifted by one token)
    --aggregation coefficients over the whole batch--> pack by token budget --> MicroBatch
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_trainer.losses import aggregation_coefs

TRAINABLE = (tpb.TRAJECTORY_STATUS_OK, tpb.TRAJECTORY_STATUS_TRUNCATED)


# Per-token fields are read as numpy arrays: protobuf's upb runtime hands a repeated scalar
# field to numpy without a Python object per element (`np.asarray` of 2,000 tokens takes
# microseconds, a Python loop over them a fifth of a millisecond). The trainer's ingest of
# every trajectory goes through here: `treadle bench capacity` measures it.


def staleness(traj: tpb.Trajectory, trainer_version: int) -> int:
    """Trainer version now minus the oldest policy version among generated tokens."""
    versions = np.asarray(traj.token_versions)
    generated = versions[versions >= 0]
    return trainer_version - int(generated.min()) if generated.size else 0


def invalid_reason(traj: tpb.Trajectory, vocab_size: int) -> str | None:
    """Why a trajectory cannot be trained on at all (malformed), or None."""
    n = len(traj.tokens)
    if not traj.trajectory_id or not traj.group_id:
        return "missing_ids"
    if n < 2:
        return "too_short"
    if not len(traj.loss_mask) == len(traj.logprobs) == len(traj.token_versions) == n:
        return "length_mismatch"
    if len(traj.constrained_mask) not in (0, n):
        return "length_mismatch"
    tokens = np.asarray(traj.tokens)
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        return "token_out_of_vocab"
    mask = np.asarray(traj.loss_mask)
    if bool(((mask != 0) & (mask != 1)).any()):
        return "bad_loss_mask"
    logprobs = np.asarray(traj.logprobs)
    if not bool(np.isfinite(logprobs).all()) or bool((logprobs > 0).any()):
        return "bad_logprobs"
    if not math.isfinite(traj.reward):
        return "bad_reward"
    return None


def is_whole(entries: Sequence[Entry]) -> bool:
    """No member failed (an infrastructure status) or was malformed: a group trainable as
    a whole (a group is never trained on its survivors only)."""
    return all(e.invalid is None and e.traj.status in TRAINABLE for e in entries)


def drop_reason(
    traj: tpb.Trajectory, trainer_version: int, max_staleness: int | None
) -> str | None:
    """Why a well-formed trajectory is not trained on now (status, staleness), or None.
    `max_staleness` None: no lag is too much (admission bounded the group's start)."""
    if traj.status not in TRAINABLE:
        return tpb.TrajectoryStatus.Name(traj.status).removeprefix("TRAJECTORY_STATUS_").lower()
    if max_staleness is not None and staleness(traj, trainer_version) > max_staleness:
        return "stale"
    if not bool(np.asarray(traj.loss_mask)[1:].any()):
        return "no_generated_tokens"
    return None


# --- advantages -------------------------------------------------------------------------


def grpo(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps) (population std)."""
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - group mean (no std normalisation, which biases toward easy/hard prompts)."""
    return rewards - rewards.mean()


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean of the other members."""
    n = rewards.numel()
    if n < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) * n / (n - 1)


ADVANTAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
}


def group_advantages(trajs: Sequence[tpb.Trajectory], method: str) -> list[float]:
    """Advantages of one group's trajectories."""
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
    return ADVANTAGES[method](rewards).tolist()


def is_constant(trajs: Sequence[tpb.Trajectory]) -> bool:
    return len({t.reward for t in trajs}) <= 1


# --- groups ------------------------------------------------------------------------------


@dataclass
class Entry:
    entry_id: str
    traj: tpb.Trajectory
    invalid: str | None = None
    """Why this member of the group cannot be trained at all (`invalid_reason`: e.g. an
    episode whose env session failed before it generated anything). It still completes its
    group, and its step drops it with this reason."""


@dataclass
class Group:
    group_id: str
    entries: list[Entry] = field(default_factory=list)


def in_feed_order(groups: Sequence[Group]) -> list[Group]:
    """Groups by task id (the trainer's ids sort in feed order) and each group's trajectories
    by episode: a step's batch does not depend on the order in which episodes finished."""
    ordered = sorted(groups, key=lambda g: g.group_id)
    for group in ordered:
        group.entries.sort(key=lambda e: e.traj.sample_index)
    return ordered


class GroupBuffer:
    """Collects trajectories by group id until a group holds `group_size` of them."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self.partial: dict[str, Group] = {}
        self.ready: list[Group] = []

    def add(self, entry: Entry) -> None:
        group = self.partial.setdefault(entry.traj.group_id, Group(entry.traj.group_id))
        group.entries.append(entry)
        if len(group.entries) >= self.group_size:
            self.ready.append(self.partial.pop(group.group_id))

    def take(self, n: int) -> list[Group]:
        taken, self.ready = self.ready[:n], self.ready[n:]
        return taken

    def take_all(self) -> list[Group]:
        """Every buffered group, complete or not (the run is over)."""
        groups, self.ready = [*self.ready, *self.partial.values()], []
        self.partial = {}
        return groups

    def trajectory_ids(self) -> set[str]:
        groups = [*self.partial.values(), *self.ready]
        return {e.traj.trajectory_id for g in groups for e in g.entries}


# --- tensors -----------------------------------------------------------------------------


@dataclass
class Datum:
    """One training sequence, already shifted: predict targets[t] from input_ids[:t+1]."""

    input_ids: list[int]
    targets: list[int]
    weights: list[float]
    advantages: list[float]
    logprobs: list[float]
    group: str = ""
    staleness: int = 0
    """Versions behind the trainer it was generated (its drift is reported per staleness)."""

    @staticmethod
    def from_trajectory(traj: tpb.Trajectory, advantage: float, stale: int = 0) -> Datum:
        tokens = np.asarray(traj.tokens)
        mask = np.asarray(traj.loss_mask)[1:].astype(np.float64)
        return Datum(
            input_ids=tokens[:-1].tolist(),
            targets=tokens[1:].tolist(),
            weights=mask.tolist(),
            advantages=(float(advantage) * mask).tolist(),
            logprobs=np.asarray(traj.logprobs)[1:].tolist(),
            group=traj.group_id,
            staleness=stale,
        )


@dataclass
class MicroBatch:
    input_ids_B_T: torch.Tensor
    targets_B_T: torch.Tensor
    mask_B_T: torch.Tensor
    advantages_B_T: torch.Tensor
    logprobs_B_T: torch.Tensor
    coef_B: torch.Tensor
    staleness_B: torch.Tensor
    """Per sequence: versions behind the trainer (long)."""

    FIELDS = (
        "input_ids_B_T",
        "targets_B_T",
        "mask_B_T",
        "advantages_B_T",
        "logprobs_B_T",
        "coef_B",
        "staleness_B",
    )

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f) for f in self.FIELDS]

    @property
    def num_tokens(self) -> float:
        return float(self.mask_B_T.sum())


def collate(data: Sequence[Datum], coefs: Sequence[float], pad_id: int) -> MicroBatch:
    """Right-padded tensors of the given data (causal attention needs no mask for right pads;
    padded positions carry weight 0)."""
    shape = (len(data), max(len(d.input_ids) for d in data))
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, pad_id, dtype=torch.long)
    floats = [torch.zeros(shape, dtype=torch.float32) for _ in range(3)]
    for b, d in enumerate(data):
        n = len(d.input_ids)
        input_ids[b, :n] = torch.tensor(d.input_ids)
        targets[b, :n] = torch.tensor(d.targets)
        for tensor, values in zip(floats, (d.weights, d.advantages, d.logprobs), strict=True):
            tensor[b, :n] = torch.tensor(values, dtype=torch.float32)
    weights, advantages, logprobs = floats
    coef = torch.tensor(coefs, dtype=torch.float32)
    stale = torch.tensor([d.staleness for d in data], dtype=torch.long)
    return MicroBatch(input_ids, targets, weights, advantages, logprobs, coef, stale)


def pack(
    data: Sequence[Datum], token_budget: int, aggregation: str, pad_id: int
) -> list[MicroBatch]:
    """Micro-batches of at most `token_budget` padded tokens (a longer sequence goes alone).

    Aggregation coefficients are computed over the whole batch first, so the sum of the
    micro-batch losses equals the loss of the batch in one piece.
    """
    coefs = aggregation_coefs([sum(d.weights) for d in data], [d.group for d in data], aggregation)
    order = sorted(range(len(data)), key=lambda i: len(data[i].input_ids))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = len(data[i].input_ids)  # sorted: the newcomer is the longest
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return [collate([data[i] for i in b], [coefs[i] for i in b], pad_id) for b in batches]


def split_minibatches(data: list[Datum], n: int) -> list[list[Datum]]:
    """`data` (in group order) as up to `n` minibatches of whole groups, sizes within one group."""
    groups: list[list[Datum]] = []
    for d in data:
        if not groups or groups[-1][0].group != d.group:
            groups.append([])
        groups[-1].append(d)
    n = max(1, min(n, len(groups)))
    bounds = [round(i * len(groups) / n) for i in range(n + 1)]
    return [[d for g in groups[a:b] for d in g] for a, b in zip(bounds, bounds[1:], strict=False)]
