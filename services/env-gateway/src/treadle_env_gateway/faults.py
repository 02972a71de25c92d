"""Fault injection: envs that fail episodes, for failure-semantics tests and drills.

Session option `faults`, one rule or a list of rules (the first rule that picks an episode
applies to it):
    {"fail_first": 1}                    every episode's first session fails
    {"fail_first": 99, "rate": 0.25}     a quarter of the episodes fail their first 99
An episode is its (task, seed): rollout plays a failed episode again with the same seed, so
an episode's n-th session on this gateway is its n-th attempt. A rule picks an episode by a
hash of the episode and the rule's place in the list (`rate` of them; 1 by default), so the
same episodes fail in every run. A failing session opens, and its first step ends it as an
env that raises would (`env_error`, the gateway's own path for an env's bug; failing the
open instead would fail the other sessions of a group opened in the same call). Attempts
are counted per gateway process, for the last `MAX_TRACKED` episodes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from treadle_env_gateway.envs.base import EnvError, option

MAX_TRACKED = 100_000
"""Episodes whose attempts one gateway process remembers (the oldest are forgotten)."""
MAX_RULES = 16


class Faults:
    def __init__(self) -> None:
        self.attempts: OrderedDict[str, int] = OrderedDict()
        """Episode key -> sessions opened for it so far."""

    def check(self, options: dict[str, Any], episode: str) -> str | None:
        """Count a session of `episode`; why it fails when a rule says it does, else None."""
        rules = parse(options)
        if not rules:
            return None
        n = self.attempts.pop(episode, 0) + 1
        self.attempts[episode] = n
        while len(self.attempts) > MAX_TRACKED:
            self.attempts.popitem(last=False)
        for index, (fail_first, rate) in enumerate(rules):
            if _pick(episode, index) < rate:
                if n <= fail_first:
                    return (
                        f"injected fault (option 'faults' rule {index}): attempt {n} of this "
                        f"episode fails, the first {fail_first} do"
                    )
                return None
        return None


def parse(options: dict[str, Any]) -> list[tuple[int, float]]:
    """The `faults` option as (fail_first, rate) rules; an `EnvError` naming what is wrong."""
    spec = options.get("faults")
    if spec is None:
        return []
    rules = spec if isinstance(spec, list) else [spec]
    if len(rules) > MAX_RULES or not all(isinstance(r, dict) for r in rules):
        raise EnvError(
            f"option 'faults' must be an object or a list of at most {MAX_RULES} objects, "
            'e.g. {"fail_first": 1}'
        )
    out = []
    for rule in rules:
        unknown = set(rule) - {"fail_first", "rate"}
        if unknown:
            raise EnvError(f"option 'faults' has unknown keys {sorted(unknown)}")
        out.append(
            (option(rule, "fail_first", 1, 0, 1_000_000), option(rule, "rate", 1.0, 0.0, 1.0))
        )
    return out


def _pick(episode: str, index: int) -> float:
    """A number in [0, 1) fixed by the episode and the rule."""
    digest = hashlib.sha256(f"{index}:{episode}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
