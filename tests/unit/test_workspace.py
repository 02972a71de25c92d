"""Workspace shape: services depend on treadle-common only; reward/env-gateway stay torch-free;
every service has the same shape. (Which module may import which is import-linter's: the
contracts in pyproject.toml, checked by `make lint`.)"""

import subprocess
import sys
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


def test_only_the_cli_distribution_owns_the_treadle_script():
    owners = {
        path.parent.name: tomllib.loads(path.read_text())["project"].get("scripts", {})
        for path in [
            ROOT / "pyproject.toml",
            ROOT / "bench/pyproject.toml",
            *ROOT.glob("libs/*/pyproject.toml"),
        ]
    }
    assert {name for name, scripts in owners.items() if "treadle" in scripts} == {"cli"}
    assert owners["cli"]["treadle"] == "treadle_cli.cli:main"
    bench = tomllib.loads((ROOT / "bench/pyproject.toml").read_text())["project"]
    assert bench["entry-points"]["treadle.commands"] == {"bench": "treadle_bench.cli:app"}


def test_the_installed_treadle_script_runs_with_its_plugins():
    script = Path(sys.executable).parent / "treadle"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    assert "bench" in out.stdout and "run" in out.stdout  # the plug-in joined the core commands
    out = subprocess.run(
        [str(script), "bench", "--help"], capture_output=True, text=True, check=True
    )
    assert "step" in out.stdout and "e2e" in out.stdout


SERVICE_PACKAGES = {
    "treadle_rollout",
    "treadle_trainer",
    "treadle_env_gateway",
    "treadle_weight_store",
    "treadle_reward",
}
PACKAGES = {
    name: ROOT / "services" / name.removeprefix("treadle_").replace("_", "-") / "src" / name
    for name in SERVICE_PACKAGES
}


# --- one service shape ----------------------------------------------------------------------
@pytest.mark.parametrize("package", sorted(SERVICE_PACKAGES))
def test_every_service_has_the_same_shape(package):
    """`settings.py` (its own settings class), `app.py` with `async build(settings) ->
    Service`, its HTTP edge in `http.py` (a module-level `router`, which may include its
    features' routers), its refusals in `errors.py` (`treadle_common.runtime.errors` classes),
    what it offers code outside it in `public.py` (every name in `__all__` importable);
    `__main__` runs it with that settings class; nothing reads a global settings object."""
    import importlib
    import inspect
    import typing

    from treadle_common.config.settings import Settings
    from treadle_common.runtime.service import Service

    root = PACKAGES[package]
    files = {p.name for p in root.iterdir()}
    assert {"app.py", "settings.py", "__main__.py", "http.py", "errors.py", "public.py"} <= files
    public = importlib.import_module(f"{package}.public")
    assert public.__all__ and all(hasattr(public, name) for name in public.__all__)
    from fastapi import APIRouter

    from treadle_common.runtime.errors import ServiceError

    assert isinstance(importlib.import_module(f"{package}.http").router, APIRouter)
    service_errors = importlib.import_module(f"{package}.errors")
    assert any(
        isinstance(v, type) and issubclass(v, ServiceError) for v in vars(service_errors).values()
    )
    app = importlib.import_module(f"{package}.app")
    assert inspect.iscoroutinefunction(app.build)
    hints = typing.get_type_hints(app.build)
    assert hints["return"] is Service
    assert issubclass(hints["settings"], Settings) and hints["settings"] is not Settings
    main = (root / "__main__.py").read_text()
    # run_service(app, Settings) or run_service(app, Settings, prepare=...)
    call = f'run_service("{package}.app", {hints["settings"].__name__}'
    assert f"{call})" in main or f"{call}, prepare=" in main
    for module in root.rglob("*.py"):
        assert "get_settings" not in module.read_text(), module
