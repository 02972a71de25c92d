"""The trainer's HTTP edge: handlers of a few lines over its cores. Refusals are
`errors.py`'s, answered by the service runtime.

    POST /v1/runs (a recipe as JSON) --> `runs.Runs.start`: lease, quota, model claim, run
    GET  /v1/runs, /v1/runs/{id}      status, steps (from `steps_from`), counters, drops: the
                                      caller's tenant's runs only (admin: all; else 403)
    POST /v1/runs/{id}/evaluations    the client evaluated a step: a sync run held there goes on
    GET  /v1/backlog                  work waiting in Redis, by model (KEDA scales rollout on it)
    GET  /v1/usage                    what this trainer's runs used, by tenant
    /v1/training/...                  caller-owned training sessions (`training/api_router.py`)
    /api/v1/...                       the Tinker SDK's API (`tinker/api_router.py`)
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request

from treadle_common import names
from treadle_common.api.runs import Backlog, EvaluationDone, RunStatus, Usage
from treadle_common.auth import policy as auth
from treadle_common.config.recipe import RunConfig
from treadle_trainer.run import claims
from treadle_trainer.run.status_store import stored_status
from treadle_trainer.runs import Runs
from treadle_trainer.tinker.api_router import router as tinker_router
from treadle_trainer.training.api_router import router as training_router

router = APIRouter()
router.include_router(training_router)
router.include_router(tinker_router)
RunId = Annotated[str, Path(pattern=names.ID_PATTERN, description="A run id (names.ID_PATTERN)")]
StepsFrom = Annotated[
    int,
    Query(
        ge=0,
        description="Only the step records from this index on (a polling client asks for the "
        "ones it has not seen: the answer stays small in a long run)",
    ),
]


def the_runs(request: Request) -> Runs:
    return request.app.state.runs


def caller(request: Request) -> auth.Identity:
    return request.state.identity


RunsCore = Annotated[Runs, Depends(the_runs)]
Caller = Annotated[auth.Identity, Depends(caller)]


@router.post("/v1/runs", status_code=202, tags=["runs"], openapi_extra=auth.roles(auth.TRAINER))
async def start(config: RunConfig, runs: RunsCore, who: Caller) -> RunStatus:
    return await runs.start(config, who.tenant)


@router.get("/v1/backlog", tags=["runs"], openapi_extra=auth.roles(auth.ANY))
async def backlog(runs: RunsCore) -> Backlog:
    """Work waiting in Redis for the active runs (KEDA scales rollout on `tasks_waiting`)."""
    return await claims.backlog(runs.runtime.redis)


@router.get("/v1/usage", tags=["runs"], openapi_extra=auth.roles(auth.ANY))
async def usage(runs: RunsCore, who: Caller) -> dict[str, Usage]:
    """What the runs this trainer owns used, summed by tenant (the caller's only; admin:
    every tenant's)."""
    return claims.usage_by_tenant([o.status for o in runs.owners.values()], who)


@router.get("/v1/runs", tags=["runs"], openapi_extra=auth.roles(auth.ANY))
async def list_runs(runs: RunsCore, who: Caller) -> list[RunStatus]:
    """The caller's tenant's runs this trainer owns (admin: every tenant's)."""
    return [o.status for o in runs.owners.values() if who.may_see(o.status.tenant)]


@router.get("/v1/runs/{run_id}", tags=["runs"], openapi_extra=auth.roles(auth.ANY))
async def get_run(
    run_id: RunId, runs: RunsCore, who: Caller, steps_from: StepsFrom = 0
) -> RunStatus:
    """Any trainer answers for any run: the owner from memory, the others from the status its
    owner keeps in Redis (so a client rides through the owner's restart or a handoff to
    another trainer). Another tenant's run: 403."""
    status = runs.status(run_id, steps_from, who)
    if status is not None:
        return status
    return claims.visible(await stored_status(runs.runtime.redis, run_id, steps_from), who)


@router.post("/v1/runs/{run_id}/evaluations", tags=["runs"], openapi_extra=auth.roles(auth.TRAINER))
async def evaluated(
    run_id: RunId, report: EvaluationDone, runs: RunsCore, who: Caller
) -> RunStatus:
    """The client evaluated the weights of `step`: a sync run holding there goes on."""
    return await runs.evaluated(run_id, report, who)
