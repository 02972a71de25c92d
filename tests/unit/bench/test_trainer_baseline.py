"""`bench trainer`'s plain loop trains under the service's choice of deterministic
algorithms (`TREADLE_TRAINER_DETERMINISTIC`), and leaves the process's setting as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treadle_bench import trainer


@pytest.mark.parametrize(("env", "expected"), [("1", True), ("0", False)])
def test_raw_loop_follows_the_service_setting(monkeypatch, env, expected):
    seen: list[bool] = []

    def loop(model_dir: Path, batch: list, steps: int) -> float:
        seen.append(torch.are_deterministic_algorithms_enabled())
        return 1.0

    monkeypatch.setenv("TREADLE_TRAINER_DETERMINISTIC", env)
    monkeypatch.setattr(trainer, "_raw_loop", loop)
    before = torch.are_deterministic_algorithms_enabled()
    assert trainer._raw(Path("unused"), [], 1) == 1.0
    assert seen == [expected]
    assert torch.are_deterministic_algorithms_enabled() == before
