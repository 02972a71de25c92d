"""A stack that serves both APIs Treadle speaks to outside clients: weight-store,
env-gateway, rollout serving the tiny model as `tiny` (its OpenAI API at `{rollout}/v1`),
and a trainer whose Tinker API trains LoRA adapters on it and samples through that rollout."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from tests.support.services import InfraUrls, ServiceProc, start_service


@contextlib.contextmanager
def tinker_stack(
    infra: InfraUrls,
    tmp_path: Path,
    tiny_model: Path,
    max_clients: int | None = 3,
    name: str = "tiny",
    rollout_name: str | None = "tiny",
) -> Iterator[tuple[ServiceProc, ServiceProc, ServiceProc]]:
    """(trainer, weight-store, rollout); every process is stopped and checked after. `name`:
    the base model's Tinker name; `rollout_name`: rollout's name of it (None: its default,
    the directory's name); `max_clients` None: the trainer's default."""
    procs: list[ServiceProc] = []
    try:
        (tmp_path / "ws").mkdir()
        store = start_service("weight-store", infra, tmp_path / "ws")
        procs.append(store)
        gateway = start_service("env-gateway", infra, tmp_path)
        procs.append(gateway)
        addrs = {
            "TREADLE_WEIGHT_STORE_ADDR": store.grpc_addr or "",
            "TREADLE_ENV_GATEWAY_ADDR": gateway.grpc_addr or "",
        }
        named = {"TREADLE_ROLLOUT_MODEL_NAME": rollout_name} if rollout_name else {}
        model = str(tiny_model)
        rollout = start_service(
            "rollout", infra, tmp_path, TREADLE_ROLLOUT_MODEL=model, **named, **addrs
        )
        procs.append(rollout)
        trainer = start_service(
            "trainer",
            infra,
            tmp_path,
            TREADLE_TRAINER_TINKER_MODELS=json.dumps({name: model}),
            **({"TREADLE_TRAINER_TINKER_MAX_CLIENTS": str(max_clients)} if max_clients else {}),
            TREADLE_TRAINER_ROLLOUT_URL=rollout.http,
            **addrs,
        )
        procs.append(trainer)
        yield trainer, store, rollout
    finally:
        for proc in reversed(procs):
            proc.stop_checked()
