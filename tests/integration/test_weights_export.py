"""`treadle weights export` round trip: publish a model, export it, load it with transformers."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle_common.clients.torch_weights import TorchWeightClient, model_assets

pytestmark = pytest.mark.integration


def test_export_round_trip_loads_identical_tensors(service, tiny_model, tmp_path):
    ws = service("weight-store")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # a "trained" version, different from the files on disk
    state = model.state_dict()

    async def publish() -> int:
        client = TorchWeightClient(ws.grpc_addr)
        version = await client.publish(state, "tiny", step=7, assets=model_assets(tiny_model))
        await client.close()
        return version

    version = asyncio.run(publish())
    out = tmp_path / "export"
    treadle = str(Path(sys.executable).parent / "treadle")
    env = {**os.environ, "TREADLE_WEIGHT_STORE_ADDR": ws.grpc_addr}
    result = subprocess.run(
        [treadle, "weights", "export", "tiny", str(version), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert (
        AutoTokenizer.from_pretrained(out).chat_template
        == AutoTokenizer.from_pretrained(tiny_model).chat_template
    )

    missing = subprocess.run(
        [treadle, "weights", "export", "tiny", "99", str(tmp_path / "x")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        missing.returncode == 1
        and "NOT_FOUND" in missing.stderr
        and "no version 99" in missing.stderr
    )
