"""The FSDP2 backend under a real `torchrun` (2 ranks, gloo on CPU) against the single-process
backend on the same batch: same loss, gradient norm, update and checkpoint round trip."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.integration
WORKER = Path(__file__).with_name("fsdp_worker.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def run_worker(cmd: list[str], out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def test_two_rank_fsdp_matches_single_process(tiny_model, tmp_path):
    single = run_worker(
        [sys.executable, str(WORKER), str(tiny_model), str(tmp_path / "single.json")],
        tmp_path / "single.json",
    )
    fsdp = run_worker(
        [
            TORCHRUN,
            "--nproc-per-node",
            "2",
            "--standalone",
            str(WORKER),
            str(tiny_model),
            str(tmp_path / "fsdp.json"),
        ],
        tmp_path / "fsdp.json",
    )
    assert single["micro_batches"] == fsdp["micro_batches"] == 4  # uneven: 2 per rank
    for key in ("first", "second", "third"):
        assert fsdp[key]["num_tokens"] == single[key]["num_tokens"] > 0
        for stat in ("loss", "entropy", "kl", "clip_fraction"):
            assert fsdp[key][stat] == pytest.approx(single[key][stat], rel=1e-4, abs=1e-6), stat
    assert fsdp["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    # the update moved the policy away from the frozen reference, identically on both
    assert single["second"]["kl"] > 0 and single["second"]["loss"] != single["first"]["loss"]
    assert fsdp["checksum"] == pytest.approx(single["checksum"], rel=1e-6)
    assert fsdp["meta_step"] == single["meta_step"] == 1
    # decoupled PPO: the first update's ratio to the snapshot is exactly 1; after an update
    # the policy has moved from the proximal snapshot, and both backends agree by how much
    assert single["first"]["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert abs(single["third"]["ratio"] - 1.0) > 1e-5
    assert fsdp["third"]["ratio"] == pytest.approx(single["third"]["ratio"], rel=1e-5)


def test_checkpoint_of_another_model_is_refused(tiny_model, tmp_path):
    from treadle_trainer.backends import BackendSpec, TorchBackend
    from treadle_trainer.backends.single import IncompatibleCheckpoint

    backend = TorchBackend(BackendSpec(model_dir=str(tiny_model)))
    backend.save(tmp_path / "ckpt", {"step": 3})
    assert backend.load(tmp_path / "ckpt")["step"] == 3
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    meta["signature"]["lm_head.weight"] = [7, 7]
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(IncompatibleCheckpoint, match="different model.*lm_head.weight"):
        backend.load(tmp_path / "ckpt")


@pytest.mark.parametrize("ping_every", [0.5, 0.0])
def test_collectives_time_out_in_seconds_and_an_idle_leader_keeps_followers(tmp_path, ping_every):
    """With a 2 s collective timeout, a leader idle for 5 s keeps its follower by pinging it;
    without the pings the follower's wait fails (a hung or dead rank ends the job in the
    configured time, not in a day)."""
    cmd = [
        TORCHRUN,
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(WORKER.with_name("dist_idle_worker.py")),
        str(ping_every),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TREADLE_TRAINER_DIST_TIMEOUT_S": "2"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    if ping_every:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    else:
        assert result.returncode != 0
        assert "timed out" in (result.stdout + result.stderr).lower()
