"""`treadle bench` prints JSON with our path, the baseline and the ratio (no timing asserts)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_bench_weights_json_reports_delta_bytes():
    treadle = str(Path(sys.executable).parent / "treadle")
    result = subprocess.run(
        [
            treadle,
            "bench",
            "weights",
            "--json",
            "--size-mb",
            "4",
            "--num-tensors",
            "8",
            "--changed",
            "0.25",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ours_full_bytes_sent"] == report["ours_full_bytes_fetched"] == 4 * 2**20
    assert (
        report["ours_delta_bytes_sent"] == report["ours_delta_bytes_fetched"] == 2**20
    )  # 2 of 8 tensors
    assert report["ratio_delta"] == pytest.approx(
        report["baseline_safetensors_sync_s"] / report["ours_delta_sync_s"], rel=0.01
    )
