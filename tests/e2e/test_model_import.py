"""`treadle model import SRC NAME`: a model from outside becomes one the stack serves and
trains, published to the weight store once."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.support.cli import treadle
from tests.support.services import start_service
from treadle_common.clients.weights import WeightStoreClient
from treadle_common.model.importing import RECORD

pytestmark = [pytest.mark.e2e]


@pytest.fixture
def store(infra, tmp_path):
    (tmp_path / "ws").mkdir()
    svc = start_service("weight-store", infra, tmp_path / "ws")
    yield svc
    svc.stop_checked()


def versions(address: str, model: str) -> list[int]:
    async def go() -> list[int]:
        client = WeightStoreClient(address, token=os.environ["TREADLE_TOKEN"])
        try:
            return [v.version for v in await client.list_versions(model)]
        finally:
            await client.close()

    return asyncio.run(go())


def test_an_hf_directory_imports_and_publishes_once(store, tiny_model, tmp_path):
    out = tmp_path / "imported"
    args = ("model", "import", str(tiny_model), "tiny-imported", "--out", str(out))
    first = treadle(*args, "--store", store.grpc_addr, env=dict(os.environ), cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "wrote" in first.stdout and "tiny-imported@1 published" in first.stdout
    record = json.loads((out / RECORD).read_text())
    assert record["kind"] == "hf" and record["architecture"] == "LlamaForCausalLM"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # again: the directory is reused and the store already holds exactly it
    again = treadle(*args, "--store", store.grpc_addr, env=dict(os.environ), cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "reused" in again.stdout and "tiny-imported@1 (already in the store)" in again.stdout
    assert versions(store.grpc_addr, "tiny-imported") == [1]
    # what is not a model, a bad name, a directory holding another import: refused, exit 2
    (tmp_path / "empty").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / RECORD).write_text(json.dumps({"source": "elsewhere", "source_sha256": "0"}))
    refused = {
        "no model": ("model", "import", str(tmp_path / "empty"), "x", "--no-publish"),
        "bad name": ("model", "import", str(tiny_model), "no/slash", "--no-publish"),
        "other import": ("model", "import", str(tiny_model), "y", "--out", str(other)),
    }
    for why, command in refused.items():
        answer = treadle(*command, env=dict(os.environ), cwd=tmp_path)
        assert answer.returncode == 2, (why, answer.stdout, answer.stderr)
    assert "config.json" in treadle(*refused["no model"], env=dict(os.environ), cwd=tmp_path).stderr
