"""`treadle bench mismatch`: does `trainer.off_policy: auto` recover the learning that a
train-inference mismatch costs an uncorrected run?

Three arms of the demo recipe (`recipes/demo.yaml`, `treadle bench learn`'s runs), each on a
stack of its own, per seed:

- `clean`: rollout's engine computes the trainer's policy (`off_policy: none`);
- `none`: the engine's sampling logits carry a fixed bias per vocabulary token,
  N(0, `noise`^2) (`TREADLE_ROLLOUT_FAULT_LOGIT_NOISE`, as a miscalibrated kernel or
  quantisation makes them; greedy evaluation stays clean), and the trainer does nothing
  about it (PPO's ratio against the biased behaviour logprobs);
- `auto`: the same biased engine, `off_policy: auto`.

Per arm the mean over the seeds of `rl_lift` (held-out greedy accuracy gained by RL, after the
warm-up); `none_loss` = clean - none and `auto_loss` = clean - auto, in points of accuracy;
and auto's decisions over its steps (the corrections it chose, their caps, the tokens' effective
sample size).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from treadle_bench import learn

NOISE_VARIABLE = "TREADLE_ROLLOUT_FAULT_LOGIT_NOISE"


@contextlib.contextmanager
def injected(noise: float) -> Iterator[None]:
    """The mismatch for the stacks started inside (their services inherit the variable)."""
    saved = os.environ.get(NOISE_VARIABLE)
    os.environ[NOISE_VARIABLE] = str(noise)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(NOISE_VARIABLE, None)
        else:
            os.environ[NOISE_VARIABLE] = saved


def run(
    seeds: list[int],
    noise: float = 1.0,
    recipe: Path = learn.DEMO_RECIPE,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    extra = list(overrides or [])
    arms: dict[str, dict[str, Any]] = {}
    with injected(0.0):
        arms["clean"] = learn.run(seeds, recipe, [*extra, "trainer.off_policy=none"])
    with injected(noise):
        arms["none"] = learn.run(seeds, recipe, [*extra, "trainer.off_policy=none"])
        arms["auto"] = learn.run(seeds, recipe, [*extra, "trainer.off_policy=auto"])
    lift = {name: _mean_lift(arm) for name, arm in arms.items()}
    return {
        "recipe": recipe.name,
        "noise": noise,
        "seeds": seeds,
        "rl_lift": lift,
        "per_seed": {
            name: [
                {k: s[k] for k in ("seed", "eval_after_sft", "eval_end", "rl_lift")}
                for s in arm["seeds"]
            ]
            for name, arm in arms.items()
        },  # fmt: skip
        "none_loss_points": _points(lift["clean"], lift["none"]),
        "auto_loss_points": _points(lift["clean"], lift["auto"]),
        "drift": {name: _drift(Path(arm["outputs"])) for name, arm in arms.items()},
        "auto_decisions": _decisions(Path(arms["auto"]["outputs"])),
        "max_wall_s": max(arm["max_wall_s"] for arm in arms.values()),
    }


def _mean_lift(arm: dict[str, Any]) -> float | None:
    lifts = [s["rl_lift"] for s in arm["seeds"]]
    return round(statistics.fmean(lifts), 4) if None not in lifts else None


def _points(reference: float | None, other: float | None) -> float | None:
    if reference is None or other is None:
        return None
    return round(100 * (reference - other), 1)


def _steps(outputs: Path) -> list[dict[str, Any]]:
    rows = []
    for metrics in sorted(outputs.glob("runs/*/metrics.jsonl")):
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") == "step":  # not the evaluations nor the warm-up's
                rows.append(row)
    return rows


def _drift(outputs: Path) -> dict[str, float]:
    """The RL steps' measured drift: mean |d| and the mean of the steps' p99 of |d|."""
    steps = _steps(outputs)
    if not steps:
        return {}
    return {
        "log_ratio_abs_mean": round(statistics.fmean(s["log_ratio_abs_mean"] for s in steps), 4),
        "log_ratio_p99_mean": round(statistics.fmean(s["log_ratio_p99"] for s in steps), 4),
        "clip_fraction_mean": round(statistics.fmean(s["clip_fraction"] for s in steps), 4),
    }


def _decisions(outputs: Path) -> dict[str, Any]:
    """What auto chose over its steps: steps per correction and per cap, and the mean
    effective sample size of its weights."""
    steps = _steps(outputs)
    if not steps:
        return {}
    return {
        "steps_by_mode": dict(collections.Counter(s["off_policy"] for s in steps)),
        "steps_by_cap": {
            str(cap): n
            for cap, n in sorted(collections.Counter(s["off_policy_cap"] for s in steps).items())
        },  # fmt: skip
        "ess_mean": round(statistics.fmean(s["off_policy_ess"] for s in steps), 4),
    }
