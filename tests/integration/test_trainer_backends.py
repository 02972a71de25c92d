"""The FSDP2 and megatron-core backends under a real `torchrun` (2 ranks, gloo on CPU) against
the single-process backend on the same batch: same loss, gradient norm, update and checkpoint
round trip."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.services import free_port

pytestmark = pytest.mark.integration
WORKER = Path(__file__).resolve().parents[1] / "support" / "fsdp_worker.py"
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
    from treadle_trainer.errors import IncompatibleCheckpoint

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


def relative_differences(a: Path, b: Path) -> tuple[float, float]:
    """|x - y| / |x| over all the tensors of two HF-layout weight files, and its largest value
    for one tensor."""
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    assert sorted(x) == sorted(y)
    diff = sum(float((x[k] - y[k]).norm() ** 2) for k in x) ** 0.5
    norm = sum(float(x[k].norm() ** 2) for k in x) ** 0.5
    return diff / norm, max(float((x[k] - y[k]).norm() / x[k].norm()) for k in x)


def assert_same_weights(a: Path, b: Path) -> None:
    """Within 1e-4 relative over the model. One tensor may differ by up to 1e-3: a key bias
    (Qwen2) has a gradient of exactly zero in theory (softmax ignores a shift shared by every
    key), so its gradient is rounding noise that Adam's first step scales up to the learning
    rate; a mapping error would differ by order 1."""
    overall, worst = relative_differences(a, b)
    assert overall < 1e-4 and worst < 1e-3, (overall, worst)


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_model, tmp_path_factory) -> Path:
    """A tiny Qwen2 (QKV bias, untied head, 4 query heads in 2 groups) with the tiny tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "qwen2"
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("tp", "model"), [(2, "llama"), (1, "llama"), (2, "qwen2")], ids=["tp2", "tp1-dp2", "tp2-qwen2"]
)
def test_megatron_matches_single_process(tiny_model, tiny_qwen2, tmp_path, tp, model):
    """megatron-core over 2 gloo ranks (tensor parallel 2, or tensor parallel 1 x data
    parallel 2) against the single-process backend on the same batch: decoupled PPO + KL,
    then PPO + KL, the update, a checkpoint round trip and a step after it."""
    model_dir = tiny_model if model == "llama" else tiny_qwen2
    single = run_worker(
        [
            sys.executable,
            str(WORKER),
            str(model_dir),
            str(tmp_path / "single.json"),
            "--weights",
            str(tmp_path / "single.st"),
        ],
        tmp_path / "single.json",
    )
    mc = run_worker(
        [
            TORCHRUN,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(WORKER),
            str(model_dir),
            str(tmp_path / "mc.json"),
            "--megatron",
            str(tp),
            "--weights",
            str(tmp_path / "mc.st"),
        ],
        tmp_path / "mc.json",
    )
    for key in ("first", "second", "third"):
        assert mc[key]["num_tokens"] == single[key]["num_tokens"] > 0
        for stat in ("loss", "entropy", "kl", "clip_fraction", "ratio"):
            assert mc[key][stat] == pytest.approx(single[key][stat], rel=1e-4, abs=1e-6), stat
    assert single["second"]["kl"] > 0 and single["third"]["ratio"] != 1.0
    assert mc["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)
    assert_same_weights(tmp_path / "single.st", tmp_path / "mc.st")
    assert mc["restored_identical"] and single["restored_identical"]
    assert mc["resumed_grad_norm"] == pytest.approx(single["resumed_grad_norm"], rel=1e-4)
    resumed = [tmp_path / f"{name}.st.resumed" for name in ("single", "mc")]
    assert_same_weights(*resumed)


def test_megatron_refuses_what_its_ranks_cannot_run():
    from treadle_trainer.backends import check_backend

    with pytest.raises(ValueError, match="needs a multiple of 2 ranks; this trainer has 1"):
        check_backend("megatron", 2, 1)
    with pytest.raises(ValueError, match="need backend megatron"):
        check_backend("fsdp", 2, 1)
    check_backend("megatron", 1, 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_that_cannot_form_their_group_stop_within_a_minute_saying_why(rank, infra, tmp_path):
    """The trainer as one rank of a two-rank job whose other rank never starts: rank 0 (the
    service) and a follower each exit within 60 s with the reason in their output, instead of
    waiting out the collective timeout (10 min) with nothing logged."""
    from tests.support.services import TOKENS, free_ports
    from treadle_trainer.backends.group import RENDEZVOUS_FAILED

    http, grpc_port, master = free_ports(3)
    env = {
        **os.environ,
        "TREADLE_REDIS_URL": infra.redis_for("trainer"),
        "TREADLE_NATS_URL": infra.nats_for("trainer"),
        "TREADLE_STATE_DIR": str(tmp_path),
        "TREADLE_HTTP_PORT": str(http),
        "TREADLE_GRPC_PORT": str(grpc_port),
        "TREADLE_TOKEN": TOKENS["trainer"],
        "TREADLE_TRAINER_RENDEZVOUS_TIMEOUT_S": "5",
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master),
    }
    result = subprocess.run(
        [sys.executable, "-m", "treadle_trainer"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = result.stdout + result.stderr
    assert result.returncode == RENDEZVOUS_FAILED, out[-3000:]
    assert f"rank {rank} of 2: the process group did not form within 5s" in out, out[-3000:]
