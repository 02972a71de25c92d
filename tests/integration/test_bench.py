"""`treadle bench ...` prints one JSON line: our path, the raw baseline, the ratio.
Behaviour only (bytes, keys, consistency); benchmarks are not timed tests."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from treadle_sim import calibrate

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TREADLE = str(Path(sys.executable).parent / "treadle")


def bench(*args: str) -> dict:
    result = subprocess.run(
        [TREADLE, "bench", *args, "--json"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def test_bench_weights_json_line():
    report = bench(
        "weights", "--size-mb", "16", "--num-tensors", "8", "--changed", "0.25", "--replicas", "2"
    )
    for key in (
        "publish_gbps",
        "fetch_gbps",
        "raw_grpc_gbps",
        "publish_ratio",
        "fetch_ratio",
        "delta_bytes_ratio",
        "fanout8_fetch_gbps",
    ):
        assert report[key] > 0, key
    assert report["delta_bytes_ratio"] == 0.25  # 2 of 8 equal tensors changed: a quarter travels


def test_bench_weights_and_rollout_take_an_imported_model(tiny_model):
    """`--model` names a directory (or an import's NAME): the model's own tensors travel,
    and rollout serves it."""
    from safetensors import safe_open

    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    report = bench("weights", "--model", str(tiny_model), "--replicas", "2")
    assert report["model"] == tiny_model.name and report["num_tensors"] == len(names)
    assert report["publish_gbps"] > 0 and report["fetch_gbps"] > 0
    short = ("--prompts", "2", "--max-new-tokens", "2", "--rounds", "1", "--swaps", "1")
    report = bench("rollout", "--model", str(tiny_model), *short)
    assert report["model"] == tiny_model.name and report["swaps"] == 1
    missing = subprocess.run(
        [TREADLE, "bench", "weights", "--model", "no-such-import"], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "treadle model import" in missing.stderr


@pytest.mark.docker  # the docker sandbox backend's row
def test_bench_env_json_line():
    report = bench("env", "--sessions", "4", "--seconds", "1")
    assert report["env"] == "arith" and report["sessions"] == 4
    assert report["steps_per_s"] > 0 and report["raw_grpc_rps"] > 0 and report["ratio"] > 0
    assert 0 < report["p50_ms"] <= report["p99_ms"]


# Ratios are printed to 3 decimals, so a small ratio (0.034) is only good to about 1.5%:
# the comparisons allow that rounding (abs=1e-3) besides the relative 1%.


def test_bench_reward_json_line():
    report = bench("reward", "--requests", "20", "--concurrency", "4", "--rounds", "1000")
    assert report["scores_per_s_1"] > 0 and report["scores_per_s_2"] > 0 and report["p99_ms"] > 0
    assert report["scaling"] == pytest.approx(
        report["scores_per_s_2"] / report["scores_per_s_1"], rel=0.01, abs=1e-3
    )


def test_bench_capacity_measures_the_control_plane_for_the_simulator():
    """Real redis-server and nats-server: every workload costs their processes CPU, the
    fitted costs load as the simulator's `Infra`, and the baseline ran the same bytes."""
    from treadle_sim.scenario import Infra

    report = bench("capacity", "--groups", "40")
    ours, raw = report["redis"]["ours"], report["redis"]["raw"]
    assert [r["bytes_per_group"] for r in ours] == [r["bytes_per_group"] for r in raw]
    assert sum(r["us_per_group"] for r in ours) > 0 and report["redis"]["ours_over_raw"] > 0
    assert sum(r["us_per_group"] for r in report["nats"]) > 0
    assert all(r["us_per_group"] > 0 for r in report["ingest"])  # this process, fine-grained
    infra = Infra.model_validate(report["infra"])
    assert infra.trajectory_bytes_per_prompt_token > infra.trajectory_bytes_per_generated_token
    assert infra.ingest.s_per_kib > 0 or infra.ingest.s_per_trajectory > 0


def test_bench_rollout_json_line():
    report = bench(
        "rollout",
        "--prompts",
        "4",
        "--max-new-tokens",
        "4",
        "--rounds",
        "1",
        "--swaps",
        "2",
        "--torch-threads",
        "1",
    )
    assert report["engine"] == "hf" and report["prompts"] == 4 and report["torch_threads"] == 1
    assert report["service_tokens_per_s"] > 0 and report["raw_engine_tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(
        report["service_tokens_per_s"] / report["raw_engine_tokens_per_s"], rel=0.01, abs=1e-3
    )
    # plain transformers generate on the same prompts: the engine's own baseline
    assert report["hf_generate_tokens_per_s"] > 0
    assert report["engine_over_hf_generate"] == pytest.approx(
        report["raw_engine_tokens_per_s"] / report["hf_generate_tokens_per_s"], rel=0.01, abs=1e-3
    )
    assert report["openai_stream_tokens_per_s"] > 0 and report["openai_stream_ttft_ms_p50"] > 0
    assert report["openai_stream_ratio"] == pytest.approx(
        report["openai_stream_tokens_per_s"] / report["openai_raw_engine_tokens_per_s"],
        rel=0.01,
        abs=1e-3,
    )
    assert report["swaps"] == 2  # both published versions were swapped in by the service
    assert 0 <= report["swap_pause_ms_p50"] <= report["swap_pause_ms_max"]


def test_bench_trainer_json_line(tmp_path):
    report = bench(
        *("trainer", "--steps", "3", "--groups", "2", "--group-size", "2"),
        *("--completion-len", "8", "--profile-dir", str(tmp_path)),
    )
    assert report["bench"] == "trainer" and report["loss"] == "ppo"
    assert report["deterministic"] is True  # the service's default, the raw loop's too
    assert report["sequences_per_step"] == 4 and len(report["step_s"]) == 3
    # one more step of the service (trainer.profile_steps) and of the plain loop, profiled and
    # not measured; the service's trace shows the step's phases
    assert report["measured_steps"] == [3] and report["profile_dir"] == str(tmp_path)
    service, raw = tmp_path / "single", tmp_path / "raw"
    assert sorted(p.name for p in service.iterdir()) == ["step-4.json.gz", "step-4.txt"]
    assert sorted(p.name for p in raw.iterdir()) == ["step-3.json.gz", "step-3.txt"]
    table = (service / "step-4.txt").read_text()
    phases = ("pack", "forward_backward", "logprobs", "optim_step")
    assert all(f"treadle.{name}" in table for name in phases), table
    assert "raw.forward" in (raw / "step-3.txt").read_text()
    assert report["service_tokens_per_s"] > 0 and report["raw_tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(
        report["service_tokens_per_s"] / report["raw_tokens_per_s"], rel=0.01, abs=1e-3
    )
    assert 0 < report["publish_s_p50"] < report["step_s_p50"]


def test_bench_overlap_json_line():
    report = bench(
        "overlap", *("--seconds", "1", "--rounds", "1", "--size-mb", "8", "--num-tensors", "4")
    )
    assert report["bench"] == "overlap" and report["tensors"] == 4 and report["state_mb"] == 8
    assert report["alone_iterations_per_s"] > 0
    for phase in ("inline", "worker"):  # each phase published, through its own path
        assert report[f"{phase}_publishes"] >= 1 and report[f"{phase}_publish_s_p50"] > 0
        assert report[f"{phase}_over_alone"] == pytest.approx(
            report[f"{phase}_iterations_per_s"] / report["alone_iterations_per_s"], rel=0.01
        )


def test_bench_tinker_json_line():
    report = bench(
        "tinker",
        *("--steps", "2", "--rounds", "1", "--batch", "2", "--seq-len", "16", "--rank", "4"),
        *("--prompts", "2", "--num-samples", "2", "--max-tokens", "4"),
    )
    assert report["bench"] == "tinker" and report["lora_rank"] == 4
    assert report["sdk_steps_per_s"] > 0 and report["inprocess_steps_per_s"] > 0
    assert report["train_ratio"] == pytest.approx(
        report["sdk_steps_per_s"] / report["inprocess_steps_per_s"], rel=0.01, abs=1e-3
    )
    assert report["sdk_sample_tokens_per_s"] > 0 and report["rollout_tokens_per_s"] > 0
    # the adapter is what moves: a small fraction of the full weights' bytes
    assert 0 < report["adapter_publish_bytes"] < report["full_publish_bytes"] / 4


def test_bench_trainer_megatron_reports_itself_next_to_single():
    report = bench(
        "trainer",
        *("--backend", "megatron", "--tensor-parallel", "2"),
        *("--steps", "3", "--groups", "2", "--group-size", "2", "--completion-len", "8"),
    )
    assert report["backend"] == "megatron" and report["tensor_parallel"] == 2
    assert report["service_tokens_per_s"] > 0 and report["single_tokens_per_s"] > 0
    assert report["megatron_over_single"] == pytest.approx(
        report["service_tokens_per_s"] / report["single_tokens_per_s"], rel=0.01, abs=1e-3
    )
    assert len(report["step_s"]) == 3 and report["single_step_s_p50"] > 0


def test_bench_e2e_runs_both_modes_on_one_stack():
    root = Path(__file__).resolve().parents[2]
    quality = [  # the learning half, shortened: a fixed 20-step warm-up, 6 steps per mode
        *("--quality-set", "sft.steps=20"),  # (more versions than the store keeps: the warm-up's
        *("--quality-set", "sft.target_reward=null"),  # stays, pinned, for the async run)
        *("--quality-set", "trainer.num_steps=6"),
        *("--quality-set", "eval.num_tasks=10"),
    ]
    report = bench(
        "e2e", "--steps", "3", "--recipe", str(root / "recipes" / "agentic.yaml"), *quality
    )
    assert report["steps"] == 3 and report["workload"] == "agentic.yaml"
    assert report["sync_s"] > 0 and report["async_s"] > 0
    assert report["speedup"] == pytest.approx(
        report["sync_s"] / report["async_s"], rel=0.01, abs=1e-3
    )
    assert report["max_staleness_seen_sync"] == 0  # sync: every trajectory is on-policy
    assert 0 <= report["max_staleness_seen"] <= report["max_staleness"]
    for key in ("trainer_idle_fraction_sync", "trainer_idle_fraction_async"):
        assert 0 <= report[key] <= 1, key
    for key in ("rollout_engine_busy_fraction_sync", "rollout_engine_busy_fraction_async"):
        assert 0 < report[key] <= 1, key
    assert 0 <= report["eval_reward_sync"] <= 1 and 0 <= report["eval_reward_async"] <= 1
    for mode in ("sync", "async"):  # each part's cost, for the simulator's calibration
        parts = report["components"][mode]
        assert parts["decode_steps"] > 0 and parts["decode_rows"] >= parts["decode_steps"]
        assert parts["train_s"] > 0 and parts["engine_s_per_decode_step"] > 0
        used = parts["service_cpu_s"]  # each service's own process, read by psutil
        assert set(used) >= {"rollout", "env-gateway", "reward", "trainer", "weight-store"}
        assert used["rollout"] > 0 and used["env-gateway"] > 0 and used["trainer"] > 0
    played = report["components"]["sync"]["episode_env_s"]  # every task the sync run trained
    assert len(played) == report["steps"] * report["tasks_per_step"]
    assert all(len(samples) == report["group_size"] for samples in played)
    assert all(s > 0 for samples in played for s in samples)  # each waited for its tool calls
    predicted = calibrate.e2e(report, cores=2)
    assert predicted["sync"]["measured_s"] == report["sync_s"]
    assert predicted["sync"]["predicted_s"] > 0 and predicted["async"]["predicted_s"] > 0
    runs = Path(report["outputs"]) / "workload" / "runs"
    for mode in ("sync", "async"):  # treadle run's own outputs, exactly-once checked
        summary = json.loads((runs / f"bench-{mode}" / "summary.json").read_text())
        assert summary["exactly_once"] and summary["steps"] == 3
    # the learning half: both modes trained from the sync run's warm-up version
    assert report["quality_workload"] == "arith_latency.yaml" and report["quality_steps"] == 6
    quality_runs = Path(report["outputs"]) / "quality" / "runs"
    sync_run, async_run = (quality_runs / f"bench-{mode}" for mode in ("sync", "async"))
    warmed = yaml.safe_load((sync_run / "config.yaml").read_text())["model"]["init_version"]
    assert (
        yaml.safe_load((async_run / "config.yaml").read_text())["model"]["init_version"] == warmed
    )
    assert not [
        line for line in (async_run / "metrics.jsonl").read_text().splitlines() if '"sft"' in line
    ]
    sync_summary = json.loads((sync_run / "summary.json").read_text())
    assert report["eval_start"] == sync_summary["eval_after_sft"]
    assert report["eval_sync"] == sync_summary["eval_end"]
    assert report["eval_async"] == json.loads((async_run / "summary.json").read_text())["eval_end"]
    assert report["eval_gain_sync"] == pytest.approx(report["eval_sync"] - report["eval_start"])
    assert report["eval_gap_async_vs_sync"] == pytest.approx(
        report["eval_async"] - report["eval_sync"]
    )
    assert 0 <= report["quality_max_staleness_seen"] <= report["quality_max_staleness"]


def test_bench_learn_reports_rl_lift_per_seed():
    short = [  # a fixed 20-step warm-up and 2 RL steps: behaviour, not learning
        *("--set", "sft.steps=20"),
        *("--set", "sft.target_reward=null"),
        *("--set", "trainer.num_steps=2"),
        *("--set", "eval.num_tasks=10"),
        *("--set", "eval.every=0"),
        *("--set", "eval.min_rl_improvement=null"),
    ]
    report = bench("learn", "--seeds", "0,1", *short)
    assert [s["seed"] for s in report["seeds"]] == [0, 1] and report["all_exit_zero"]
    for s in report["seeds"]:
        assert s["held_out_tasks"] == 10 and s["sft_steps"] == 20 and s["rl_steps"] == 2
        assert s["eval_start"] == 0.0  # the untrained model answers no sum right
        assert s["rl_lift"] == pytest.approx(s["eval_end"] - s["eval_after_sft"])
        assert s["generated_tokens_per_s"] > 0 and s["trained_tokens_per_s"] > 0
        assert s["weight_bytes_per_step"] > 0
    assert report["min_rl_lift"] == min(s["rl_lift"] for s in report["seeds"])
    outputs = Path(report["outputs"]) / "runs"
    assert sorted(p.name for p in outputs.iterdir()) == ["learn-seed0", "learn-seed1"]


def test_bench_step_runs_three_ways_from_one_warm_up():
    short = [  # a fixed 10-step warm-up, then 6 steps each way
        *("--set", "sft.steps=10"),
        *("--set", "sft.target_reward=null"),
    ]
    report = bench("step", "--steps", "6", *short)
    assert report["workload"] == "step.yaml" and report["steps"] == 6
    assert report["tasks_per_step"] == 8 and report["group_size"] == 8
    for way in ("inproc", "sync", "async"):
        assert report[f"{way}_s_per_step"] > 0, way
    assert report["sync_ratio"] == pytest.approx(
        report["inproc_s_per_step"] / report["sync_s_per_step"], rel=0.01, abs=1e-3
    )
    assert report["async_over_sync"] == pytest.approx(
        report["async_s_per_step"] / report["sync_s_per_step"], rel=0.01, abs=1e-3
    )
    assert 0 < report["publish_p50_s"] <= report["publish_p99_s"]
    assert report["log_errors"] == 0, report["log_error_samples"]
    sync, asyn = report["breakdown"]["sync"], report["breakdown"]["async"]
    assert sync["versions_published"] == 5  # steps 2..6: every sync step publishes
    assert 1 <= asyn["versions_published"] <= 5  # async may coalesce
    runs = Path(report["outputs"]) / "stack" / "runs"
    for mode in ("sync", "async"):
        summary = json.loads((runs / f"bench-{mode}" / "summary.json").read_text())
        assert summary["exactly_once"] and summary["steps"] == 6
