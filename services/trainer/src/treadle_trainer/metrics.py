"""Trainer metrics (Prometheus), labelled by run."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STEP_GAUGES = {
    name: Gauge(f"treadle_trainer_{name}", doc, ["run"])
    for name, doc in {
        "loss": "Loss of the last step",
        "reward_mean": "Mean reward of the last batch",
        "reward_std": "Reward standard deviation of the last batch",
        "kl": "Mean per-token KL to the reference (k3) of the last step",
        "entropy": "Mean per-token policy entropy of the last step",
        "clip_fraction": "Fraction of tokens whose ratio was clipped in the last step",
        "log_ratio_mean": "Mean log p_trainer - log p_behaviour over the last step's tokens",
        "log_ratio_abs_mean": "Mean |log p_trainer - log p_behaviour| of the last step",
        "log_ratio_p99": "99th percentile of |log p_trainer - log p_behaviour|, last step",
        "log_ratio_max": "Largest |log p_trainer - log p_behaviour| of the last step",
        "behaviour_kl": "k3 estimate of KL(behaviour || trainer) of the last step",
        "off_policy_cap": "Cap or bound of the off-policy correction of the last step (0: none)",
        "off_policy_masked": "Fraction of the last step's loss tokens the correction zeroed",
        "off_policy_ess": "Effective sample size fraction of the last step's correction weights",
        "grad_norm": "Gradient norm before clipping of the last step",
        "tokens_per_s": "Trained tokens per second of the last step (wall clock, step_s)",
        "step": "Last completed step",
        "policy_version": "Weight version published by the last step",
    }.items()
}
STALENESS = Histogram(
    "treadle_trainer_staleness",
    "Staleness of trained trajectories (versions behind the trainer)",
    ["run"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 16),
)
WAIT_FOR_BATCH = Histogram(
    "treadle_trainer_wait_for_batch_seconds", "Time waiting for a complete batch", ["run"]
)
STEP_SECONDS = Histogram("treadle_trainer_step_seconds", "Wall time of a whole step", ["run"])
PUBLISH_SECONDS = Histogram(
    "treadle_trainer_publish_seconds", "Time publishing the step's weights", ["run"]
)
CHECKPOINT_SECONDS = Histogram(
    "treadle_trainer_checkpoint_seconds", "Time writing a checkpoint and committing", ["run"]
)
TOKENS = Counter("treadle_trainer_tokens_total", "Loss tokens trained on", ["run"])
LOG_RATIO_TOKENS = Counter(
    "treadle_trainer_log_ratio_tokens_total",
    "Loss tokens by their log importance ratio log p_trainer - log p_behaviour: `upper` is the "
    "bin's upper edge (RATIO_EDGES; +Inf for the last)",
    ["run", "upper"],
)
DRIFT_BY_STALENESS = Gauge(
    "treadle_trainer_log_ratio_abs_mean_by_staleness",
    "Mean |log p_trainer - log p_behaviour| of the last step's loss tokens generated `behind` "
    "versions ago (7: 7 or more)",
    ["run", "behind"],
)
TRACKER_ERRORS = Counter(
    "treadle_trainer_tracker_errors_total",
    "Calls to an experiment tracker that failed (the run goes on; `logging.trackers`)",
    ["run", "tracker", "call"],
)
