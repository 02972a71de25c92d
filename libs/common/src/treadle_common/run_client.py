"""`treadle run`: submit a recipe to the trainer and follow it to the end.

Uses the stack `treadle up` started when one is healthy (its rollout must serve the recipe's
model); otherwise starts one for the recipe's model and stops it afterwards. Prints the
run's counts (tasks, trajectories produced/consumed/acked, duplicates, drops) and writes the
resolved config and the summary under `{output_dir}/{run_id}/`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from treadle_common import stack
from treadle_common.config import RunConfig, dump_resolved
from treadle_common.settings import Settings

FINAL = ("succeeded", "failed")


class RunClient:
    def __init__(self, config: RunConfig, settings: Settings, console: Console):
        self.config = config
        self.settings = settings
        self.console = console
        self.state_dir = settings.state_dir.resolve()

    def execute(self, health_timeout_s: float) -> int:
        cfg = self.config
        cfg.model.path = cfg.model.path.resolve()
        if cfg.model.init_tiny and not (cfg.model.path / "config.json").exists():
            from treadle_common.tiny_model import init_tiny

            init_tiny(cfg.model.path, seed=cfg.trainer.seed)
        own_stack = False
        current = stack.status(self.state_dir)
        if not current["healthy"]:
            if current["running"]:
                self.console.print(
                    "[red]a stack is running but unhealthy[/red]; treadle status says why"
                )
                return 1
            spec = stack.prepare(self.settings, cfg.model.path, cfg.model.name, None)
            stack.launch_detached(spec)
            own_stack = True
            current = stack.wait_healthy(self.state_dir, health_timeout_s)
            if not current["healthy"]:
                self.console.print(
                    f"[red]stack not healthy after {health_timeout_s:.0f}s[/red]: "
                    + json.dumps(current)[:2000]
                )
                stack.down(self.settings)
                return 1
        try:
            return self._follow()
        finally:
            if own_stack:
                stack.down(self.settings)

    def _urls(self) -> dict[str, str]:
        record = stack.read_stack(self.state_dir)
        if record is None:
            raise RuntimeError(f"no stack recorded in {self.state_dir}")
        spec = stack.StackSpec(**record["spec"])
        return {s: spec.http_url(s) for s in ("trainer", "rollout", "weight-store")}

    def _follow(self) -> int:
        cfg = self.config
        urls = self._urls()
        info = httpx.get(f"{urls['rollout']}/v1/info", timeout=5).json()
        if info["model"] != cfg.model.name or Path(info["model_dir"]) != cfg.model.path:
            self.console.print(
                f"[red]rollout serves {info['model']} from {info['model_dir']}[/red]; "
                f"the recipe needs {cfg.model.name} from {cfg.model.path} (treadle down, then run)"
            )
            return 1
        out_dir = cfg.output_dir / cfg.run_id
        dump_resolved(cfg, out_dir / "config.yaml")
        response = httpx.post(
            f"{urls['trainer']}/v1/runs", json=cfg.model_dump(mode="json"), timeout=30
        )
        if response.status_code != 202:
            self.console.print(
                f"[red]trainer refused the run ({response.status_code})[/red]: {response.text}"
            )
            return 1
        run = response.json()
        with Live(self._table(run), console=self.console, refresh_per_second=2) as live:
            while run["state"] not in FINAL:
                time.sleep(0.5)
                run = httpx.get(f"{urls['trainer']}/v1/runs/{cfg.run_id}", timeout=10).json()
                live.update(self._table(run))
        summary = self._summary(run, urls)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.console.print_json(json.dumps(summary))
        ok = run["state"] == "succeeded" and summary["exactly_once"]
        self.console.print(
            ("[green]run succeeded[/green]" if ok else "[red]run failed[/red]")
            + f" — outputs in {out_dir}"
        )
        return 0 if ok else 1

    def _summary(self, run: dict, urls: dict[str, str]) -> dict:
        last = run["versions"][-1] if run["versions"] else run["base_version"]
        rollout = self._wait_rollout_version(urls["rollout"], last)
        versions = httpx.get(
            f"{urls['weight-store']}/v1/models/{self.config.model.name}/versions", timeout=10
        ).json()
        exactly_once = (
            run["trajectories_consumed"] == run["trajectories_produced"]
            and run["duplicates"] == 0
            and run["pending_after_run"] == 0
            and run["trajectories_acked"] == run["trajectories_consumed"] + run["rejected"]
        )
        return {
            "run_id": run["run_id"],
            "state": run["state"],
            "error": run["error"],
            "steps": run["step"],
            "tasks_fed": run["tasks_fed"],
            "trajectories_produced": run["trajectories_produced"],
            "trajectories_consumed": run["trajectories_consumed"],
            "trajectories_trained": run["trajectories_trained"],
            "trajectories_acked": run["trajectories_acked"],
            "rejected": run["rejected"],
            "duplicates": run["duplicates"],
            "pending_after_run": run["pending_after_run"],
            "dropped": run["dropped"],
            "exactly_once": exactly_once,
            "versions_published": run["versions"],
            "weight_store_versions": [int(v["version"]) for v in versions["versions"]],
            "rollout_policy_version": rollout["policy_version"],
            "rollout_swaps": rollout["swaps"],
            "mean_reward_per_step": [round(s["mean_reward"], 4) for s in run["steps"]],
        }

    def _wait_rollout_version(self, url: str, version: int, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            info = httpx.get(f"{url}/v1/info", timeout=5).json()
            if info["policy_version"] >= version or time.monotonic() > deadline:
                return info
            time.sleep(0.2)

    def _table(self, run: dict) -> Table:
        table = Table(title=f"run {run['run_id']} — {run['state']}")
        for column in (
            "step",
            "version",
            "mean reward",
            "trajectories",
            "loss",
            "staleness",
            "publish MB",
            "s",
        ):
            table.add_column(column)
        for s in run["steps"]:
            table.add_row(
                str(s["step"]),
                str(s["version"]),
                f"{s['mean_reward']:.3f}",
                str(s["num_trajectories"]),
                f"{s['loss']:.4f}",
                str(s["max_staleness"]),
                f"{s['bytes_published'] / 2**20:.2f}",
                f"{s['duration_s']:.1f}",
            )
        return table
