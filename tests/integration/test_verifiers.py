"""`verifiers` environments played through a real env-gateway: the environment's own
`run_rollout` runs in the gateway, its OpenAI client's calls come back over `Play` and the
rollout's OpenAI API answers them (recorded token-exact), its rubric scores the episode."""

import json

import pytest
from vf_tiny_arith import _problems, digits, exact

from tests.support.services import start_service
from tests.support.tasks import env_task
from tests.support.tool_model import train_conversations
from treadle_common.clients.env import EnvClient
from treadle_common.proto.treadle.v1 import reward_pb2, task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_reward.scorers.base import ScoreInput
from treadle_reward.scorers.env_reward import EnvReward
from treadle_reward.scorers.exact_match import ExactMatch
from treadle_rollout import chat, openai_api
from treadle_rollout.engines.hf import HFEngine
from treadle_rollout.episodes import EpisodeRunner
from treadle_rollout.played import PlayedEpisodes

pytestmark = pytest.mark.integration

VF = {"id": "vf-tiny-arith", "args": {"num_train": 8, "num_eval": 10}}


class EnvRewardClient:
    """The reward service's `env_reward` and `exact_match` scorers, called in-process."""

    def __init__(self):
        self.requests: list[reward_pb2.ScoreRequest] = []

    async def score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResult:
        self.requests.append(request)
        scorer = EnvReward() if request.scorer == "env_reward" else ExactMatch()
        score = await scorer.score(
            ScoreInput(
                task=json.loads(request.task_json),
                answer=request.answer,
                info=json.loads(request.info_json),
            )
        )
        return reward_pb2.ScoreResult(
            status=reward_pb2.SCORE_STATUS_OK, reward=score.reward, breakdown=score.breakdown
        )


@pytest.fixture(scope="module")
def gateway(infra, tmp_path_factory):
    svc = start_service("env-gateway", infra, tmp_path_factory.mktemp("gw"))
    yield svc
    svc.stop_checked()


@pytest.fixture(scope="module")
def arith_model(tiny_model, tmp_path_factory):
    """The tiny model trained to answer the environment's 8 training problems."""
    rows = _problems(8, 0, 10, 99)  # vf-tiny-arith's training set with num_train=8
    conversations = [
        [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
        for r in rows
    ]
    return train_conversations(tiny_model, tmp_path_factory.mktemp("arith"), conversations)


@pytest.fixture
async def rollout(arith_model, gateway):
    engine = HFEngine(arith_model, "tiny")
    frontend = openai_api.OpenAIFrontend(engine, chat.SessionRecorder(engine.tokenizer))
    env = EnvClient(gateway.grpc_addr, batch=True)
    reward = EnvRewardClient()
    runner = EpisodeRunner(
        engine, engine.tokenizer, env, reward, "r0", played=PlayedEpisodes(frontend)
    )
    yield runner, env, reward, frontend
    await env.close()
    await engine.close()


def make_task(row: dict, seed: int = 0, temperature: float = 1.0) -> task_pb2.Task:
    return env_task("verifiers", row, VF, temperature=temperature, seed=seed)


async def test_tasks_are_the_environments_dataset_rows(rollout):
    _, env, _, _ = rollout
    train = await env.sample_tasks("verifiers", 8, seed=1, options=VF)
    again = await env.sample_tasks("verifiers", 8, seed=1, options=VF)
    held_out = await env.sample_tasks("verifiers", 20, seed=1, split="eval", options=VF)
    assert train == again and len(train) == 8 and len(held_out) == 10  # the eval set has 10
    assert train[0]["prompt"][-1]["role"] == "user" and train[0]["answer"].isdigit()
    assert len({row["example_id"] for row in held_out}) == 10


async def test_an_episode_is_played_recorded_token_exact_and_scored_by_the_rubric(rollout):
    runner, env, reward, frontend = rollout
    rows = await env.sample_tasks("verifiers", 6, seed=2, options=VF)
    tokenizer = runner.tokenizer
    rewards = []
    for i, row in enumerate(rows):
        temperature = 0.0 if i < 3 else 1.0
        traj = await runner.run(make_task(row, seed=7, temperature=temperature), sample_index=i)
        assert traj.status == tpb.TRAJECTORY_STATUS_OK, traj.error
        assert traj.num_turns == 1 and traj.env == "verifiers"
        prompt = tokenizer.apply_chat_template(
            row["prompt"], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        tokens, mask = list(traj.tokens), list(traj.loss_mask)
        # the context is the template's rendering; the rest is what the engine generated
        assert tokens[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
        assert all(mask[len(prompt_ids) :]) and 0 < len(tokens) - len(prompt_ids) <= 5
        assert all(lp <= 0 for lp in traj.logprobs[len(prompt_ids) :])
        # the rubric's reward and breakdown, for the answer the engine produced
        answer = tokenizer.decode(tokens[len(prompt_ids) :], skip_special_tokens=True).strip()
        target = row["answer"]
        assert traj.reward == pytest.approx(
            0.5 * exact(answer, target) + 0.5 * digits(answer, target)
        )
        assert dict(traj.reward_breakdown) == pytest.approx(
            {"exact": exact(answer, target), "digits": digits(answer, target), "num_turns": 1.0}
        )
        info = json.loads(reward.requests[-1].info_json)
        assert info["answer"].strip() == answer and info["target"] == target
        rewards.append(traj.reward)
    assert rewards[:3] == [1.0, 1.0, 1.0]  # greedy, the trained answers: full marks
    assert not frontend.recorder.sessions  # each played episode's recording was let go


async def test_the_runs_sampling_is_what_the_episode_samples_with(rollout):
    runner, env, _, _ = rollout
    (row,) = await env.sample_tasks("verifiers", 1, seed=3, options=VF)
    greedy = [await runner.run(make_task(row, temperature=0.0), i) for i in range(2)]
    assert greedy[0].tokens == greedy[1].tokens  # temperature 0 whatever verifiers asked for
    seeded = [await runner.run(make_task(row, seed=11), 0) for _ in range(2)]
    assert seeded[0].tokens == seeded[1].tokens


async def test_a_broken_environment_is_an_env_error_and_the_gateway_stays_up(rollout):
    runner, env, _, _ = rollout
    (row,) = await env.sample_tasks("verifiers", 1, seed=4, options=VF)
    task = make_task(row)
    task.env_options_json = json.dumps({"id": "no-such-env-package"})
    traj = await runner.run(task, 0)
    assert traj.status == tpb.TRAJECTORY_STATUS_ENV_ERROR
    assert "INVALID_ARGUMENT" in traj.error and "'no-such-env-package'" in traj.error
    for not_an_env in ("os", "yaml", "treadle-env-gateway"):  # installed, but no environment
        task.env_options_json = json.dumps({"id": not_an_env})
        traj = await runner.run(task, 0)
        assert traj.status == tpb.TRAJECTORY_STATUS_ENV_ERROR
        assert f"no verifiers environment {not_an_env!r} is installed" in traj.error
    task = make_task({"no": "prompt"})
    traj = await runner.run(task, 0)
    assert traj.status == tpb.TRAJECTORY_STATUS_ENV_ERROR and "prompt" in traj.error
    assert "verifiers" in await env.list_envs()


async def test_an_openai_client_agent_is_played_turn_by_turn(tiny_model, gateway):
    """`examples/agents/arith-agent`: an agent on the plain OpenAI client, registered as env
    `arith_agent`; its retry turn is recorded into the same trajectory, the agent's own
    messages as context."""
    from arith_agent import RETRY

    engine = HFEngine(tiny_model, "tiny")  # untrained: its replies are rarely numbers
    frontend = openai_api.OpenAIFrontend(engine, chat.SessionRecorder(engine.tokenizer))
    env = EnvClient(gateway.grpc_addr)
    runner = EpisodeRunner(
        engine, engine.tokenizer, env, EnvRewardClient(), "r0", played=PlayedEpisodes(frontend)
    )
    options = {"max_operand": 9, "ops": ["+"]}
    tasks = await env.sample_tasks("arith_agent", 4, seed=0, options=options)
    turns = []
    for i, row in enumerate(tasks):
        task = make_task(row, temperature=0.0)
        task.env, task.env_options_json = "arith_agent", json.dumps(options)
        task.scorer = "exact_match"
        traj = await runner.run(task, i)
        assert traj.status == tpb.TRAJECTORY_STATUS_OK, traj.error
        tokens, mask = list(traj.tokens), list(traj.loss_mask)
        runs = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
        assert len(runs) == traj.num_turns  # one generated stretch per model call
        context = engine.tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if not m])
        assert f"{row['a']}+{row['b']}=" in context
        assert (RETRY in context) == (traj.num_turns == 2)
        turns.append(traj.num_turns)
    assert 2 in turns  # the untrained model's garbage made the agent ask again
    await env.close()
    await engine.close()


async def test_play_refuses_what_it_cannot_play(gateway):
    """A stepped env's session, an unknown session, a call that does not start with `start`:
    clear gRPC errors, and the gateway serves on."""
    import grpc

    from treadle_common.proto.treadle.v1 import env_pb2 as pb

    env = EnvClient(gateway.grpc_addr)

    async def no_model(request):
        raise AssertionError("no model call expected")

    (task,) = await env.sample_tasks("arith", 1, seed=0)
    stepped = await env.create("arith", task)
    assert not stepped.played
    for session_id, code, words in (
        (stepped.session_id, grpc.StatusCode.INVALID_ARGUMENT, "stepped, not played"),
        ("gw:nope", grpc.StatusCode.NOT_FOUND, "no session"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await env.play(session_id, "tiny", {}, no_model)
        assert refused.value.code() == code and words in refused.value.details()

    async def wrong_first():
        yield pb.PlayUp(response=pb.ModelResponse(id=1, status=200))

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in env.stub.Play(wrong_first()):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "starts with `start`" in refused.value.details()
    played = await env.create("verifiers", {"prompt": "1+1="}, options=VF)
    assert played.played
    assert "verifiers" in await env.list_envs()
    await env.close_session(played.session_id)
    await env.close()


VF_TOOLS = {"id": "vf-tiny-arith", "args": {"num_train": 4, "num_eval": 4, "tools": True}}


@pytest.fixture(scope="module")
def add_tool_model(tiny_model, tmp_path_factory):
    """The tiny model trained to solve vf-tiny-arith's `ToolEnv` (tools=True, 4 problems):
    call `add(a, b)`, then answer with the tool's result. The tool schema is the one verifiers
    sends, as rollout's chat template renders it."""
    import asyncio

    import verifiers as vf
    from verifiers.clients import OpenAIChatCompletionsClient

    from treadle_rollout.openai_types import ChatRequest

    env = vf.load_environment(VF_TOOLS["id"], **VF_TOOLS["args"])
    native = OpenAIChatCompletionsClient(object())
    sent = [asyncio.run(native.to_native_tool(t)) for t in env.tool_defs]
    request = ChatRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": sent}
    )
    tools = request.template_tools()
    conversations = []
    for row in _problems(4, 0, 10, 99):
        a, b = (int(x) for x in row["question"].rstrip("=").split("+"))
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "add", "arguments": {"a": a, "b": b}},
        }
        conversations.append(
            [
                {"role": "user", "content": row["question"]},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": row["answer"]},
                {"role": "assistant", "content": row["answer"]},
            ]
        )
    return train_conversations(
        tiny_model, tmp_path_factory.mktemp("add"), conversations, tools, steps=800
    )


async def test_a_tool_env_plays_its_tool_turns_through_rollout(add_tool_model, gateway):
    """verifiers' `ToolEnv`: the model's tool call is parsed by rollout into `tool_calls`,
    verifiers runs the tool and sends its result back; the trajectory holds both model turns
    (trained on) and the tool's result (context), and the rubric scores the final answer."""
    engine = HFEngine(add_tool_model, "tiny")
    frontend = openai_api.OpenAIFrontend(engine, chat.SessionRecorder(engine.tokenizer))
    env = EnvClient(gateway.grpc_addr)
    runner = EpisodeRunner(
        engine, engine.tokenizer, env, EnvRewardClient(), "r0", played=PlayedEpisodes(frontend)
    )
    rows = await env.sample_tasks("verifiers", 4, seed=0, options=VF_TOOLS)
    for i, row in enumerate(rows):
        task = make_task(row, temperature=0.0)
        task.env_options_json = json.dumps(VF_TOOLS)
        task.sampling.max_new_tokens = 64
        traj = await runner.run(task, i)
        assert traj.status == tpb.TRAJECTORY_STATUS_OK, traj.error
        assert traj.num_turns == 2  # the tool call, then the answer
        tokens, mask = list(traj.tokens), list(traj.loss_mask)
        stretches = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
        assert len(stretches) == 2
        generated = engine.tokenizer.decode(tokens[stretches[0] : stretches[1]])
        assert "<tool_call>" in generated and '"name": "add"' in generated
        context = engine.tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if not m])
        assert f"<tool_response>\n{row['answer']}\n</tool_response>" in context
        assert traj.reward == 1.0 and traj.reward_breakdown["exact"] == 1.0
    await env.close()
    await engine.close()
