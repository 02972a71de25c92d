"""What a conformance suite is, and the report it makes.

A suite is an ordered list of `Check`s, each one documented behaviour a client of an API
relies on (its `behaviour` sentence is what the docs list). Running a suite against a server
runs every check in order; a check passes, fails (an `expect` that did not hold, or any
error: the detail says which) or is skipped (`Skip`: it does not apply to that server, for
example an authentication check against a server without keys). The `Report` is a table a
user can put next to another server's, and JSON for machines.

    suite = Suite("openai")

    @suite.check("models.list", "GET /models lists the model under test")
    def models(ctx): expect(ctx.model in ids, f"{ctx.model} not in {ids}")
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

Ctx = TypeVar("Ctx")


class CheckFailed(Exception):
    """A behaviour did not hold; the message says what was seen."""


class Skip(Exception):
    """The check does not apply to this server; the message says why."""


def expect(condition: object, message: str) -> None:
    """Fail the running check with `message` unless `condition` holds."""
    if not condition:
        raise CheckFailed(message)


class Status(StrEnum):
    passed = "pass"
    failed = "FAIL"
    skipped = "skip"


@dataclass(frozen=True)
class Check(Generic[Ctx]):
    id: str
    """Stable name (`area.behaviour`), the same across servers and releases."""
    behaviour: str
    """The behaviour, in one sentence: what the docs list."""
    run: Callable[[Ctx], None]


@dataclass(frozen=True)
class Outcome:
    check: str
    status: Status
    detail: str
    """Why it failed or was skipped; empty when it passed."""
    seconds: float


@dataclass
class Suite(Generic[Ctx]):
    name: str
    checks: list[Check[Ctx]] = field(default_factory=list)

    def check(self, id: str, behaviour: str) -> Callable[[Callable[[Ctx], None]], Callable]:
        """Register the decorated function as the check `id`."""

        def register(run: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
            if any(c.id == id for c in self.checks):
                raise ValueError(f"check {id!r} is registered twice")
            self.checks.append(Check(id, behaviour, run))
            return run

        return register

    def select(self, only: list[str] | None) -> list[Check[Ctx]]:
        """The checks whose id starts with one of `only` (all of them without it)."""
        if not only:
            return list(self.checks)
        chosen = [c for c in self.checks if any(c.id.startswith(o) for o in only)]
        if not chosen:
            raise ValueError(f"no check of the {self.name} suite matches {only}")
        return chosen

    def run(self, ctx: Ctx, server: str, only: list[str] | None = None) -> Report:
        outcomes = [run_one(check, ctx) for check in self.select(only)]
        return Report(self.name, server, outcomes)


def run_one(check: Check[Ctx], ctx: Ctx) -> Outcome:
    start = time.perf_counter()
    try:
        check.run(ctx)
        status, detail = Status.passed, ""
    except Skip as exc:
        status, detail = Status.skipped, str(exc)
    except CheckFailed as exc:
        status, detail = Status.failed, str(exc)
    except Exception as exc:  # a server that errors where it should answer fails the check
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        status = Status.failed
        detail = f"{type(exc).__name__}: {exc} (at {frame.name}:{frame.lineno})"
    return Outcome(check.id, status, detail, round(time.perf_counter() - start, 3))


@dataclass
class Report:
    suite: str
    server: str
    outcomes: list[Outcome]

    def count(self, status: Status) -> int:
        return sum(o.status is status for o in self.outcomes)

    @property
    def ok(self) -> bool:
        """No check failed."""
        return self.count(Status.failed) == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "server": self.server,
            "passed": self.count(Status.passed),
            "failed": self.count(Status.failed),
            "skipped": self.count(Status.skipped),
            "checks": [
                {"id": o.check, "status": o.status.name, "detail": o.detail, "seconds": o.seconds}
                for o in self.outcomes
            ],
        }
