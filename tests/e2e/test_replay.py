"""`treadle replay`: a run's training re-run from its recorded schedule alone, bit for bit,
after real runs of the stack (every service its own process)."""

import json

import pytest

from tests.support.cli import run_recipe, treadle
from tests.support.services import ROOT
from treadle_common.proto.treadle.v1 import schedule_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
AGENTIC = {  # recipes/agentic.yaml, shorter: multi-turn, async, tool latency injected
    "model.path": ".treadle/models/tiny",
    "model.name": "tiny",
    "model.tiny_hidden_size": "128",
    "env.options.latency": "{distribution: lognormal, median_ms: 20, sigma: 1.0, max_ms: 500}",
    "eval.num_tasks": "0",
    "trainer.num_steps": "8",
    "trainer.tasks_per_step": "4",
    "trainer.max_staleness": "2",
    # the tiny model never guesses right: a reward-weighted loss would leave its weights
    # alone; cross-entropy on the sampled turns moves them every step, over 2 minibatches
    "trainer.loss": "cross_entropy",
    "trainer.lr": "0.001",
}


def _replay(*args: str, env: dict, cwd) -> dict:
    done = treadle("replay", *args, "--json", env=env, cwd=cwd, timeout=300)
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _trainer_warnings(cwd) -> list[str]:
    """The trainer's warnings, errors and restores (a resumed run, a lease renewal that failed):
    what a failed replay's message shows beside where it differed."""
    log = cwd / ".treadle" / "logs" / "trainer.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    words = ("warn", "error", "restored")
    return [line[:300] for line in lines if any(w in line.lower() for w in words)][-20:]


def _only_run(cwd) -> str:
    (run_dir,) = (cwd / ".treadle" / "runs").iterdir()
    return run_dir.name


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_async_multi_turn_run_replays_to_the_same_weights_bit_for_bit(cli_env, tmp_path, lora):
    overrides = dict(AGENTIC)
    if lora:
        overrides |= {"trainer.lora.rank": "4", "trainer.lr": "0.01", "trainer.minibatches": "1"}
    done = run_recipe(ROOT / "recipes/agentic.yaml", overrides, cli_env, tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = _only_run(tmp_path)
    steps = sorted((tmp_path / ".treadle/runs" / run / "schedule").glob("step-*.binpb"))
    assert len(steps) == 8
    records = [schedule_pb2.ScheduleStep.FromString(p.read_bytes()) for p in steps]
    trained = [(r, e.trajectory) for r in records for g in r.groups for e in g.entries]
    assert max(t.num_turns for _, t in trained) > 1  # multi-turn episodes, recorded
    behind = [r.version - min(v for v in t.token_versions if v >= 0) for r, t in trained]
    assert max(behind) >= 1  # async: steps trained on what older versions generated
    report = _replay(run, env=cli_env, cwd=tmp_path)
    assert report["identical"] is True, (
        f"differs at step {report['first_divergent_step']}: {report['divergence']}; "
        f"trainer warnings: {_trainer_warnings(tmp_path)}"
    )
    assert report["steps"] == report["recorded_steps"] == 8
    assert report["checked_digests"] == 2  # checkpoint_every 4: steps 4 and 8
    assert report["weights_sha256"] == report["recorded_sha256"] != ""
    # a replay up to step 4 ends on that step's recorded weights
    half = _replay(run, "--until", "4", env=cli_env, cwd=tmp_path)
    assert half["identical"] is True and half["steps"] == 4
    assert half["weights_sha256"] == half["recorded_sha256"] != report["weights_sha256"]
    # a replay that cannot match says where: step 6's recorded loss, nudged by one ulp
    path = steps[5]
    record = schedule_pb2.ScheduleStep.FromString(path.read_bytes())
    record.stats["loss"] = record.stats["loss"] + abs(record.stats["loss"]) * 1e-12 + 1e-300
    path.write_bytes(record.SerializeToString())
    broken = _replay(run, env=cli_env, cwd=tmp_path)
    assert broken["identical"] is False and broken["first_divergent_step"] == 6
    assert broken["divergence"].startswith("loss: recorded")


def test_diff_names_the_first_step_where_two_runs_differ(cli_env, tmp_path):
    runs = {}
    for seed in ("0", "1"):
        cwd = tmp_path / f"seed{seed}"
        cwd.mkdir()
        env = {**cli_env, "TREADLE_STATE_DIR": str(cwd / ".treadle")}
        done = run_recipe(
            ROOT / "recipes/skeleton.yaml", {"trainer.seed": seed}, env, cwd, timeout=300
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs[seed] = cwd / ".treadle/runs" / _only_run(cwd)
    differ = _replay(str(runs["0"]), "--diff", str(runs["1"]), env=cli_env, cwd=tmp_path)
    assert differ["first_divergent_step"] == 1 and differ["divergence"] == "trained other data"
    same = _replay(str(runs["0"]), "--diff", str(runs["0"]), env=cli_env, cwd=tmp_path)
    # (two runs of the same seed may differ too: batched generation pads by arrival)
    assert same["first_divergent_step"] is None and same["steps_compared"] == 3


@pytest.mark.parametrize(
    "backend", [{"trainer.backend": "fsdp"}, {"trainer.backend": "megatron",
                                              "trainer.tensor_parallel": "2"}],
    ids=["fsdp", "megatron"],
)  # fmt: skip
def test_a_run_on_two_ranks_replays_bit_for_bit_on_two_ranks(cli_env, tmp_path, backend):
    """A stack whose trainer is a 2-rank torchrun job (FSDP2 shards, or megatron's tensor
    parallel), a 3-step run on it; `treadle replay` starts a 2-rank job of its own and ends
    on the run's weights."""
    up = treadle("up", "--detach", "--trainer-ranks", "2", env=cli_env, cwd=tmp_path, timeout=300)
    try:
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        overrides = {**backend, "trainer.loss": "ppo", "trainer.checkpoint_every": "3"}
        done = run_recipe(ROOT / "recipes/skeleton.yaml", overrides, cli_env, tmp_path, 400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        down = treadle("down", env=cli_env, cwd=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr
    run = _only_run(tmp_path)
    header = json.loads((tmp_path / ".treadle/runs" / run / "schedule/run.json").read_text())
    assert header["ranks"] == 2 and header["config"]["trainer"]["backend"] == backend[
        "trainer.backend"]  # fmt: skip
    report = _replay(run, env=cli_env, cwd=tmp_path)
    assert report["identical"] is True, report
    assert report["steps"] == 3 and report["checked_digests"] == 1
    assert report["weights_sha256"] == report["recorded_sha256"] != ""
