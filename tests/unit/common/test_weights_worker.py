"""`PublishWorker` without a store: what a memfd carries comes back whole, and a child that
dies before answering is started once more, then the publish fails, nothing left running."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from treadle_common.clients.torch_weights import state_dict_to_raw
from treadle_common.clients.weights_worker import (
    PublishWorker,
    WorkerDied,
    read_payload,
    write_payload,
)


def test_a_payload_comes_back_whole():
    state = {
        "w": torch.arange(1000, dtype=torch.float32),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "none": torch.zeros(0),
    }
    fields = {"version": 4, "metadata": {"run_id": "r"}}
    fd = write_payload("m", state_dict_to_raw(state), {"config.json": b"{}"}, fields)
    try:
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
            model, tensors, assets, got = read_payload(mm)
            assert model == "m" and got == fields and assets == {"config.json": b"{}"}
            assert {k: (t.dtype, t.shape) for k, t in tensors.items()} == {
                "w": ("F32", (1000,)),
                "b": ("BF16", (3,)),
                "none": ("F32", (0,)),
            }
            assert all(
                bytes(tensors[k].data) == bytes(raw.data)
                for k, raw in state_dict_to_raw(state).items()
            )
            del tensors
    finally:
        os.close(fd)


async def test_a_child_that_dies_twice_fails_the_publish_and_is_reaped(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # every child exits at once
    worker = PublishWorker("127.0.0.1:1")
    with pytest.raises(WorkerDied):
        await worker.publish("m", state_dict_to_raw({"w": torch.ones(4)}))
    assert worker.started == 2 and worker.proc is None and worker.sock is None
    await worker.close()
