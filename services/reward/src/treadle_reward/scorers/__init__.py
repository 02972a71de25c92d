"""Scorers: the registry. `base.py` holds the interface (`Scorer`, `ScoreInput`, `Score`).

The built-ins, those of installed packages (entry-point group `treadle.scorers`) and those
modules named in `TREADLE_SCORER_MODULES` add with `@register` when imported. Each scorer is
built from the reward service's settings (`Scorer.from_settings`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from treadle_reward.scorers.base import Scorer
from treadle_reward.settings import RewardSettings

BUILTIN_MODULES = (
    "code_tests",
    "composite",
    "digit_match",
    "env_reward",
    "exact_match",
    "format_regex",
    "llm_judge",
    "math_verify",
    "reward_model",
)
_REGISTERED: dict[str, type[Scorer]] = {}


def register(name: str) -> Callable[[type[Scorer]], type[Scorer]]:
    """Class decorator: a scorer under `name` (imported modules register theirs)."""

    def wrap(cls: type[Scorer]) -> type[Scorer]:
        cls.name = name
        _REGISTERED[name] = cls
        return cls

    return wrap


def registry(
    settings: RewardSettings | None = None, extra_modules: tuple[str, ...] = ()
) -> dict[str, Scorer]:
    """An instance of every scorer by name: the built-ins, `extra_modules`' and installed
    packages', each configured from `settings` (the defaults when none are given)."""
    for module in (*(f"{__name__}.{m}" for m in BUILTIN_MODULES), *extra_modules):
        importlib.import_module(module)
    classes = dict(_REGISTERED)
    for ep in entry_points(group="treadle.scorers"):
        classes.setdefault(ep.name, ep.load())
    settings = settings or RewardSettings()
    scorers = {name: cls.from_settings(settings) for name, cls in classes.items()}
    scorers["composite"].registry = scorers  # type: ignore[attr-defined]
    return scorers
