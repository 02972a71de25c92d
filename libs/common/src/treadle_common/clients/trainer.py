"""Trainer clients over its HTTP API: runs (`TrainerClient`, synchronous: the CLI polls it)
and Tinker-style training sessions (`TrainingClient`, asynchronous). Both return the API's
models (`treadle_common.api`), never dicts."""

from __future__ import annotations

import httpx

from treadle_common.api.runs import Backlog, EvaluationDone, RunStatus, TrainerInfo
from treadle_common.api.training import (
    AdamParams,
    CreateSession,
    ForwardBackward,
    ForwardBackwardResult,
    LoadedState,
    LoadState,
    OptimStepResult,
    SavedState,
    SavedWeights,
    SaveState,
    SessionCreated,
)
from treadle_common.auth import tls
from treadle_common.auth.policy import bearer, token_from_env
from treadle_common.clients.http import parse, parse_list
from treadle_common.config.recipe import RunConfig


class TrainerClient:
    def __init__(self, base_url: str, http: httpx.Client | None = None, timeout_s: float = 30.0):
        """`http`: a shared client (it carries the caller's token); without one, a client
        presenting `TREADLE_TOKEN`."""
        self.base_url = base_url.rstrip("/")
        self.http = http or httpx.Client(
            timeout=timeout_s, headers=bearer(token_from_env()), verify=tls.httpx_verify()
        )
        self.timeout_s = timeout_s

    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def start_run(self, config: RunConfig) -> RunStatus:
        """Submit a run (202); `ApiError` when the trainer refuses it (409: the id is taken)."""
        body = config.model_dump(mode="json")
        response = self.http.post(self._url("/v1/runs"), json=body, timeout=self.timeout_s)
        return parse(response, RunStatus)

    def get_run(self, run_id: str, steps_from: int = 0) -> RunStatus:
        """The run's status; its step records from index `steps_from` on."""
        response = self.http.get(
            self._url(f"/v1/runs/{run_id}"),
            params={"steps_from": steps_from},
            timeout=self.timeout_s,
        )
        return parse(response, RunStatus)

    def list_runs(self) -> list[RunStatus]:
        response = self.http.get(self._url("/v1/runs"), timeout=self.timeout_s)
        return parse_list(response, RunStatus)

    def evaluation_done(
        self, run_id: str, step: int, mean_reward: float | None = None, num_tasks: int = 0
    ) -> RunStatus:
        done = EvaluationDone(step=step, mean_reward=mean_reward, num_tasks=num_tasks)
        response = self.http.post(
            self._url(f"/v1/runs/{run_id}/evaluations"),
            json=done.model_dump(),
            timeout=self.timeout_s,
        )
        return parse(response, RunStatus)

    def backlog(self) -> Backlog:
        return parse(self.http.get(self._url("/v1/backlog"), timeout=self.timeout_s), Backlog)

    def info(self) -> TrainerInfo:
        return parse(self.http.get(self._url("/v1/info"), timeout=self.timeout_s), TrainerInfo)


class TrainingClient:
    """One training session at a time is the common use; every call names its session."""

    def __init__(self, base_url: str, timeout_s: float = 300.0, token: str | None = None):
        """`token`: the bearer token it presents (default `TREADLE_TOKEN`)."""
        token = token if token is not None else token_from_env()
        self.http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout_s, headers=bearer(token), verify=tls.httpx_verify()
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def create_session(self, request: CreateSession) -> SessionCreated:
        response = await self.http.post("/v1/training/sessions", json=request.model_dump())
        return parse(response, SessionCreated)

    async def forward_backward(self, sid: str, request: ForwardBackward) -> ForwardBackwardResult:
        body = request.model_dump(exclude_none=True)
        response = await self.http.post(f"/v1/training/sessions/{sid}/forward_backward", json=body)
        return parse(response, ForwardBackwardResult)

    async def optim_step(self, sid: str, adam: AdamParams) -> OptimStepResult:
        response = await self.http.post(
            f"/v1/training/sessions/{sid}/optim_step", json=adam.model_dump()
        )
        return parse(response, OptimStepResult)

    async def save_weights(self, sid: str) -> SavedWeights:
        response = await self.http.post(f"/v1/training/sessions/{sid}/save_weights")
        return parse(response, SavedWeights)

    async def save_state(self, sid: str, request: SaveState) -> SavedState:
        response = await self.http.post(
            f"/v1/training/sessions/{sid}/save_state", json=request.model_dump()
        )
        return parse(response, SavedState)

    async def load_state(self, sid: str, request: LoadState) -> LoadedState:
        response = await self.http.post(
            f"/v1/training/sessions/{sid}/load_state", json=request.model_dump()
        )
        return parse(response, LoadedState)

    async def delete_session(self, sid: str) -> None:
        response = await self.http.delete(f"/v1/training/sessions/{sid}")
        if response.status_code != 404:  # already gone is gone
            response.raise_for_status()
