"""Workspace shape: services depend on treadle-common only; reward/env-gateway stay torch-free."""

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
TORCH_STACK = ("torch", "transformers", "tokenizers")


def deps(path: Path) -> list[str]:
    return tomllib.loads(path.read_text())["project"]["dependencies"]


@pytest.mark.parametrize("service", ["rollout", "trainer", "env-gateway", "weight-store", "reward"])
def test_services_depend_on_common_and_no_other_service(service):
    names = [
        d.split("[")[0].split(">")[0].split("=")[0]
        for d in deps(ROOT / "services" / service / "pyproject.toml")
    ]
    assert "treadle-common" in names
    assert not [n for n in names if n.startswith("treadle-") and n != "treadle-common"]


@pytest.mark.parametrize("service", ["reward", "env-gateway", "weight-store"])
def test_light_services_do_not_pull_torch(service):
    service_deps = deps(ROOT / "services" / service / "pyproject.toml")
    assert "treadle-common" in service_deps  # without the [hf] extra
    assert not [d for d in service_deps if d.startswith(TORCH_STACK)]
    common = deps(ROOT / "libs/common/pyproject.toml")
    assert not [d for d in common if d.startswith(TORCH_STACK)]
