"""A scenario grown to larger fleets: every pool (rollout replicas, trainer GPUs, reward
replicas) and the step's tasks grow by the same factor, the weight store does not (one
store's egress, as the scenario gives it). Each size runs async in simulated time and reports
each shared component's utilisation and the first to saturate; beside it the weight sync of
a 7B and a 235B model at that size under each fan-out (`transfer.fetch_seconds`)."""

from __future__ import annotations

from typing import Any

from treadle_sim.engine import Simulation
from treadle_sim.scenario import Scenario
from treadle_sim.transfer import fetch_seconds

SATURATED = 0.9
"""Utilisation from which a component is the fleet's limit: past it, work queues on it."""
SYNC_MODELS = {"7b": 7.6, "235b": 235.0}
"""Models (billions of parameters, bf16) whose full weight sync is reported at every size."""
FANOUTS = ("store", "relay", "broadcast")
SHARED = ("store_egress", "redis", "nats", "ingest")
"""What does not grow with the fleet (one store, one Redis, the NATS servers, the trainer's
ingest process): their utilisation rises with its size; every pool grows with it."""


def scaled(scenario: Scenario, gpus: int, steps: int | None = None) -> Scenario:
    """`scenario` at about `gpus` GPUs, its pools in the same proportions."""
    factor = gpus / scenario.gpus
    rollout, trainer, run = scenario.rollout, scenario.trainer, scenario.run
    k = run.publish_every
    steps = steps or run.steps
    return scenario.model_copy(
        update={
            "name": f"{scenario.name}@{gpus}",
            "rollout": rollout.model_copy(
                update={"replicas": max(1, round(rollout.replicas * factor))}
            ),
            "trainer": trainer.model_copy(update={"gpus": max(1, round(trainer.gpus * factor))}),
            "reward": scenario.reward.model_copy(
                update={"replicas": max(1, round(scenario.reward.replicas * factor))}
            ),
            "run": run.model_copy(
                update={
                    "tasks_per_step": max(1, round(run.tasks_per_step * factor)),
                    "steps": max(k, steps - steps % k),
                }
            ),
        }
    )


def weight_sync(scenario: Scenario, replicas: int) -> dict[str, dict[str, dict[str, float]]]:
    """Seconds until the last of `replicas` holds a new full version, per model and fan-out,
    and the store egress seconds it takes (the store's links as the scenario gives them)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, params_b in SYNC_MODELS.items():
        weight_bytes = params_b * 1e9 * 2
        publish = weight_bytes * 8 / (scenario.weights.publish_gbps * 1e9)
        row: dict[str, dict[str, float]] = {}
        for fanout in FANOUTS:
            w = scenario.weights.model_copy(update={"fanout": fanout})
            seconds, store_s = fetch_seconds(w, weight_bytes, replicas)
            sync_s = publish + max(seconds)
            row[fanout] = {
                "sync_s": round(sync_s, 2),
                "sync_s_per_step": round(sync_s / scenario.run.publish_every, 2),
                "store_egress_s": round(store_s, 2),
            }
        out[name] = row
    return out


def at(scenario: Scenario, gpus: int, steps: int | None = None, seed: int = 0) -> dict[str, Any]:
    """One size: the async run's figures, each shared component's utilisation, the first
    at `SATURATED` or past it (None: none yet; the most used is named beside it)."""
    sc = scaled(scenario, gpus, steps)
    out = Simulation(sc, "async", seed).run().summary()
    used = {
        "trainer": round(1 - out["trainer_bubble"], 4),
        "reward": out["reward_utilisation"],
        **{name: out[f"{name}_utilisation"] for name in SHARED},
    }
    busiest = max(used, key=lambda name: used[name])
    return {
        "gpus": sc.gpus,
        "rollout_replicas": sc.rollout.replicas,
        "trainer_gpus": sc.trainer.gpus,
        "tasks_per_step": sc.run.tasks_per_step,
        "step_s_mean": out["step_s_mean"],
        "trained_tokens_per_s": out["trained_tokens_per_s"],
        "rollout_utilisation": out["rollout_utilisation"],
        "utilisation": used,
        "busiest": busiest,
        "first_saturating": busiest if used[busiest] >= SATURATED else None,
        "weight_sync_share": out["weight_sync_share"],
        "weight_sync_s": weight_sync(sc, sc.rollout.replicas),
    }


def sweep(
    scenario: Scenario, sizes: list[int], steps: int | None = None, seed: int = 0
) -> dict[str, Any]:
    """Every size of `sizes`, and how the trained tokens per second per GPU held up."""
    rows = [at(scenario, gpus, steps, seed) for gpus in sizes]
    first = rows[0]["trained_tokens_per_s"] / rows[0]["gpus"]
    for row in rows:
        per_gpu = row["trained_tokens_per_s"] / row["gpus"]
        row["tokens_per_gpu_vs_first"] = round(per_gpu / first, 3) if first else None
    projected = saturation(rows)
    return {
        "scenario": scenario.name,
        "seed": seed,
        "fanout": scenario.weights.fanout,  # the one the runs used
        "steps_per_version": scenario.run.publish_every,
        "first_saturating": next((k for k, v in projected.items() if v is not None), None),
        "saturates_at_gpus": projected,
        "control_plane_simulated": False,  # redis, nats, ingest: load reported (`control.py`)
        "sizes": rows,
    }


def saturation(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per shared component, the fleet size at which it reaches `SATURATED`, soonest first,
    on the line through two sizes' utilisations: the two around the first size where it is
    there already, else the two largest (with one size: in proportion to the fleet, as its
    demand grows and its capacity does not); None where it does not grow with the fleet."""
    out: dict[str, int | None] = {}
    for name in SHARED:
        used = [(0, 0.0)] + [(r["gpus"], r["utilisation"][name]) for r in rows]
        hit = next((i for i in range(1, len(used)) if used[i][1] >= SATURATED), None)
        (g0, u0), (g1, u1) = used[(hit or len(used) - 1) - 1 : (hit or len(used) - 1) + 1]
        slope = (u1 - u0) / (g1 - g0) if g1 != g0 else 0.0
        out[name] = round(g1 + (SATURATED - u1) / slope) if slope > 1e-12 else None
    return dict(sorted(out.items(), key=lambda kv: kv[1] if kv[1] is not None else 10**12))
