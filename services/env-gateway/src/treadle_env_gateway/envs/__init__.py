"""Environments: the registry. `base.py` holds the interface (`Env`, messages, results).

The built-ins, those of installed packages (entry-point group `treadle.envs`) and those
modules named in `TREADLE_ENV_MODULES` add with `@register` when imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from treadle_env_gateway.envs.base import Env

BUILTIN_MODULES = (
    "arith",
    "calculator",
    "countdown",
    "frozenlake",
    "guess_number",
    "python_tests",
    "vf",
    "vf1",
)
_REGISTERED: dict[str, type[Env]] = {}


def register(name: str) -> Callable[[type[Env]], type[Env]]:
    """Class decorator: an env under `name` (imported modules register theirs)."""

    def wrap(cls: type[Env]) -> type[Env]:
        _REGISTERED[name] = cls
        return cls

    return wrap


def registry(extra_modules: tuple[str, ...] = ()) -> dict[str, type[Env]]:
    """Every env class by name: the built-ins, `extra_modules`' and installed packages'."""
    for module in (*(f"{__name__}.{m}" for m in BUILTIN_MODULES), *extra_modules):
        importlib.import_module(module)
    envs = dict(_REGISTERED)
    for ep in entry_points(group="treadle.envs"):
        envs.setdefault(ep.name, ep.load())
    return envs
