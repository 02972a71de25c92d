"""Every built-in env plays a scripted good and a scripted bad episode through the real gRPC
API of a running env-gateway; plus the gateway's answers to bad input."""

import json
import os
import time

import grpc
import pytest

from tests.support.services import start_service
from treadle_common.clients.env import EnvClient
from treadle_common.proto.treadle.v1 import env_pb2 as pb

pytestmark = pytest.mark.integration

CRASHY_ENV = """
from treadle_env_gateway.envs import register
from treadle_env_gateway.envs.base import Env, Message, StepResult

@register("crashy")
class Crashy(Env):
    @classmethod
    def sample_tasks(cls, num_tasks, seed, split, options):
        return [{}] * num_tasks

    async def reset(self, task, seed):
        if task.get("fail_reset"):
            raise RuntimeError("reset bug")
        return [Message("user", "say anything")]

    async def step(self, action):
        raise ZeroDivisionError("the env has a bug")
"""


@pytest.fixture(scope="module")
def gateway(infra, tmp_path_factory):
    plugins = tmp_path_factory.mktemp("plugins")
    (plugins / "crashy_env.py").write_text(CRASHY_ENV)
    svc = start_service(
        "env-gateway",
        infra,
        tmp_path_factory.mktemp("gw"),
        TREADLE_ENV_MODULES="crashy_env",
        PYTHONPATH=f"{plugins}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    yield svc
    svc.stop_checked()


async def play(
    client: EnvClient, env: str, task: dict, actions: list, options=None
) -> list[pb.StepResponse]:
    session = await client.create(env, task, options=options)
    responses = []
    for action in actions:
        step = await (
            client.step(session.session_id, **action)
            if isinstance(action, dict)
            else client.step(session.session_id, action)
        )
        responses.append(step)
        if step.done:
            break
    await client.close_session(session.session_id)
    return responses


async def test_arith(gateway):
    client = EnvClient(gateway.grpc_addr)
    (task,) = await client.sample_tasks("arith", 1, seed=3)
    good = await play(client, "arith", task, [task["answer"]])
    bad = await play(client, "arith", task, ["not a number"])
    assert good[-1].done and json.loads(good[-1].info_json)["answer"] == task["answer"]
    assert bad[-1].done and json.loads(bad[-1].info_json)["answer"] != task["answer"]


async def test_countdown(gateway):
    client = EnvClient(gateway.grpc_addr)
    task = {"numbers": [3, 5, 7], "target": 22}
    good = await play(client, "countdown", task, ["I think: (3+5)... no:\n3*5+7 = 22"])
    assert good[-1].reward == 1.0 and json.loads(good[-1].info_json)["valid"]
    reused = await play(client, "countdown", task, ["7*3+7"])  # 7 used twice
    assert (
        reused[-1].reward == 0.0
        and json.loads(reused[-1].info_json)["error"] == "uses numbers not given"
    )
    hostile = await play(client, "countdown", task, ["__import__('os').system('true')"])
    assert (
        hostile[-1].reward == 0.0 and "only integers" in json.loads(hostile[-1].info_json)["error"]
    )
    generated = await client.sample_tasks("countdown", 20, seed=0)
    assert all(t["target"] > 0 and len(t["numbers"]) == 3 for t in generated)


async def test_guess_number(gateway):
    client = EnvClient(gateway.grpc_addr)
    task = {"low": 1, "high": 100, "target": 37}
    good = await play(client, "guess_number", task, ["50", "25", "my guess is 37"])
    assert [s.observation.messages[0].content for s in good[:2]] == ["Lower.", "Higher."]
    assert good[-1].done and good[-1].reward == 1.0
    bad = await play(client, "guess_number", task, ["hmm"] + ["1"] * 8, options={"max_guesses": 3})
    assert bad[0].observation.messages[0].content.startswith("That is not a number")
    assert (
        bad[-1].done
        and bad[-1].reward == 0.0
        and json.loads(bad[-1].info_json)["guesses"] == [1, 1, 1]
    )


async def test_calculator_tool_use_and_malformed_calls(gateway):
    client = EnvClient(gateway.grpc_addr)
    task = {"expression": "(12+7)*3", "answer": "57"}
    session = await client.create("calculator", task)
    assert (
        session.tools[0].name == "calculator" and "expression" in session.tools[0].parameters_json
    )
    call = pb.ToolCall(
        id="c1", name="calculator", arguments_json=json.dumps({"expression": "(12+7)*3"})
    )
    result = await client.step(session.session_id, tool_calls=[call])
    assert not result.done and result.observation.messages[0].content == "57"
    assert result.observation.messages[0].tool_call_id == "c1"
    broken = pb.ToolCall(id="c2", name="calculator", arguments_json="{not json")
    answer = await client.step(session.session_id, tool_calls=[broken])
    assert not answer.done and "not valid JSON" in answer.observation.messages[0].content
    wrong_tool = pb.ToolCall(id="c3", name="search", arguments_json="{}")
    answer = await client.step(session.session_id, tool_calls=[wrong_tool])
    assert not answer.done and "unknown tool 'search'" in answer.observation.messages[0].content
    final = await client.step(session.session_id, "The answer is 57.")
    assert final.done and final.reward == 1.0
    bad = await play(client, "calculator", task, ["56"])
    assert bad[-1].done and bad[-1].reward == 0.0


async def test_frozenlake(gateway):
    client = EnvClient(gateway.grpc_addr)
    task = {"grid": ["SFF", "HHF", "FFG"], "max_steps": 10}
    good = await play(client, "frozenlake", task, ["right", "I go right", "down", "down"])
    assert (
        good[-1].done
        and good[-1].reward == 1.0
        and json.loads(good[-1].info_json)["outcome"] == "goal"
    )
    bad = await play(client, "frozenlake", task, ["jump", "down"])
    assert "Reply with one move" in bad[0].observation.messages[0].content
    assert (
        bad[-1].done
        and bad[-1].reward == 0.0
        and json.loads(bad[-1].info_json)["outcome"] == "hole"
    )
    assert all(len(t["grid"]) == 4 for t in await client.sample_tasks("frozenlake", 10, seed=1))


async def test_bad_input_and_a_crashing_env(gateway):
    client = EnvClient(gateway.grpc_addr)
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await client.create("nope", {})
    assert (
        unknown.value.code() == grpc.StatusCode.NOT_FOUND
        and "'frozenlake'" in unknown.value.details()
    )
    session = await client.create("arith", {"a": 1, "b": 2, "op": "+"})
    with pytest.raises(grpc.aio.AioRpcError) as huge:
        await client.step(session.session_id, "9" * 70_000)
    assert (
        huge.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "exceeds the limit" in huge.value.details()
    )
    await client.step(session.session_id, "3")
    with pytest.raises(grpc.aio.AioRpcError) as finished:
        await client.step(session.session_id, "3")
    assert (
        finished.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "is done" in finished.value.details()
    )

    crashy = await client.create("crashy", {})
    step = await client.step(crashy.session_id, "hello")
    assert (
        step.done
        and step.status == "env_error"
        and "ZeroDivisionError: the env has a bug" in step.error
    )
    with pytest.raises(grpc.aio.AioRpcError) as after:
        await client.step(crashy.session_id, "again")
    assert "is done" in after.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as reset_bug:
        await client.create("crashy", {"fail_reset": True})
    assert (
        reset_bug.value.code() == grpc.StatusCode.INTERNAL
        and "reset bug" in reset_bug.value.details()
    )
    assert (await play(client, "arith", {"a": 2, "b": 2, "op": "+"}, ["4"]))[
        -1
    ].done  # still serving


async def test_latency_injection_delays_steps_and_rejects_unknown_distributions(gateway):
    client = EnvClient(gateway.grpc_addr)
    options = {"latency": {"fixed_ms": 30}}
    start = time.perf_counter()
    await play(
        client, "guess_number", {"low": 1, "high": 9, "target": 5}, ["1", "2", "3"], options=options
    )
    assert time.perf_counter() - start >= 0.09  # three steps, 30 ms each at least
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await client.create(
            "arith", {"a": 1, "b": 1, "op": "+"}, options={"latency": {"distribution": "pareto"}}
        )
    assert (
        bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lognormal" in bad.value.details()
    )


async def test_python_tests_good_bad_and_hostile_code(gateway):
    client = EnvClient(gateway.grpc_addr)
    (task,) = [
        t
        for t in await client.sample_tasks("python_tests", 50, seed=0)
        if t["entry_point"] == "add"
    ][:1]
    good = await play(
        client, "python_tests", task, ["Here:\n```python\ndef add(a, b):\n    return a + b\n```"]
    )
    assert good[-1].reward == 1.0 and json.loads(good[-1].info_json)["sandbox"] == "ok"
    assert good[-1].sandbox_runs == 1  # counted into the run's usage
    wrong = await play(
        client, "python_tests", task, ["```python\ndef add(a, b):\n    return a - b\n```"]
    )
    assert wrong[-1].reward == 0.0 and json.loads(wrong[-1].info_json)["sandbox"] == "failed"
    loop = await play(
        client,
        "python_tests",
        task,
        ["```python\nwhile True:\n    pass\n```"],
        options={"timeout_s": 2},
    )
    info = json.loads(loop[-1].info_json)
    assert loop[-1].reward == 0.0 and loop[-1].status == "ok" and info["sandbox"] == "timeout"
    arith = await play(client, "arith", {"a": 1, "b": 1, "op": "+"}, ["2"])
    assert arith[-1].done and arith[-1].sandbox_runs == 0  # still healthy; no sandbox


async def test_code_tests_scorer_runs_answers_in_the_gateway_sandbox(gateway):
    from treadle_reward.scorers.base import ScoreInput
    from treadle_reward.scorers.code_tests import CodeTests

    scorer = CodeTests(gateway.grpc_addr)
    task = {"tests": "assert double(4) == 8"}
    good = await scorer.score(
        ScoreInput(task=task, answer="```python\ndef double(x):\n    return 2 * x\n```")
    )
    bad = await scorer.score(ScoreInput(task=task, answer="def double(x):\n    return x"))
    hog = await scorer.score(ScoreInput(task=task, answer="x = bytearray(2**34)"))
    assert good.reward == 1.0 and good.breakdown["sandbox_ok"] == 1.0
    assert bad.reward == 0.0 and bad.breakdown["sandbox_failed"] == 1.0
    assert hog.reward == 0.0 and hog.breakdown["sandbox_memory"] == 1.0
