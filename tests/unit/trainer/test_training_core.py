"""The training-session core (`training/core.py`) that `/v1/training` and Tinker share: its
limit counts models being built, a model is its creator's owner's, work on one model runs one
call at a time in order, and a model dropped while it is built is closed."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from treadle_common.auth import policy as auth
from treadle_trainer import errors
from treadle_trainer.training.core import Trainables

pytestmark = pytest.mark.unit


@dataclass
class Model:
    steps: int = 0
    closed: bool = False
    calls: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.closed = True


def as_tenant(tenant: str) -> None:
    auth.CALLER.set(auth.Identity(auth.Role.trainer, tenant, scoped=True))


async def test_the_limit_counts_a_model_being_built_and_a_failed_build_frees_it():
    as_tenant("a")
    models: Trainables[Model] = Trainables("training session", 1, "TREADLE_X", "delete one")
    models.reserve("one")
    with pytest.raises(errors.TooManyRequests, match=r"TREADLE_X=1\); delete one"):
        models.reserve("two")
    with pytest.raises(errors.NotFound):
        models.get("one")  # reserved, not built: nobody may use it yet

    def fails() -> Model:
        raise ValueError("no such model")

    with pytest.raises(ValueError):
        await models.build("one", fails)
    models.reserve("two")  # the failed build's place is free
    assert await models.build("two", Model) is models.get("two")
    with pytest.raises(errors.Conflict):
        models.reserve("two")


async def test_a_model_is_its_creators_owners_and_admin_sees_all():
    as_tenant("a")
    models: Trainables[Model] = Trainables("training session", 4, "TREADLE_X", "delete one")
    models.reserve("mine")
    await models.build("mine", Model)
    as_tenant("b")
    with pytest.raises(auth.AuthError, match="another tenant"):
        models.get("mine")
    with pytest.raises(auth.AuthError):
        await models.run("mine", lambda m: m.calls.append("b"))
    auth.CALLER.set(auth.Identity(auth.Role.admin))
    await models.run("mine", lambda m: m.calls.append("admin"))
    as_tenant("a")
    assert models.get("mine").calls == ["admin"]


async def test_work_on_one_model_runs_one_call_at_a_time_in_arrival_order():
    as_tenant("a")
    models: Trainables[Model] = Trainables("training client", 4, "TREADLE_X", "end one")
    models.reserve("m")
    model = await models.build("m", Model)
    inside, most = 0, 0
    guard = threading.Lock()

    def work(tag: str):
        def run(m: Model) -> str:
            nonlocal inside, most
            with guard:
                inside += 1
                most = max(most, inside)
            threading.Event().wait(0.01)
            m.calls.append(tag)
            with guard:
                inside -= 1
            return tag

        return run

    tags = [str(i) for i in range(8)]
    done = await asyncio.gather(*(models.run("m", work(t)) for t in tags))
    assert done == tags and model.calls == tags and most == 1


async def test_a_model_dropped_while_it_is_built_is_closed_and_refused():
    as_tenant("a")
    models: Trainables[Model] = Trainables("training client", 4, "TREADLE_X", "end one")
    models.reserve("m")
    started, release = threading.Event(), threading.Event()
    built: list[Model] = []

    def slow() -> Model:
        started.set()
        release.wait(10)
        built.append(Model())
        return built[0]

    building = asyncio.create_task(models.build("m", slow))
    await asyncio.to_thread(started.wait, 10)
    await models.drop("m")  # the session ended meanwhile
    assert "m" not in models
    release.set()
    with pytest.raises(errors.InvalidInput, match="deleted while it was built"):
        await building
    assert built[0].closed and len(models) == 0
