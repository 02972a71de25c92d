"""A synthetic rollout for trainer workloads: turns the run's tasks into trajectories of a
fixed shape through the real Redis streams, tagged with the weight store's latest version.

It stands in for generation only (the trainer under test reads, validates, trains, publishes,
checkpoints and acks for real). `release(n)` lets a caller gate how many groups it produces;
`limit` stops it after that many groups (it then leaves the rest of the tasks unread, which
the trainer cancels at run end).
"""

from __future__ import annotations

import asyncio
import random
import uuid

import grpc
import redis.asyncio as aioredis

from treadle_common import names
from treadle_common.clients import streams
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb

KEEP = 1024


class SyntheticRollout:
    def __init__(
        self,
        r: aioredis.Redis,
        store: WeightStoreClient,
        run: str,
        model: str,
        vocab_size: int,
        prompt_len: int = 16,
        completion_len: int = 48,
        seed: int = 0,
        gated: bool = False,
        limit: int | None = None,
    ):
        self.r, self.store, self.run, self.model = r, store, run, model
        self.vocab, self.prompt_len, self.completion_len = vocab_size, prompt_len, completion_len
        self.rng = random.Random(seed)
        self.allowed = asyncio.Semaphore(0) if gated else None
        self.produced: list[str] = []
        self.first: list[tpb.Trajectory] = []  # the first KEEP produced (streams get trimmed)
        self.version = 0
        self.groups = 0
        self.limit = limit

    def release(self, groups: int) -> None:
        assert self.allowed is not None
        for _ in range(groups):
            self.allowed.release()

    def trajectory(self, task: task_pb2.Task, index: int, version: int) -> tpb.Trajectory:
        p, c = self.prompt_len, self.completion_len
        tokens = self.rng.choices(range(self.vocab), k=p + c)
        return tpb.Trajectory(
            trajectory_id=uuid.uuid4().hex,
            group_id=task.task_id,
            task_id=task.task_id,
            run_id=task.run_id,
            env=task.env,
            sample_index=index,
            tokens=tokens,
            loss_mask=[0] * p + [1] * c,
            logprobs=[0.0] * p + [-0.5 - 5.5 * self.rng.random() for _ in range(c)],
            token_versions=[-1] * p + [version] * c,
            reward=float(self.rng.random() < 0.5),
            status=tpb.TRAJECTORY_STATUS_OK,
            num_turns=1,
        )

    async def run_forever(self) -> None:
        tasks = names.tasks_stream(self.run)
        await streams.ensure_group(self.r, tasks, names.ROLLOUT_GROUP)
        while True:
            left = 64 if self.limit is None else min(64, self.limit - self.groups)
            if left <= 0:
                return
            batch = await streams.read_group(
                self.r,
                [tasks],
                names.ROLLOUT_GROUP,
                "synthetic",
                task_pb2.Task,
                count=left,
                block_ms=200,
            )
            for _, entry_id, task in batch:
                assert isinstance(task, task_pb2.Task)
                if self.allowed is not None:
                    await self.allowed.acquire()
                try:
                    self.version = await self.store.latest(self.model) or 0
                except grpc.aio.AioRpcError:  # the store is away: the old weights serve on
                    pass
                version = self.version
                trajs = [self.trajectory(task, i, version) for i in range(task.group_size)]
                async with self.r.pipeline(transaction=True) as pipe:
                    for t in trajs:
                        await streams.add(pipe, names.trajectories_stream(self.run), t)
                    pipe.hincrby(names.run_state(self.run), "trajectories_produced", len(trajs))
                    pipe.xack(tasks, names.ROLLOUT_GROUP, entry_id)
                    await pipe.execute()
                self.produced += [t.trajectory_id for t in trajs]
                self.first += trajs[: max(0, KEEP - len(self.first))]
                self.groups += 1
