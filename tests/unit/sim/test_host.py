"""The host model (`treadle_sim.host`) and the calibration against `treadle bench step`: work
on shared cores slows as the kernel would share them, and a bench result's components make
the sync step they add up to."""

from __future__ import annotations

import copy

import pytest
import simpy

from treadle_sim import calibrate, engine
from treadle_sim.host import Cpu

pytestmark = pytest.mark.unit


def _finish_times(cores: float | None, jobs: list[tuple[int, float]]) -> list[float]:
    env = simpy.Environment()
    cpu = Cpu(env, cores)
    done: list[float] = [0.0] * len(jobs)

    def job(i: int, threads: int, seconds: float):
        yield from cpu.work(i, threads, seconds)
        done[i] = env.now

    for i, (threads, seconds) in enumerate(jobs):
        env.process(job(i, threads, seconds))
    env.run()
    return done


def test_work_alone_or_without_a_host_takes_its_own_time():
    assert _finish_times(2, [(2, 1.0)]) == [1.0]
    assert _finish_times(None, [(2, 1.0), (1, 1.0), (1, 1.0)]) == [1.0, 1.0, 1.0]


def test_one_thread_jobs_share_the_cores_fairly():
    # 3 one-thread jobs on 2 cores: each at 2/3 until the short one ends, then alone
    short, long1, long2 = _finish_times(2, [(1, 1.0), (1, 2.0), (1, 2.0)])
    assert short == pytest.approx(1.5)
    assert long1 == long2 == pytest.approx(1.5 + (2.0 - 1.0))


def test_a_gang_goes_at_the_pace_of_its_thread_on_the_crowded_core():
    # a 2-thread training step beside a 1-thread decode on 2 cores: the step at 1/2, the
    # decode at 2/3, until the decode ends
    train, decode = _finish_times(2, [(2, 1.0), (1, 0.5)])
    assert decode == pytest.approx(0.75)
    assert train == pytest.approx(0.75 + (1.0 - 0.75 * 0.5))


BENCH = {
    "workload": "step",
    "steps": 20,
    "tasks_per_step": 8,
    "group_size": 8,
    "max_new_tokens": 8,
    "max_staleness": 2,
    "sync_s_per_step": 0.19,
    "async_s_per_step": 0.19,
    "async_over_sync": 1.0,
    "breakdown": {
        "inproc": {"generate_s": 0.033, "train_s": 0.11, "load_s": 0.003},
        "sync": {"wait_for_batch_s": 0.061, "publish_s": 0.021, "train_s": 0.1},
    },
}


def test_a_sync_step_is_its_parts_in_a_row_and_async_overlaps_them_on_the_cores():
    out = calibrate.step(BENCH, cores=2)
    parts = 0.11 + 0.021 + 0.061  # train, publish, the wait (generate, swap, hops)
    # the first step also fills the pipeline; the rest are the parts in a row
    assert out["sync"]["predicted_s_per_step"] == pytest.approx(parts, rel=0.03)
    # async overlaps generation with training, but on 2 cores both slow down: faster than
    # sync, slower than training and publishing alone
    assert 0.11 + 0.021 < out["async"]["predicted_s_per_step"] < parts
    # with cores to spare, async is the trainer's own time
    spare = calibrate.step(BENCH, cores=16, trainer_threads=2)
    assert spare["async"]["predicted_s_per_step"] == pytest.approx(0.11 + 0.021, rel=0.03)


E2E = {
    "workload": "agentic.yaml",
    "steps": 4,
    "tasks_per_step": 8,
    "group_size": 4,
    "max_staleness": 4,
    "rollout_max_concurrent_tasks": 64,
    "sync_s": 30.0,
    "async_s": 10.0,
    "speedup": 3.0,
    "workload_config": {
        "env": {"options": {"latency": {"distribution": "lognormal", "median_ms": 200}}},
        "rollout": {
            "max_turns": 4,
            "sampling": {"max_new_tokens": 48, "length_tail": {"median": 6, "sigma": 1.0}},
        },
        "trainer": {"max_staleness": 4, "publish_every": 1},
    },
    "components": {"sync": {"train_s": 1.0, "publish_s": 0.03, "engine_s_per_decode_step": 0.004}},
}


def test_an_agentic_run_is_predicted_from_its_workload_and_its_sync_components():
    out = calibrate.e2e(E2E, cores=2)
    sync, async_ = out["sync"]["predicted_s"], out["async"]["predicted_s"]
    # every sync step trains (1 s) after its slowest episode's four tool calls (200 ms each
    # at the median) and turns
    assert sync > E2E["steps"] * (1.0 + 4 * 0.2)
    assert async_ < sync  # the tool latency overlaps training
    assert out["speedup"]["predicted"] == pytest.approx(sync / async_, rel=0.01)


def test_a_task_draws_one_length_for_all_its_turns_and_episodes():
    scenario = calibrate.e2e_scenario(E2E, cores=2, trainer_threads=2)
    sim = engine.Simulation(scenario, "sync")
    lengths = {
        t: {sim._turn_length(t) for _ in range(5)} for t in ("task-00000000", "task-00000001")
    }
    assert all(len(drawn) == 1 for drawn in lengths.values())
    many = {sim._turn_length(f"task-{i:08d}") for i in range(50)}
    assert len(many) > 5 and max(many) <= 48
    sim.admission.shutdown()


def test_the_services_cpu_per_episode_is_work_on_the_host_beside_training():
    """The CPU that rollout's serving, env-gateway, reward and the store spent in the sync run
    (`service_cpu_s`), per episode, is one more thread's work on the host's cores: async,
    where it runs beside training on the same 2 cores, is predicted slower with it; the
    trainer's own CPU is its step's, already counted."""
    busy = copy.deepcopy(E2E)
    used = {"rollout": 6.0, "env-gateway": 3.0, "reward": 1.0, "weight-store": 0.6}
    busy["components"]["sync"]["service_cpu_s"] = {**used, "trainer": 50.0}
    episodes = E2E["steps"] * E2E["tasks_per_step"] * E2E["group_size"]
    scenario = calibrate.e2e_scenario(busy, cores=2, trainer_threads=2)
    assert scenario.reward.on_host
    assert scenario.reward.call_s == pytest.approx(sum(used.values()) / episodes)
    assert calibrate.e2e_scenario(E2E, cores=2, trainer_threads=2).reward.call_s == 0
    idle, loaded = calibrate.e2e(E2E, cores=2), calibrate.e2e(busy, cores=2)
    assert loaded["async"]["predicted_s"] > idle["async"]["predicted_s"]


def test_a_runs_own_tool_latencies_are_played_instead_of_drawn():
    """`episode_env_s` (each trained episode's seconds in env steps, per task fed and per
    sample: seeded by task and sample, the same in both modes) replaces the latency model's
    draws: two seconds more in every episode make every sync step two seconds longer."""
    tasks = E2E["steps"] * E2E["tasks_per_step"]

    def sync_s(env_s: float) -> float:
        bench = copy.deepcopy(E2E)
        bench["components"]["sync"]["episode_env_s"] = [[env_s] * E2E["group_size"]] * tasks
        scenario = calibrate.e2e_scenario(bench, cores=2, trainer_threads=2)
        assert len(scenario.env.recorded_s) == tasks
        return engine.Simulation(scenario, "sync").run().summary()["wall_s"]

    assert sync_s(2.0) - sync_s(0.0) == pytest.approx(E2E["steps"] * 2.0, rel=0.05)
    drawn = calibrate.e2e_scenario(E2E, cores=2, trainer_threads=2)
    assert drawn.env.recorded_s == []  # an older result: the model's draws
