"""Rollout's HTTP API: `/v1/info` (what it serves, how busy, weight sync; mounted by the
runtime), `/v1/swaps`, `/v1/evaluate` (`evaluate.py`), LoRA adapters (`adapters.py`) and the
OpenAI-compatible API (`openai_api.py`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from treadle_common import auth
from treadle_common.api.rollout import RolloutInfo, Swap, Swaps
from treadle_common.service import ServiceRuntime
from treadle_rollout import adapters, evaluate, metrics, openai_api

if TYPE_CHECKING:
    from treadle_rollout.app import Rollout


def mount(runtime: ServiceRuntime, rollout: Rollout) -> None:
    app: FastAPI = runtime.app
    openai_api.mount(app, rollout.frontend)
    adapters.mount(app, rollout.engine, rollout.store)
    evaluate.mount(app, lambda: rollout.worker.runner if rollout.worker else None, rollout.policies)
    runtime.set_info(lambda: info(rollout), RolloutInfo)

    @app.get("/v1/swaps", tags=["weights"], openapi_extra=auth.roles(auth.ANY))
    async def swaps() -> Swaps:
        return Swaps(swaps=[Swap(**asdict(s)) for s in rollout.sync.swaps])


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
        "admission_waits": worker.admission_waits if worker else 0,
        "trajectories_pushed": worker.trajectories_pushed if worker else 0,
        "recorded_sessions": len(rollout.frontend.recorder.sessions),
    }
