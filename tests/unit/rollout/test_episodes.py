"""EpisodeRunner against scripted fakes: token-exact bookkeeping over several turns."""

import asyncio
import json

import grpc
import pytest
from transformers import AutoTokenizer

from treadle_common.proto.treadle.v1 import common_pb2, env_pb2, reward_pb2, task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout.engines.base import Generation
from treadle_rollout.episodes import EpisodeRunner

pytestmark = pytest.mark.unit


class ScriptedEngine:
    def __init__(self, tokenizer, replies: list[str], version: int = 7):
        self.tokenizer, self.replies, self.version = tokenizer, list(replies), version
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_tokens, sampling):
        self.prompts.append(list(prompt_tokens))
        tokens = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"] + [
            self.tokenizer.eos_token_id
        ]
        return Generation(tokens, [-0.5] * len(tokens), [self.version] * len(tokens), "stop")


class ScriptedEnv:
    """Two turns: asks, then says 'lower', then ends."""

    def __init__(self):
        self.steps: list[str] = []

    async def create(self, env, task, seed=0, options=None):
        self.options = options
        obs = env_pb2.Observation(messages=[env_pb2.Message(role="user", content="guess")])
        return env_pb2.Session(session_id="s1", observation=obs)

    async def step(self, session_id, text, close_when_done=False):
        self.steps.append(text)
        done = len(self.steps) == 2
        obs = env_pb2.Observation(
            messages=[] if done else [env_pb2.Message(role="user", content="lower")]
        )
        return env_pb2.StepResponse(
            observation=obs, done=done, info_json=json.dumps({"n": len(self.steps)})
        )

    async def close_session(self, session_id):
        pass


class ScriptedReward:
    def __init__(self, status=reward_pb2.SCORE_STATUS_OK):
        self.status, self.requests = status, []

    async def score(self, request):
        self.requests.append(request)
        return reward_pb2.ScoreResult(reward=1.0, status=self.status, message="judge down")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def task() -> task_pb2.Task:
    return task_pb2.Task(
        task_id="t1",
        run_id="r",
        env="guess",
        payload_json="{}",
        group_size=1,
        max_turns=3,
        scorer="exact_match",
        sampling=common_pb2.SamplingParams(temperature=1.0),
    )


async def test_multi_turn_tokens_are_exact(tokenizer):
    engine, env, reward = ScriptedEngine(tokenizer, ["5", "3"]), ScriptedEnv(), ScriptedReward()
    traj = await EpisodeRunner(engine, tokenizer, env, reward, "rep").run(task(), 0)
    assert traj.status == tpb.TRAJECTORY_STATUS_OK and traj.reward == 1.0 and traj.num_turns == 2
    messages = [
        {"role": "user", "content": "guess"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "lower"},
        {"role": "assistant", "content": "3"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    # the trajectory decodes to the chat transcript (the template's trailing newline excepted)
    assert tokenizer.decode(list(traj.tokens)) == rendered.rstrip("\n")
    # the second prompt the engine saw is exactly the trajectory prefix before turn 2
    assert engine.prompts[1] == list(traj.tokens[: len(engine.prompts[1])])
    generated = [tok for tok, m in zip(traj.tokens, traj.loss_mask, strict=True) if m]
    assert tokenizer.decode(generated) == "5<|im_end|>3<|im_end|>"
    assert {v for v, m in zip(traj.token_versions, traj.loss_mask, strict=True) if m} == {7}
    assert all(v == -1 for v, m in zip(traj.token_versions, traj.loss_mask, strict=True) if not m)
    assert len(traj.logprobs) == len(traj.tokens) == len(traj.loss_mask)
    assert reward.requests[0].answer == "3" and env.steps == ["5", "3"]


async def test_special_tokens_inside_a_turn_keep_later_turns_exact(tokenizer):
    """A policy that emits special tokens mid-turn (a random model does) must not break the
    next turn's rendering; the env's session options reach the env-gateway."""
    engine = ScriptedEngine(tokenizer, ["5<|im_start|><|pad|>", "3"])
    env, reward = ScriptedEnv(), ScriptedReward()
    t = task()
    t.env_options_json = json.dumps({"latency": {"fixed_ms": 5}})
    traj = await EpisodeRunner(engine, tokenizer, env, reward, "rep").run(t, 0)
    assert traj.status == tpb.TRAJECTORY_STATUS_OK, traj.error
    assert env.steps == ["5<|im_start|><|pad|>", "3"]
    assert env.options == {"latency": {"fixed_ms": 5}}
    assert engine.prompts[1] == list(traj.tokens[: len(engine.prompts[1])])
    generated = [tok for tok, m in zip(traj.tokens, traj.loss_mask, strict=True) if m]
    assert tokenizer.decode(generated) == "5<|im_start|><|pad|><|im_end|>3<|im_end|>"


async def test_reward_failure_is_a_status_not_a_zero(tokenizer):
    reward = ScriptedReward(status=reward_pb2.SCORE_STATUS_TIMEOUT)
    traj = await EpisodeRunner(
        ScriptedEngine(tokenizer, ["1", "2"]), tokenizer, ScriptedEnv(), reward, "r"
    ).run(task(), 0)
    assert traj.status == tpb.TRAJECTORY_STATUS_REWARD_ERROR
    assert "SCORE_STATUS_TIMEOUT" in traj.error and "judge down" in traj.error


async def test_engine_failure_is_a_status(tokenizer):
    class Broken(ScriptedEngine):
        async def generate(self, prompt_tokens, sampling):
            raise RuntimeError("CUDA fell over")

    traj = await EpisodeRunner(
        Broken(tokenizer, []), tokenizer, ScriptedEnv(), ScriptedReward(), "r"
    ).run(task(), 0)
    assert traj.status == tpb.TRAJECTORY_STATUS_ENGINE_ERROR and "CUDA fell over" in traj.error


async def test_a_gated_episode_opens_its_session_then_waits_to_generate(tokenizer):
    """A task whose weights are not there yet: the env session is open and the prompt rendered,
    and nothing is generated until the gate (the weights) opens."""
    engine, env, reward = ScriptedEngine(tokenizer, ["5", "3"]), ScriptedEnv(), ScriptedReward()
    created = []
    create = env.create

    async def recording_create(*args, **kwargs):
        created.append(args)
        return await create(*args, **kwargs)

    env.create = recording_create
    gate = asyncio.get_running_loop().create_future()
    runner = EpisodeRunner(engine, tokenizer, env, reward, "rep")
    episode = asyncio.create_task(runner.run(task(), 0, gate))
    await asyncio.sleep(0.05)
    assert created and engine.prompts == [] and not episode.done()
    gate.set_result(None)
    traj = await asyncio.wait_for(episode, 5)
    assert traj.status == tpb.TRAJECTORY_STATUS_OK and env.steps == ["5", "3"]


async def test_a_cancelled_episode_leaves_the_shared_gate_alone(tokenizer):
    engine, env, reward = ScriptedEngine(tokenizer, ["5", "3"]), ScriptedEnv(), ScriptedReward()
    gate = asyncio.get_running_loop().create_future()
    runner = EpisodeRunner(engine, tokenizer, env, reward, "rep")
    first = asyncio.create_task(runner.run(task(), 0, gate))
    await asyncio.sleep(0.05)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert not gate.cancelled()  # the group's other episodes still wait on it


async def test_an_episode_whose_env_gateway_restarted_is_played_again(tokenizer):
    """The gateway dies mid-episode (its step fails UNAVAILABLE), and once back it no longer
    knows the session (NOT_FOUND): the episode starts over on a new session and succeeds; a
    gateway refusal of another kind is an env_error at once."""
    from treadle_common.clients.env import EnvRequestError

    class Restarting(ScriptedEnv):
        def __init__(self, failures):
            super().__init__()
            self.failures, self.creates = list(failures), 0

        async def create(self, env, task, seed=0, options=None):
            self.creates += 1
            return await super().create(env, task, seed, options)

        async def step(self, session_id, text, close_when_done=False):
            if self.failures:
                raise self.failures.pop(0)
            return await super().step(session_id, text, close_when_done)

    unavailable = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone"
    )
    env = Restarting([unavailable, EnvRequestError("NOT_FOUND", "no session s1")])
    engine = ScriptedEngine(tokenizer, ["9", "8", "5", "3"])
    traj = await EpisodeRunner(engine, tokenizer, env, ScriptedReward(), "r").run(task(), 0)
    assert traj.status == tpb.TRAJECTORY_STATUS_OK and env.creates == 3
    assert env.steps == ["5", "3"] and traj.num_turns == 2  # the last attempt, whole

    refused = Restarting([EnvRequestError("INVALID_ARGUMENT", "bad action")])
    engine = ScriptedEngine(tokenizer, ["1"])
    traj = await EpisodeRunner(engine, tokenizer, refused, ScriptedReward(), "r").run(task(), 0)
    assert traj.status == tpb.TRAJECTORY_STATUS_ENV_ERROR and refused.creates == 1
