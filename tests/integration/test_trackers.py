"""`logging.trackers`: a run handed from one trainer process to another (SIGTERM) logs to W&B
(offline), MLflow (a file store) and TensorBoard; each tracker's own reader gets back one
tracker run with every step, an evaluation and the final summary."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from tests.integration.test_trainer_run import (
    GROUPS_PER_STEP,
    handoff_recipe,
    start_trainer,
    wait_run,
)
from tests.support import wandb_records
from tests.support.services import ADMIN, start_service
from treadle_bench.synthetic_rollout import SyntheticRollout
from treadle_common.clients.weights import WeightStoreClient

pytestmark = pytest.mark.integration
STEPS = 4


@pytest.fixture(scope="module")
def tracked_run(infra, tmp_path_factory, tiny_model) -> Iterator[dict]:
    """A 4-step run tracked by all three, handed off after step 2, evaluated at step 2."""
    tmp_path = tmp_path_factory.mktemp("tracked")
    (tmp_path / "ws").mkdir()
    weight_store = start_service("weight-store", infra, tmp_path / "ws")
    run = f"tracked-{uuid.uuid4().hex[:6]}"
    recipe = handoff_recipe(run, tmp_path, tiny_model, steps=STEPS)
    recipe["logging"] = {
        "trackers": [
            {"type": "wandb", "mode": "offline", "project": "treadle-test"},
            {"type": "mlflow", "experiment": "treadle-test"},
            {"type": "tensorboard"},
        ]
    }
    try:
        yield asyncio.run(_handed_off_run(infra, tmp_path, recipe, tiny_model, weight_store))
    finally:
        weight_store.stop_checked()


async def _handed_off_run(infra, tmp_path, recipe, tiny_model, weight_store) -> dict:
    run = recipe["run_id"]
    r = aioredis.from_url(infra.redis_url)
    store = WeightStoreClient(weight_store.grpc_addr or "")
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    rollout = SyntheticRollout(r, store, run, recipe["model"]["name"], vocab, gated=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = start_trainer(infra, tmp_path / "a", weight_store)
    second = producer = None
    try:
        async with httpx.AsyncClient(headers=ADMIN, base_url=first.http) as client:
            response = await client.post("/v1/runs", json=recipe)
            assert response.status_code == 202, response.text
            producer = asyncio.create_task(rollout.run_forever())
            rollout.release(2 * GROUPS_PER_STEP)
            await wait_run(first.http, run, lambda s: s["checkpoint_step"] == 2, producer=producer)
            done = {"step": 2, "mean_reward": 0.25, "num_tasks": 8}
            response = await client.post(f"/v1/runs/{run}/evaluations", json=done)
            assert response.status_code == 200, response.text
        second = start_trainer(infra, tmp_path / "b", weight_store)
        first.proc.send_signal(signal.SIGTERM)  # waiting for step 3's batch: hands it off
        assert first.proc.wait(timeout=60) == 0
        await wait_run(second.http, run, lambda s: s["resumed"] == 1, 60)
        rollout.release(100)
        final = await wait_run(second.http, run, lambda s: s["state"] != "running", 120)
    finally:
        if producer is not None:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
        for trainer in (first, second):
            if trainer is not None and trainer.proc.poll() is None:
                trainer.stop()
        await store.close()
        await r.aclose()
    assert final["state"] == "succeeded", final["error"]
    assert "tracker failed" not in first.log.read_text() + second.log.read_text()
    return {"status": final, "dir": tmp_path / "runs" / run}


def test_wandb_offline_run_has_every_step_the_evaluation_and_the_summary(tracked_run):
    status, run_dir = tracked_run["status"], tracked_run["dir"]
    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2  # one per trainer process, both the same W&B run id
    assert {p.name for p in logs} == {f"run-{status['run_id']}.wandb"}
    rows = [row for p in logs for row in wandb_records.history(p)]
    losses = {int(row["trainer/step"]): row["loss"] for row in rows if "loss" in row}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses == {s["step"]: pytest.approx(s["loss"]) for s in status["steps"]}
    evals = [row for row in rows if "eval/mean_reward" in row]
    assert [(r["trainer/step"], r["eval/mean_reward"]) for r in evals] == [(2, 0.25)]
    assert any("log_ratio_abs_mean" in row for row in rows)  # consistency metrics too
    summary = wandb_records.summary(logs[-1])
    assert summary["state"] == "succeeded" and summary["exactly_once"] == 1.0
    assert summary["trajectories_trained"] == status["trajectories_trained"]


def test_mlflow_file_store_has_one_run_with_every_step(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it

    status, run_dir = tracked_run["status"], tracked_run["dir"]
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("treadle-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resumed owner continued the first owner's run
    found = runs[0]
    assert found.info.run_name == status["run_id"] and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert {m.step: m.value for m in history} == {
        s["step"]: pytest.approx(s["loss"]) for s in status["steps"]
    }
    evals = client.get_metric_history(found.info.run_id, "eval/mean_reward")
    assert [(m.step, m.value) for m in evals] == [(2, 0.25)]
    assert found.data.params["trainer.num_steps"] == str(STEPS)
    assert found.data.tags["treadle.state"] == "succeeded"
    final = client.get_run(found.info.run_id).data.metrics
    assert final["final/exactly_once"] == 1.0
    assert final["final/trajectories_trained"] == status["trajectories_trained"]


def test_tensorboard_events_have_every_step_and_the_summary(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    status, run_dir = tracked_run["status"], tracked_run["dir"]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("loss")}
    assert losses == {s["step"]: pytest.approx(s["loss"]) for s in status["steps"]}
    assert [(e.step, e.value) for e in events.Scalars("eval/mean_reward")] == [(2, 0.25)]
    assert [e.value for e in events.Scalars("final/exactly_once")] == [1.0]
    summary_text = events.Tensors("summary/text_summary")[-1].tensor_proto.string_val[0]
    assert json.loads(summary_text)["state"] == "succeeded"
