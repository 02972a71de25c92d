"""Calibration: the simulator's predictions of `treadle bench step` and `treadle bench e2e`
runs on this machine from their measured component costs, against what the runs measured
end to end.

`bench step` (compute-bound): the inputs, each a cost measured on its own (its `breakdown`):

    generate_s   the in-process loop's generation of a step's batch (every group at once)
    train_s      the in-process loop's training step (alone on the cores)
    load_s       the in-process loop's copy of new weights into the engine (a swap)
    publish_s    the service trainer's publish (sync run: nothing else runs meanwhile)
    hop_s        what the service path adds to a sync step's wait for its batch beyond
                 generating it and swapping weights in (env step, score, stream hops)

Sync's prediction is close to the sum of its parts (it checks the composition: the barrier,
the feed, the swap); async's is the test: generation and training overlap on 2 cores, each
slowed by the other as the host's processor sharing says (`treadle_sim.host`), with the
trainer's staleness bound and rollout's admission deciding what overlaps.

`bench e2e` (latency-bound, agentic: multi-turn episodes behind heavy-tailed tool latency):
the inputs are the workload's own settings (turns, the env's latency model, the per-task
length tail, group size, staleness, rollout's concurrent tasks) and, from the sync run alone
(nothing else runs beside each part there), its `components`: the trainer's step and publish,
the engine's seconds per decode step, and the CPU the other services spent per episode
(rollout's serving, env-gateway, reward, the store: `service_cpu_s`), as work on the host's
cores beside the engine and the trainer (three threads at most: rollout, env-gateway and
reward are single-threaded processes; the store's share is small), and each episode's own
seconds in env steps (`episode_env_s`: tool latency is seeded by task and sample, so both
modes wait the same; played instead of the latency model's draws). Both modes' wall times
are predictions.
"""

from __future__ import annotations

import os
from typing import Any

from treadle_sim import engine
from treadle_sim.scenario import (
    EnvSpec,
    Host,
    Lengths,
    ModelSpec,
    RewardSpec,
    RolloutPool,
    RunSpec,
    Scenario,
    TrainerPool,
    Weights,
)

TOLERANCE = 0.15


def step_scenario(bench: dict[str, Any], cores: float, trainer_threads: int) -> Scenario:
    """The workload of one `bench step` result, with that run's measured costs."""
    inproc, sync = bench["breakdown"]["inproc"], bench["breakdown"]["sync"]
    tokens = bench["max_new_tokens"]
    hop_s = max(0.0, sync["wait_for_batch_s"] - inproc["generate_s"] - inproc["load_s"])
    model = ModelSpec(params_b=1e-3)  # only its bytes matter: publish is timed as measured
    seqs = bench["tasks_per_step"] * bench["group_size"]
    return Scenario(
        name=f"bench-step-{bench['workload']}",
        source="a `treadle bench step --json` run on this machine (its breakdown)",
        model=model,
        lengths=Lengths(prompt_tokens=1, response_median=tokens, response_max=tokens),
        rollout=RolloutPool(
            replicas=1,
            decode_step_s=inproc["generate_s"] / tokens,
            prefill_tokens_per_s=1e12,
            max_batch=seqs,
            swap_s=inproc["load_s"],
            threads=1,  # rollout's torch threads: half the cores (`treadle up`)
        ),
        trainer=TrainerPool(
            gpus=1,
            peak_tflops=1e12,  # the step's time is measured, not derived from FLOPs
            mfu=1.0,
            step_overhead_s=inproc["train_s"],
            threads=trainer_threads,
        ),
        weights=Weights(
            publish_gbps=model.weight_bytes * 8 / max(sync["publish_s"], 1e-9) / 1e9,
            link_gbps=1e9,
            store_egress_gbps=1e9,
        ),
        # the service hops (env step, score, streams: Python in other processes on the same
        # cores) as one thread's work per episode, one episode at a time
        reward=RewardSpec(replicas=1, call_s=hop_s / seqs, on_host=True),
        run=RunSpec(
            steps=bench["steps"],
            tasks_per_step=bench["tasks_per_step"],
            group_size=bench["group_size"],
            max_staleness=bench["max_staleness"],
        ),
        host=Host(cores=cores),
    )


def step(bench: dict[str, Any], cores: float | None = None, trainer_threads: int | None = None):
    """Predicted vs measured seconds per step, sync and async, and the relative errors."""
    cores = cores or float(os.cpu_count() or 2)
    scenario = step_scenario(bench, cores, trainer_threads or int(cores))
    out: dict[str, Any] = {"calibration": "bench step", "cores": cores, "tolerance": TOLERANCE}
    for mode in ("sync", "async"):
        predicted = engine.Simulation(scenario, mode).run().summary()["step_s_mean"]
        measured = bench[f"{mode}_s_per_step"]
        out[mode] = {
            "predicted_s_per_step": predicted,
            "measured_s_per_step": measured,
            "error": round(predicted / measured - 1, 3),
        }
    ratio = out["async"]["predicted_s_per_step"] / out["sync"]["predicted_s_per_step"]
    out["async_over_sync"] = {
        "predicted": round(ratio, 3),
        "measured": bench["async_over_sync"],
    }
    out["within_tolerance"] = all(abs(out[m]["error"]) <= TOLERANCE for m in ("sync", "async"))
    return out


def e2e_scenario(bench: dict[str, Any], cores: float, trainer_threads: int) -> Scenario:
    """The workload of one `bench e2e` result, with its sync run's measured costs."""
    cfg, parts = bench["workload_config"], bench["components"]["sync"]
    sampling = cfg["rollout"]["sampling"]
    tail = sampling.get("length_tail") or {"median": sampling["max_new_tokens"], "sigma": 0.0}
    model = ModelSpec(params_b=1e-3)
    return Scenario(
        name=f"bench-e2e-{bench['workload']}",
        source="a `treadle bench e2e --json` run on this machine (its sync run's components)",
        model=model,
        lengths=Lengths(
            prompt_tokens=1,
            response_median=tail["median"],
            response_sigma=tail["sigma"],
            response_max=sampling["max_new_tokens"],
            per="task",
        ),
        rollout=RolloutPool(
            replicas=1,
            decode_step_s=parts["engine_s_per_decode_step"],
            prefill_tokens_per_s=1e12,  # prefill is in the engine's busy time per step
            max_batch=bench["rollout_max_concurrent_tasks"] * bench["group_size"],
            max_tasks=bench["rollout_max_concurrent_tasks"],
            threads=1,
        ),
        trainer=TrainerPool(
            gpus=1, peak_tflops=1.0, mfu=1.0, step_s=parts["train_s"], threads=trainer_threads
        ),
        weights=Weights(
            publish_gbps=model.weight_bytes * 8 / max(parts["publish_s"], 1e-9) / 1e9,
            link_gbps=1e9,
            store_egress_gbps=1e9,
        ),
        env=EnvSpec(
            turns=cfg["rollout"]["max_turns"],
            latency=cfg["env"]["options"].get("latency", {}),
            # the run's own tool latencies (seeded by task and sample: the same in both modes)
            recorded_s=parts.get("episode_env_s", []),
        ),
        # the services' own CPU per episode (the store's too), on the host's cores, at most
        # three at once: rollout, env-gateway and reward each serve on one thread
        reward=RewardSpec(replicas=3, call_s=_service_s_per_episode(bench), on_host=True),
        run=RunSpec(
            steps=bench["steps"],
            tasks_per_step=bench["tasks_per_step"],
            group_size=bench["group_size"],
            max_staleness=bench["max_staleness"],
            publish_every=cfg["trainer"].get("publish_every", 1),
        ),
        host=Host(cores=cores),
    )


def _service_s_per_episode(bench: dict[str, Any]) -> float:
    """The CPU the services besides the trainer and the engine spent per episode in the sync
    run (rollout's serving, env-gateway's sessions, reward, the store: `service_cpu_s`)."""
    used = bench["components"]["sync"].get("service_cpu_s", {})
    episodes = bench["steps"] * bench["tasks_per_step"] * bench["group_size"]
    return sum(v for k, v in used.items() if k != "trainer") / max(episodes, 1)


def e2e(bench: dict[str, Any], cores: float | None = None, trainer_threads: int | None = None):
    """Predicted vs measured training wall time, sync and async, and the speedup."""
    cores = cores or float(os.cpu_count() or 2)
    scenario = e2e_scenario(bench, cores, trainer_threads or int(cores))
    out: dict[str, Any] = {"calibration": "bench e2e", "cores": cores, "tolerance": TOLERANCE}
    result = engine.compare(scenario)
    for mode in ("sync", "async"):
        predicted, measured = result[mode]["wall_s"], bench[f"{mode}_s"]
        out[mode] = {
            "predicted_s": predicted,
            "measured_s": measured,
            "error": round(predicted / measured - 1, 3),
        }
    out["speedup"] = {"predicted": result["speedup"], "measured": bench["speedup"]}
    out["within_tolerance"] = all(abs(out[m]["error"]) <= TOLERANCE for m in ("sync", "async"))
    return out
