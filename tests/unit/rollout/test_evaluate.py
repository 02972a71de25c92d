"""Rollout's `POST /v1/evaluate` over a scripted episode runner, and held-out filtering."""

from __future__ import annotations

import json
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_common.runtime import errors
from treadle_common.tasks.evaluation import without_held_out
from treadle_rollout import http


class ScriptedRunner:
    """Rewards 1 when the task's answer is even; fails tasks marked `broken`."""

    def __init__(self):
        self.tasks = []

    async def run(self, task, sample_index):
        self.tasks.append(task)
        payload = json.loads(task.payload_json)
        if payload.get("broken"):
            return tpb.Trajectory(status=tpb.TRAJECTORY_STATUS_ENV_ERROR, token_versions=[-1, 3])
        return tpb.Trajectory(
            status=tpb.TRAJECTORY_STATUS_OK,
            reward=float(payload["answer"] % 2 == 0),
            token_versions=[-1, -1, 3, 4],
        )


def client(runner) -> TestClient:
    """Rollout's HTTP edge over a replica whose only part is the scripted runner (None: not
    connected to NATS yet), with the runtime's answer to a service error."""
    app = FastAPI()
    worker = SimpleNamespace(runner=runner) if runner is not None else None
    app.state.rollout = SimpleNamespace(worker=worker, policies=None)
    app.add_exception_handler(errors.ServiceError, errors.http_response)
    app.include_router(http.router)
    return TestClient(app)


def test_evaluate_scores_each_task_in_order_greedy_by_default():
    runner = ScriptedRunner()
    tasks = [{"answer": 2}, {"answer": 3}, {"answer": 4}, {"broken": True}]
    response = client(runner).post(
        "/v1/evaluate", json={"env": "arith", "tasks": tasks, "max_new_tokens": 4}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["rewards"] == [1.0, 0.0, 1.0, 0.0]
    assert body["mean_reward"] == 0.5
    assert body["statuses"] == {"TRAJECTORY_STATUS_OK": 3, "TRAJECTORY_STATUS_ENV_ERROR": 1}
    assert body["policy_versions"] == [3, 4]
    assert {t.sampling.temperature for t in runner.tasks} == {0.0}
    assert {t.sampling.max_new_tokens for t in runner.tasks} == {4}
    assert len({t.task_id for t in runner.tasks}) == 4  # distinct, and no run is fed


def test_evaluate_rejects_bad_input_and_answers_503_before_nats():
    bad = [
        {"env": "arith", "tasks": []},
        {"env": "", "tasks": [{}]},
        {"env": "arith", "tasks": [{}], "temperature": -1},
        {"env": "arith", "tasks": "nope"},
    ]
    c = client(ScriptedRunner())
    for body in bad:
        response = c.post("/v1/evaluate", json=body)
        assert response.status_code == 422, body
    response = client(None).post("/v1/evaluate", json={"env": "arith", "tasks": [{}]})
    assert response.status_code == 503 and "NATS" in response.json()["detail"]


def test_held_out_tasks_are_removed_whatever_their_key_order():
    rows = [{"a": 1, "b": 2}, {"b": 3, "a": 1}, {"a": 5, "b": 5}]
    held = [{"b": 2, "a": 1}, {"a": 5, "b": 5}]
    assert without_held_out(rows, held) == [{"b": 3, "a": 1}]
