"""The real `treadle` command, run as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

TREADLE = str(Path(sys.executable).parent / "treadle")


def treadle(*args: str, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TREADLE, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


TWO_STEPS = {
    "trainer.num_steps": "2",
    "trainer.tasks_per_step": "2",
    "trainer.checkpoint_every": "2",
    "rollout.group_size": "2",
}
"""Recipe overrides for a run of two short steps (2 tasks x 2 episodes each)."""


def import_model(source: Path, name: str, out: Path, env: dict, cwd: Path) -> None:
    """`treadle model import SOURCE NAME --out OUT --no-publish`, which must succeed."""
    args = ("model", "import", str(source), name, "--out", str(out), "--no-publish")
    done = treadle(*args, env=env, cwd=cwd, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def run_recipe(
    recipe: Path, overrides: dict[str, str], env: dict, cwd: Path, timeout: float
) -> subprocess.CompletedProcess:
    """`treadle run RECIPE --set KEY=VALUE ...` (its stack its own)."""
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    return treadle("run", str(recipe), *sets, env=env, cwd=cwd, timeout=timeout)


def run_rows(cwd: Path) -> tuple[dict, list[dict]]:
    """The only run under `cwd`'s state directory: its summary and its metrics rows."""
    (run_dir,) = (cwd / ".treadle" / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, rows
