"""What `treadle run` leaves in `{output_dir}/{run_id}/`: metrics JSONL and a PNG plot.

`metrics.jsonl` holds one JSON object per line, `kind` = `eval` (a held-out evaluation,
with `phase` start | after_sft | step N | end), `sft` (a warm-up step), `sft_val` (a warm-up
validation, on tasks outside the held-out set) or `step` (a trainer step record, as
`GET /v1/runs/{id}` reports it). `metrics.png` plots reward, throughput and staleness against
wall-clock time since the run started, with a line where the warm-up ends and RL begins.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class RunReport:
    def __init__(self, out_dir: Path, records: list[dict[str, Any]] | None = None):
        """A new report (an empty `metrics.jsonl`), or one holding `records` already."""
        self.out_dir = out_dir
        self.path = out_dir / "metrics.jsonl"
        self.started = time.time()
        self.records = records if records is not None else []
        if records is None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    @classmethod
    def load(cls, out_dir: Path) -> RunReport:
        """A finished run's report, read back from its `metrics.jsonl`."""
        lines = (out_dir / "metrics.jsonl").read_text().splitlines()
        return cls(out_dir, [json.loads(line) for line in lines])

    def add(self, kind: str, record: dict[str, Any], at: float | None = None) -> None:
        at = time.time() if at is None else at
        row = {"kind": kind, "t": round(at - self.started, 3), **record}
        self.records.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind]

    def plot(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps, evals = self.of("step"), self.of("eval")
        fig, (reward, speed, stale) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
        t = [s["t"] for s in steps]
        reward.plot(t, [s["mean_reward"] for s in steps], ".-", label="train (sampled)")
        reward.plot(
            [e["t"] for e in evals], [e["mean_reward"] for e in evals], "o--", label="eval (greedy)"
        )
        for e in evals:
            reward.annotate(e["phase"], (e["t"], e["mean_reward"]), fontsize=8)
        checks = self.of("sft_val")
        if checks:
            reward.plot(
                [c["t"] for c in checks],
                [c["mean_reward"] for c in checks],
                "x:",
                label="warm-up validation (greedy)",
            )
        warm = self.of("sft")
        if warm:  # RL starts here: what follows is RL's own doing
            for axis in (reward, speed, stale):
                axis.axvline(warm[-1]["t"], color="grey", linestyle="--", linewidth=1)
            reward.text(
                warm[-1]["t"],
                0.97,
                " warm-up ends, RL starts",
                transform=reward.get_xaxis_transform(),
                fontsize=8,
                color="grey",
                va="top",
            )
        reward.set_ylabel("mean reward")
        reward.legend(loc="lower right")
        speed.plot(t, [s["tokens_per_s"] for s in steps], ".-")
        speed.set_ylabel("trainer tokens/s")
        stale.step(t, [s["max_staleness"] for s in steps], where="post")
        stale.set_ylabel("max staleness")
        stale.set_xlabel("seconds since start")
        fig.tight_layout()
        out = self.out_dir / "metrics.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out
