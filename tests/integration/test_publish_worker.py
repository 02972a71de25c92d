"""`PublishWorker`: `WeightStoreClient.publish` from a child process, against a real
weight-store: the same version as a publish from this process, the store's errors with their
gRPC status, a killed child replaced without a second version, a cancelled publish leaving
nothing to answer later, and every child reaped."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
import torch

from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.clients.weights import WeightStoreClient, chunk_positions
from treadle_common.clients.weights_worker import PublishWorker

pytestmark = pytest.mark.integration
ASSETS = {"config.json": b'{"vocab_size": 7}', "tokenizer.json": b"{}" * 1000}


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * 2**20, generator=g),  # 12 MiB: three chunks
        "small": torch.randn(10, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0),
    }


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_worker_publishes_what_this_process_would(weight_store):
    store = WeightStoreClient(weight_store.grpc_addr)
    worker = PublishWorker(weight_store.grpc_addr)
    try:
        ours = await worker.publish(
            "w", state_dict_to_raw(state(0)), assets=ASSETS, version=5, trainer_step=2,
            metadata={"run_id": "r1"},
        )  # fmt: skip
        assert ours.version == 5 and ours.bytes_received > 12 * 2**20
        inline = await store.publish("inline", state_dict_to_raw(state(0)), assets=ASSETS)
        mine, theirs = await store.get_manifest("w", 5), await store.get_manifest("inline", 1)
        assert chunk_positions(mine) == chunk_positions(theirs)
        assert [(t.name, t.dtype, list(t.shape)) for t in mine.tensors] == [
            (t.name, t.dtype, list(t.shape)) for t in theirs.tensors
        ]
        assert {a.name for a in mine.assets} == set(ASSETS)
        assert mine.trainer_step == 2 and mine.metadata["run_id"] == "r1"
        assert inline.bytes_received == 0  # every chunk was already there: the same bytes

        # the store's refusal comes back as the gRPC error it was
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.publish("w", state_dict_to_raw(state(1)), version=5)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert worker.started == 1  # one child served all three
    finally:
        pid = worker.proc.pid if worker.proc else None
        await worker.close()
        await store.close()
    assert worker.proc is None and pid is not None and gone(pid)


async def test_a_killed_worker_is_replaced_and_publishes_once(weight_store):
    store = WeightStoreClient(weight_store.grpc_addr)
    worker = PublishWorker(weight_store.grpc_addr)
    try:
        await worker.publish("k", state_dict_to_raw(state(0)), version=1)
        assert worker.proc is not None
        first = worker.proc.pid
        os.kill(first, signal.SIGKILL)
        worker.proc.wait()
        done = await worker.publish("k", state_dict_to_raw(state(1)), version=2)
        assert done.version == 2 and worker.started == 2 and worker.proc.pid != first
        assert [v.version for v in await store.list_versions("k")] == [1, 2]
    finally:
        await worker.close()
        await store.close()


async def test_a_cancelled_publish_ends_its_worker_and_the_next_one_is_answered(weight_store):
    store = WeightStoreClient(weight_store.grpc_addr)
    worker = PublishWorker(weight_store.grpc_addr)
    big = {"w": torch.randn(64 * 2**20)}  # 256 MiB: still streaming when cancelled
    try:
        task = asyncio.create_task(worker.publish("c", state_dict_to_raw(big), version=1))
        while worker.proc is None:
            await asyncio.sleep(0.01)
        child = worker.proc.pid
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert worker.proc is None and gone(child)  # killed and reaped
        done = await worker.publish("c", state_dict_to_raw(state(2)), version=2)
        assert done.version == 2 and worker.started == 2
    finally:
        await worker.close()
        await store.close()
