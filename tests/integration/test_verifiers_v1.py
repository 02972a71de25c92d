"""Environments written for verifiers 0.4 (`verifiers.v1`) played through a real env-gateway:
its worker (in .venv-verifiers) runs the taskset's harness against the gateway's loopback
endpoint, whose requests come back over `Play` and the rollout's OpenAI API answers them
(recorded token-exact); the taskset's rewards score the episode in the worker. The example
package is examples/verifiers/vf1-tiny: single-turn, tool and multi-turn."""

import random

import psutil
import pytest

from tests.integration.test_verifiers import EnvRewardClient
from tests.support.services import ROOT, start_service
from tests.support.tasks import env_task
from tests.support.tool_model import train_conversations
from treadle_common.clients.env import EnvClient
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout import chat, openai_api
from treadle_rollout.engines.hf import HFEngine
from treadle_rollout.episodes import EpisodeRunner
from treadle_rollout.played import PlayedEpisodes

pytestmark = pytest.mark.integration

PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
ARITH = {
    "id": "vf1-tiny-arith",
    "args": {"num_tasks": 8},
    "eval_args": {"num_tasks": 10, "seed": 1},
}
CALC = {"id": "vf1-tiny-calc", "args": {"num_tasks": 3}}
GUESS = {"id": "vf1-tiny-guess", "args": {"num_tasks": 4, "high": 4}, "max_turns": 4}
CALC_TOOL = {  # verifiers' rendering of the toolset's `add` (prefixed with its TOOL_PREFIX)
    "type": "function",
    "function": {
        "name": "calc_add",
        "description": "Add two integers and return their sum.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"title": "A", "type": "integer"},
                "b": {"title": "B", "type": "integer"},
            },
            "required": ["a", "b"],
            "title": "addArguments",
        },
    },
}


def arith_rows(num_tasks: int, seed: int) -> list[tuple[str, str]]:
    """vf1-tiny-arith's problems (its `problems()`, which runs in the other venv)."""
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(num_tasks)]
    return [(f"{a}+{b}=", str(a + b)) for a, b in pairs]


def exact(reply: str, answer: str) -> float:
    return 1.0 if reply.strip() == answer else 0.0


def digits(reply: str, answer: str) -> float:
    text = reply.strip()
    hits = sum(1 for i, ch in enumerate(answer) if i < len(text) and text[i] == ch)
    return hits / max(len(answer), len(text), 1)


@pytest.fixture(scope="module")
def gateway(infra, tmp_path_factory):
    if not PYTHON.exists():
        pytest.skip("no .venv-verifiers (scripts/setup_verifiers.sh)")
    svc = start_service(
        "env-gateway",
        infra,
        tmp_path_factory.mktemp("gw1"),
        TREADLE_ENV_VERIFIERS_PYTHON=str(PYTHON),
    )
    yield svc
    gateway_proc = psutil.Process(svc.proc.pid)
    workers = [
        p for p in gateway_proc.children(recursive=True) if "vf1_worker.py" in " ".join(p.cmdline())
    ]
    svc.stop_checked()
    assert workers  # the tests started some; stopping the gateway ended and reaped them all
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def arith_model(tiny_model, tmp_path_factory):
    """The tiny model trained on vf1-tiny-arith's 8 training problems."""
    conversations = [
        [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        for q, a in arith_rows(8, 0)
    ]
    return train_conversations(tiny_model, tmp_path_factory.mktemp("vf1"), conversations)


@pytest.fixture(scope="module")
def calc_model(tiny_model, tmp_path_factory):
    """The tiny model trained to call vf1-tiny-calc's `calc_add` for its 3 tasks, then answer
    with the tool's result (the schema as verifiers sends it, as rollout's template renders it)."""
    from treadle_rollout.openai_types import ChatRequest

    request = ChatRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [CALC_TOOL]}
    )
    conversations = []
    for question, answer in arith_rows(3, 0):
        a, b = (int(x) for x in question.rstrip("=").split("+"))
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "calc_add", "arguments": {"a": a, "b": b}},
        }
        conversations.append(
            [
                {"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": answer},
                {"role": "assistant", "content": answer},
            ]
        )
    return train_conversations(
        tiny_model,
        tmp_path_factory.mktemp("calc"),
        conversations,
        request.template_tools(),
        steps=800,
    )


def runner_on(model, gateway) -> tuple[EpisodeRunner, EnvClient, HFEngine]:
    engine = HFEngine(model, "tiny")
    frontend = openai_api.OpenAIFrontend(engine, chat.SessionRecorder(engine.tokenizer))
    env = EnvClient(gateway.grpc_addr, batch=True)
    runner = EpisodeRunner(
        engine, engine.tokenizer, env, EnvRewardClient(), "r0", played=PlayedEpisodes(frontend)
    )
    return runner, env, engine


@pytest.fixture
async def rollout(arith_model, gateway):
    runner, env, engine = runner_on(arith_model, gateway)
    yield runner, env
    await env.close()
    await engine.close()


def make_task(row: dict, options: dict, temperature: float = 0.0, tokens: int = 5) -> task_pb2.Task:
    return env_task("verifiers-v1", row, options, temperature=temperature, tokens=tokens, seed=7)


async def test_tasks_are_the_tasksets_own_and_the_eval_split_its_eval_args(rollout):
    _, env = rollout
    train = await env.sample_tasks("verifiers-v1", 8, seed=1, options=ARITH)
    again = await env.sample_tasks("verifiers-v1", 8, seed=1, options=ARITH)
    held_out = await env.sample_tasks("verifiers-v1", 20, seed=1, split="eval", options=ARITH)
    assert train == again and len(train) == 8 and len(held_out) == 10  # eval_args: 10 tasks
    problems = {q for q, _ in arith_rows(8, 0)}
    assert {t["prompt"] for t in train} <= problems and train[0]["split"] == "train"
    assert {t["prompt"] for t in held_out} == {q for q, _ in arith_rows(10, 1)}


async def test_a_single_turn_episode_is_played_recorded_token_exact_and_scored(rollout):
    runner, env = rollout
    rows = await env.sample_tasks("verifiers-v1", 4, seed=2, options=ARITH)
    tokenizer = runner.tokenizer
    for i, row in enumerate(rows):
        traj = await runner.run(make_task(row, ARITH), sample_index=i)
        assert traj.status == tpb.TRAJECTORY_STATUS_OK, traj.error
        assert traj.num_turns == 1 and traj.env == "verifiers-v1"
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        tokens, mask = list(traj.tokens), list(traj.loss_mask)
        assert tokens[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
        assert all(mask[len(prompt_ids) :]) and 0 < len(tokens) - len(prompt_ids) <= 5
        answer = tokenizer.decode(tokens[len(prompt_ids) :], skip_special_tokens=True).strip()
        expected = {"exact": exact(answer, row["answer"]), "digits": digits(answer, row["answer"])}
        assert dict(traj.reward_breakdown) == pytest.approx(
            {k: 0.5 * v for k, v in expected.items()}
        )
        assert traj.reward == pytest.approx(0.5 * sum(expected.values()))
        assert traj.reward == 1.0  # greedy, the trained answers: full marks
    assert not runner.played.frontend.recorder.sessions  # each recording was let go


async def test_a_tool_episode_calls_the_toolset_and_answers_with_its_result(calc_model, gateway):
    """The model's call is parsed by rollout into `tool_calls`; verifiers' harness calls the
    taskset's MCP toolset and sends its result back; both model turns are trained on."""
    runner, env, engine = runner_on(calc_model, gateway)
    for i, row in enumerate(await env.sample_tasks("verifiers-v1", 3, seed=0, options=CALC)):
        traj = await runner.run(make_task(row, CALC, tokens=64), i)
        assert traj.status == tpb.TRAJECTORY_STATUS_OK, traj.error
        assert traj.num_turns == 2  # the tool call, then the answer
        tokens, mask = list(traj.tokens), list(traj.loss_mask)
        stretches = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
        generated = runner.tokenizer.decode(tokens[stretches[0] : stretches[1]])
        assert "<tool_call>" in generated and '"name": "calc_add"' in generated
        context = runner.tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if not m])
        assert f"<tool_response>\n{row['answer']}\n</tool_response>" in context
        assert traj.reward == 1.0 and traj.reward_breakdown["model_calls"] == 2.0
    await env.close()
    await engine.close()


async def test_a_multi_turn_game_plays_within_max_turns_and_reports_its_state(rollout):
    """vf1-tiny-guess: up to `max_turns` model turns; its rewards and the guesses its toolset
    counted in the rollout's state come back in the breakdown. (The model is not trained to
    play, so this does not show the state carried across turns; that was checked by hand
    against a scripted server: a guess of 50 answered "lower", one guess counted.)"""
    runner, env = rollout
    for i, row in enumerate(await env.sample_tasks("verifiers-v1", 2, seed=0, options=GUESS)):
        traj = await runner.run(make_task(row, GUESS, temperature=1.0, tokens=32), i)
        assert traj.status == tpb.TRAJECTORY_STATUS_OK, traj.error
        assert 1 <= traj.num_turns <= 4
        breakdown = dict(traj.reward_breakdown)
        assert set(breakdown) == {"found", "quick", "guesses"}
        assert 0 <= breakdown["guesses"] <= traj.num_turns  # a guess is a tool call of a turn
        assert traj.reward == pytest.approx(breakdown["found"] + breakdown["quick"])


async def test_a_bad_option_or_taskset_is_an_env_error_and_the_gateway_stays_up(rollout):
    runner, env = rollout
    (row,) = await env.sample_tasks("verifiers-v1", 1, seed=4, options=ARITH)
    for options, words in (
        ({"id": "no-such-taskset"}, "no verifiers environment 'no-such-taskset' is installed"),
        ({"id": "yaml"}, "no verifiers environment 'yaml' is installed"),  # installed, no env
        ({"id": "x", "max_turns": 0}, "'max_turns' must be a positive integer"),
        ({"id": "vf1-tiny-arith", "args": []}, "must be objects"),
    ):
        traj = await runner.run(make_task(row, options), 0)
        assert traj.status == tpb.TRAJECTORY_STATUS_ENV_ERROR, options
        assert words in traj.error, traj.error
    traj = await runner.run(make_task({"prompt": "1+1="}, ARITH), 0)
    assert traj.status == tpb.TRAJECTORY_STATUS_ENV_ERROR and "'idx' and 'split'" in traj.error
    assert "verifiers-v1" in await env.list_envs()
