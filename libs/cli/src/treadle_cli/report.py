"""What `treadle run` leaves in `{output_dir}/{run_id}/`: metrics JSONL and a PNG plot.

`metrics.jsonl` holds one JSON object per line, each a typed row told apart by `kind`:

| kind      | model      | what                                                           |
|-----------|------------|----------------------------------------------------------------|
| `eval`    | `EvalRow`  | a held-out evaluation, `phase` start / after_sft / step N / end |
| `sft_val` | `EvalRow`  | a warm-up validation (tasks outside the held-out set)          |
| `sft`     | `SftRow`   | a warm-up step (loss, optimizer step)                          |
| `step`    | `StepRow`  | a trainer step record, as `GET /v1/runs/{id}` reports it       |

Every row carries `t`, seconds since the run started. `metrics.png` plots reward, throughput,
staleness and the train-inference drift (the trainer's logprobs against rollout's) against
`t`, with a line where the warm-up ends and RL begins; `EvalSummary` is what the evaluations
say about the run (its gain, and RL's own lift after the warm-up).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, TypeAdapter

from treadle_common.api.runs import StepRecord


class EvalRow(BaseModel):
    """Greedy episodes on a fixed task set with one policy version, scored."""

    kind: Literal["eval", "sft_val"] = "eval"
    t: float = 0.0
    phase: str = Field(description="start | after_sft | step N | end | sft step N")
    mean_reward: float
    num_tasks: int = 0
    policy_versions: list[int] = Field(default_factory=list)
    statuses: dict[str, int] = Field(default_factory=dict)
    seconds: float = 0.0


class SftRow(BaseModel):
    """One SFT warm-up step through the training API."""

    kind: Literal["sft"] = "sft"
    t: float = 0.0
    sft_step: int
    loss: float
    grad_norm: float


class StepRow(StepRecord):
    """One RL step, the trainer's `StepRecord` stamped with the report's clock."""

    kind: Literal["step"] = "step"
    t: float = 0.0


Row = Annotated[EvalRow | SftRow | StepRow, Field(discriminator="kind")]
ROWS: TypeAdapter[Row] = TypeAdapter(Row)


class EvalSummary(BaseModel):
    """The held-out evaluations by phase, and what they add up to."""

    eval: dict[str, float] = Field(description="Mean held-out reward by phase")
    eval_start: float | None = None
    eval_after_sft: float | None = None
    eval_end: float | None = None
    gain: float | None = Field(None, description="eval_end - eval_start")
    rl_lift: float | None = Field(
        None,
        description="RL's own gain: eval_end - eval_after_sft, or eval_end - eval_start for a "
        "run with no warm-up",
    )

    @classmethod
    def of(cls, evals: list[EvalRow]) -> EvalSummary:
        by_phase = {e.phase: e.mean_reward for e in evals}
        start, after_sft, end = (by_phase.get(p) for p in ("start", "after_sft", "end"))
        rl_from = after_sft if after_sft is not None else start  # no warm-up: RL from the start
        return cls(
            eval=by_phase,
            eval_start=start,
            eval_after_sft=after_sft,
            eval_end=end,
            gain=None if end is None or start is None else round(end - start, 4),
            rl_lift=None if end is None or rl_from is None else round(end - rl_from, 4),
        )


class RunReport:
    def __init__(self, out_dir: Path, rows: list[Row] | None = None):
        """A new report (an empty `metrics.jsonl`), or one holding `rows` already."""
        self.out_dir = out_dir
        self.path = out_dir / "metrics.jsonl"
        self.started = time.time()
        self.rows: list[Row] = rows if rows is not None else []
        if rows is None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    @classmethod
    def load(cls, out_dir: Path) -> RunReport:
        """A finished run's report, read back from its `metrics.jsonl`."""
        lines = (out_dir / "metrics.jsonl").read_text().splitlines()
        return cls(out_dir, [ROWS.validate_json(line) for line in lines])

    def add(self, row: Row, at: float | None = None) -> None:
        """Append `row`, stamped `at` (unix time; now by default) relative to the start."""
        row.t = round((time.time() if at is None else at) - self.started, 3)
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(row.model_dump_json() + "\n")

    def steps(self) -> list[StepRow]:
        return [r for r in self.rows if isinstance(r, StepRow)]

    def evals(self, kind: Literal["eval", "sft_val"] = "eval") -> list[EvalRow]:
        return [r for r in self.rows if isinstance(r, EvalRow) and r.kind == kind]

    def sft(self) -> list[SftRow]:
        return [r for r in self.rows if isinstance(r, SftRow)]

    def eval_summary(self) -> EvalSummary:
        return EvalSummary.of(self.evals())

    def plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = self.steps()
        fig, axes = plt.subplots(4, 1, figsize=(8, 11), sharex=True)
        reward, speed, stale, drift = axes
        t = [s.t for s in steps]
        self._plot_rewards(reward)
        speed.plot(t, [s.tokens_per_s for s in steps], ".-")
        speed.set_ylabel("trainer tokens/s")
        stale.step(t, [s.max_staleness for s in steps], where="post")
        stale.set_ylabel("max staleness")
        # train-inference consistency: how far the trainer's logprobs are from rollout's
        for field, label in (
            ("log_ratio_p99", "p99 |d|"),
            ("log_ratio_abs_mean", "mean |d|"),
            ("behaviour_kl", "KL(behaviour || trainer)"),
        ):  # on a log scale, floored at 1e-9 (the same weights in fp32 give about 1e-7)
            drift.plot(t, [max(getattr(s, field), 1e-9) for s in steps], ".-", label=label)
        if any(len(s.drift_by_staleness) > 1 for s in steps):  # the engine's share vs age's
            fresh = [s.drift_by_staleness[0] if s.drift_by_staleness else 0.0 for s in steps]
            drift.plot(t, [max(v, 1e-9) for v in fresh], ":", label="mean |d|, 0 behind")
        drift.set_yscale("log")
        drift.set_ylabel("d = log p_trainer - log p_behaviour")
        drift.legend(loc="upper right", fontsize=8)
        drift.set_xlabel("seconds since start")
        warm = self.sft()
        if warm:  # RL starts here: what follows is RL's own doing
            for axis in axes:
                axis.axvline(warm[-1].t, color="grey", linestyle="--", linewidth=1)
            reward.text(
                warm[-1].t,
                0.97,
                " warm-up ends, RL starts",
                transform=reward.get_xaxis_transform(),
                fontsize=8,
                color="grey",
                va="top",
            )
        fig.tight_layout()
        out = self.out_dir / "metrics.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

    def _plot_rewards(self, reward) -> None:
        """Training reward per step, the evaluations and the warm-up's validations."""
        steps, evals = self.steps(), self.evals()
        reward.plot(
            [s.t for s in steps], [s.mean_reward for s in steps], ".-", label="train (sampled)"
        )
        reward.plot(
            [e.t for e in evals], [e.mean_reward for e in evals], "o--", label="eval (greedy)"
        )
        for e in evals:
            reward.annotate(e.phase, (e.t, e.mean_reward), fontsize=8)
        checks = self.evals("sft_val")
        if checks:
            reward.plot(
                [c.t for c in checks],
                [c.mean_reward for c in checks],
                "x:",
                label="warm-up validation (greedy)",
            )
        reward.set_ylabel("mean reward")
        reward.legend(loc="lower right")
