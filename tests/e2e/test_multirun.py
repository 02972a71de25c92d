"""Many runs, one fleet: concurrent `treadle run`s on one `treadle up` stack (real CLI,
real services, private infrastructure and free ports)."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT
from tests.e2e.test_cli import TREADLE, treadle
from treadle_common import auth
from treadle_common.clients.weights import WeightStoreClient, chunk_positions

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _run(run_id: str, seed: int, env: dict, cwd: Path, *sets: str) -> subprocess.Popen:
    overrides = [f"run_id={run_id}", f"trainer.seed={seed}", *sets]
    args = [a for o in overrides for a in ("--set", o)]
    return subprocess.Popen(
        [TREADLE, "run", str(ROOT / "recipes/skeleton.yaml"), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


async def _chunk_positions(addr: str, token: str, model: str) -> list[dict]:
    store = WeightStoreClient(addr, token=token)
    try:
        versions = await store.list_versions(model)
        return [chunk_positions(await store.get_manifest(model, v.version)) for v in versions]
    finally:
        await store.close()


def test_two_lora_runs_at_once_on_one_stack_each_train_and_export_their_own(cli_env, tmp_path):
    """The issue's reproduction: two LoRA runs of the skeleton, different seeds, started at
    once on one stack. Each publishes under its own policy model over the one shared base,
    rollout serves both as adapters on its one model, and each run trains exactly once and
    exports its own merged adapter."""
    up = treadle("up", "--detach", env=cli_env, cwd=tmp_path, timeout=240)
    try:
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        lora = ("trainer.lora.rank=8", "trainer.loss=cross_entropy", "trainer.lr=0.01")
        procs = {rid: _run(rid, i, cli_env, tmp_path, *lora) for i, rid in enumerate(["la", "lb"])}
        outs = {rid: p.communicate(timeout=400)[0] for rid, p in procs.items()}
        for rid, p in procs.items():
            assert p.returncode == 0, outs[rid][-4000:]
        runs = tmp_path / ".treadle" / "runs"
        summaries = {rid: json.loads((runs / rid / "summary.json").read_text()) for rid in procs}
        for summary in summaries.values():
            assert summary["state"] == "succeeded" and summary["exactly_once"] is True
            assert summary["trajectories_trained"] == 48 and summary["duplicates"] == 0
            # its own version sequence: the new adapter, then one per step
            assert summary["weight_store_versions"] == [1, 2, 3, 4]
            assert summary["rollout_policy_version"] == 4
        spec = json.loads((tmp_path / ".treadle" / "stack.json").read_text())["spec"]
        token = (tmp_path / ".treadle" / "auth" / "admin.token").read_text()
        info = httpx.get(
            f"http://127.0.0.1:{spec['ports']['rollout']['http']}/v1/info",
            headers=auth.bearer(token),
        ).json()
        assert info["policies"] == {"tiny.la": 4, "tiny.lb": 4}, info["policies"]
        assert info["policy_version"] <= 2  # the model's own weights never changed
        merged = {
            rid: load_file(str(tmp_path / s["final_model_dir"] / "model.safetensors"))
            for rid, s in summaries.items()
        }
        base = load_file(str(tmp_path / ".treadle/models/tiny/model.safetensors"))
        moved = {rid: [k for k in base if not (m[k] == base[k]).all()] for rid, m in merged.items()}
        assert moved["la"] and moved["lb"], moved  # each exported its adapter, merged
        assert any(not (merged["la"][k] == merged["lb"][k]).all() for k in moved["la"])
        # the base, published by each run that found none, is one set of chunks
        addr = f"127.0.0.1:{spec['ports']['weight-store']['grpc']}"
        bases = asyncio.run(_chunk_positions(addr, token, "tiny"))
        assert 1 <= len(bases) <= 2 and all(b == bases[0] for b in bases)
    finally:
        down = treadle("down", env=cli_env, cwd=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
