"""Trainer client: submit runs and follow them over the trainer's HTTP API."""

from __future__ import annotations

import httpx

from treadle_common.config import RunConfig


class TrainerClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0):
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s)

    async def close(self) -> None:
        await self.http.aclose()

    async def start_run(self, config: RunConfig) -> dict:
        response = await self.http.post("/v1/runs", json=config.model_dump(mode="json"))
        response.raise_for_status()
        return response.json()

    async def get_run(self, run_id: str) -> dict:
        response = await self.http.get(f"/v1/runs/{run_id}")
        response.raise_for_status()
        return response.json()

    async def list_runs(self) -> list[dict]:
        response = await self.http.get("/v1/runs")
        response.raise_for_status()
        return response.json()
