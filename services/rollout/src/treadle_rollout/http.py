"""Rollout's HTTP edge: one router of handlers of a few lines over the service's parts
(`app.Rollout`): `/v1/swaps`, `/v1/evaluate` (`evaluate.py`), LoRA adapters (`adapters.py`),
and the OpenAI-compatible API (`openai_router.py`). `/v1/info` (what it serves, how busy,
weight sync) is the runtime's, with `info` below as its rollout fields. Refusals are
`errors.py`'s."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from treadle_common.api.rollout import (
    Adapters,
    EvaluateRequest,
    EvaluateResult,
    LoadAdapter,
    Swap,
    Swaps,
)
from treadle_common.auth import policy as auth
from treadle_rollout import adapters, evaluate, metrics
from treadle_rollout.openai_router import router as openai_router
from treadle_rollout.replica import Rollout

router = APIRouter()
router.include_router(openai_router)


def the_rollout(request: Request) -> Rollout:
    return request.app.state.rollout


Service = Annotated[Rollout, Depends(the_rollout)]


@router.get("/v1/swaps", tags=["weights"], openapi_extra=auth.roles(auth.ANY))
async def swaps(rollout: Service) -> Swaps:
    return Swaps(swaps=[Swap(**asdict(s)) for s in rollout.sync.swaps])


@router.post("/v1/evaluate", tags=["evaluate"], openapi_extra=auth.roles(auth.WORKERS))
async def evaluate_tasks(request: EvaluateRequest, rollout: Service) -> EvaluateResult:
    runner = rollout.worker.runner if rollout.worker else None
    return await evaluate.evaluate(runner, rollout.policies, request)


@router.post("/v1/adapters", tags=["adapters"], openapi_extra=auth.roles(auth.TRAINER))
async def load_adapter(request: LoadAdapter, rollout: Service) -> Adapters:
    return await adapters.load(rollout.engine, rollout.store, request)


@router.get("/v1/adapters", tags=["adapters"], openapi_extra=auth.roles(auth.ANY))
async def list_adapters(rollout: Service) -> Adapters:
    return Adapters(adapters=rollout.engine.adapters())


@router.delete(
    "/v1/adapters/{name}",
    tags=["adapters"],
    openapi_extra=auth.roles(auth.TRAINER),
    status_code=204,
)
async def unload_adapter(name: str, rollout: Service) -> None:
    await adapters.unload(rollout.engine, name)


def info(rollout: Rollout) -> dict[str, Any]:
    """`/v1/info`'s rollout fields (`RolloutInfo`)."""
    engine, sync, worker = rollout.engine, rollout.sync, rollout.worker
    metrics.ENGINE_RUNNING.set(engine.running)
    return {
        "model": rollout.model_name,
        "model_dir": str(rollout.model_dir.resolve()),
        "engine": engine.name,
        "swap_policy": rollout.settings.rollout_swap_policy,
        "policy_version": engine.version,
        "policies": rollout.policies.info(),
        "version_lag": sync.version_lag,
        "weight_sync_error": sync.last_error,
        "swaps": len(sync.swaps),
        "last_swap": asdict(sync.swaps[-1]) if sync.swaps else None,
        "engine_stats": engine.stats(),
        "engine_requests": engine.running,
        "engine_busy_fraction": round(engine.busy_fraction(), 4),
        "engine_busy_s": round(engine.busy_seconds(), 3),
        "tasks_done": worker.tasks_done if worker else 0,
        "tasks_invalid": worker.invalid_tasks if worker else 0,
        "tasks_cancelled": worker.cancelled_tasks if worker else 0,
        "admission_waits": worker.groups.admission_waits if worker else 0,
        "trajectories_pushed": worker.trajectories_pushed if worker else 0,
        "recorded_sessions": len(rollout.frontend.recorder.sessions),
    }
