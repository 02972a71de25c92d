"""`bench trainer`'s plain loop trains under the service's choice of deterministic
algorithms (`TREADLE_TRAINER_DETERMINISTIC`), leaves the process's setting as it was, and
with a profile directory profiles one more step (not measured) through the trainer's
`profiled`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from treadle_bench import trainer
from treadle_trainer.public import phase


def scripted_step(seen: list[bool]):
    def step_of(model_dir: Path, batch: list):
        def step() -> None:
            seen.append(torch.are_deterministic_algorithms_enabled())
            with phase("raw.forward"):
                torch.ones(4, 4).matmul(torch.ones(4, 4))

        return step, 16.0, "cpu"

    return step_of


@pytest.mark.parametrize(("env", "expected"), [("1", True), ("0", False)])
def test_raw_loop_follows_the_service_setting(monkeypatch, env, expected):
    seen: list[bool] = []
    monkeypatch.setenv("TREADLE_TRAINER_DETERMINISTIC", env)
    monkeypatch.setattr(trainer, "_raw_step", scripted_step(seen))
    before = torch.are_deterministic_algorithms_enabled()
    assert trainer._raw(Path("unused"), [], 1) > 0
    assert seen == [expected, expected]  # the warm-up step, the measured one
    assert torch.are_deterministic_algorithms_enabled() == before


def test_raw_loop_profiles_one_more_step(monkeypatch, tmp_path):
    seen: list[bool] = []
    monkeypatch.setattr(trainer, "_raw_step", scripted_step(seen))
    assert trainer._raw(Path("unused"), [], 2, profile_dir=tmp_path) > 0
    assert len(seen) == 4  # warm-up, 2 measured, the profiled one
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == ["step-4.json.gz", "step-4.txt"]
    table = (tmp_path / "raw" / "step-4.txt").read_text()
    assert "# phases (totals)\nraw.forward " in table and "aten::mm" in table
    trace = json.loads(gzip.decompress((tmp_path / "raw" / "step-4.json.gz").read_bytes()))
    assert "raw.forward" in {event.get("name") for event in trace["traceEvents"]}
