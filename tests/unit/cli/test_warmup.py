"""The SFT warm-up's early stop and the run's eval gates, against a scripted training API."""

import json

import httpx
import pytest

from treadle_cli.report import EvalRow, RunReport, SftRow
from treadle_cli.warmup import TrainingSession, WarmUp
from treadle_common.api.training import DatumIn
from treadle_common.config.recipe import RunConfig

pytestmark = pytest.mark.unit


def scripted_api(calls: list[str]) -> httpx.MockTransport:
    versions = iter(range(1, 1000))

    def handle(request: httpx.Request) -> httpx.Response:
        op = request.url.path.rsplit("/", 1)[-1]
        calls.append(op)
        if op == "forward_backward":
            return httpx.Response(200, json={"loss": 1.0, "num_tokens": 1.0})
        if op == "optim_step":
            assert json.loads(request.content)["learning_rate"] == 1e-3
            return httpx.Response(200, json={"grad_norm": 0.5, "step": 1})
        return httpx.Response(200, json={"version": next(versions), "bytes_sent": 1})

    return httpx.MockTransport(handle)


def config(**sft) -> RunConfig:
    return RunConfig.model_validate({"model": {"path": "m"}, "sft": {"lr": 1e-3, **sft}})


async def warm_up(cfg: RunConfig, scores: list[float]) -> tuple[WarmUp, list[str], list]:
    calls: list[str] = []
    checked: list[tuple[int, int]] = []
    session = TrainingSession("http://trainer", cfg)
    session.client.http = httpx.AsyncClient(
        base_url="http://trainer", transport=scripted_api(calls)
    )
    session.sid = "s1"

    async def validate(step: int, version: int) -> float:
        checked.append((step, version))
        return scores[len(checked) - 1]

    try:
        data = [DatumIn(model_input=[1], target_tokens=[1])]
        return await session.sft(data, None, validate), calls, checked
    finally:
        await session.client.close()


async def test_the_warm_up_stops_at_the_first_validation_that_reaches_the_target():
    cfg = config(steps=100, target_reward=0.3, check_every=10)
    result, calls, checked = await warm_up(cfg, [0.0, 0.1, 0.35, 0.9])
    assert checked == [(10, 1), (20, 2), (30, 3)]  # each check scores freshly saved weights
    assert result.steps == 30 and result.version == 4
    assert calls.count("optim_step") == 30 and calls[-1] == "save_weights"


async def test_without_a_target_the_warm_up_runs_every_step_and_never_validates():
    result, calls, checked = await warm_up(config(steps=12, check_every=5), [])
    assert checked == [] and result.steps == 12 and calls.count("save_weights") == 1


def test_eval_summary_separates_the_warm_up_from_rl(tmp_path):
    report = RunReport(tmp_path)
    for phase, reward in (("start", 0.0), ("after_sft", 0.3), ("step 100", 0.4), ("end", 0.45)):
        report.add(EvalRow(phase=phase, mean_reward=reward))
    report.add(EvalRow(kind="sft_val", phase="sft step 10", mean_reward=0.9))  # not held out
    report.add(SftRow(sft_step=1, loss=2.0, grad_norm=1.0))
    e = RunReport.load(tmp_path).eval_summary()  # read back from metrics.jsonl
    assert (e.eval_start, e.eval_after_sft, e.eval_end) == (0.0, 0.3, 0.45)
    assert e.gain == 0.45 and e.rl_lift == 0.15
    assert e.eval == {"start": 0.0, "after_sft": 0.3, "step 100": 0.4, "end": 0.45}
    assert "sft step 10" not in e.eval


def test_without_a_warm_up_rl_lifts_from_the_start(tmp_path):
    report = RunReport(tmp_path)
    for phase, reward in (("start", 0.1), ("step 50", 0.2), ("end", 0.35)):
        report.add(EvalRow(phase=phase, mean_reward=reward))
    e = report.eval_summary()
    assert e.eval_after_sft is None and e.rl_lift == e.gain == 0.25
