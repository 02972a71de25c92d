import pytest

from treadle_common.proto.treadle.v1 import reward_pb2
from treadle_env_gateway.envs.base import Action, EnvError
from treadle_env_gateway.envs.base import registry as env_registry
from treadle_env_gateway.sessions import SessionManager
from treadle_reward.scorers.base import ScoreInput
from treadle_reward.scorers.base import registry as scorer_registry
from treadle_reward.worker import ScoringService

pytestmark = pytest.mark.unit


def test_arith_tasks_are_deterministic_and_correct():
    arith = env_registry()["arith"]
    tasks = arith.sample_tasks(20, seed=1, split="train", options={"ops": ["+", "*"]})
    assert tasks == arith.sample_tasks(20, seed=1, split="train", options={"ops": ["+", "*"]})
    assert tasks != arith.sample_tasks(20, seed=1, split="eval", options={"ops": ["+", "*"]})
    for t in tasks:
        expected = t["a"] + t["b"] if t["op"] == "+" else t["a"] * t["b"]
        assert t["answer"] == str(expected)


async def test_session_lifecycle_and_errors():
    sessions = SessionManager("r1", max_sessions=1)
    session, obs = await sessions.create("arith", {"a": 2, "b": 3, "op": "+", "answer": "5"}, 0, {})
    assert obs[0].content == "2+3=" and session.session_id.startswith("r1:")
    with pytest.raises(Exception, match="limit is 1"):
        await sessions.create("arith", {"a": 1, "b": 1, "op": "+"}, 0, {})
    result = await sessions.step(session.session_id, Action(text=" 5 "))
    assert result.done and result.info == {"answer": "5", "target": "5"}
    with pytest.raises(EnvError, match="is done"):
        await sessions.step(session.session_id, Action(text="5"))
    with pytest.raises(EnvError, match="unknown env 'nope'; known: \\['arith'"):
        await sessions.create("nope", {}, 0, {})
    await sessions.close(session.session_id)
    with pytest.raises(KeyError, match="no session"):
        sessions.get(session.session_id)


async def test_exact_match():
    scorer = scorer_registry()["exact_match"]
    assert (await scorer.score(ScoreInput(task={"answer": "7"}, answer=" 7."))).reward == 1.0
    assert (await scorer.score(ScoreInput(task={"answer": "7"}, answer="8"))).reward == 0.0
    extracted = ScoreInput(
        task={"answer": "7"}, answer="it is 7 I think", options={"extract": "last_number"}
    )
    assert (await scorer.score(extracted)).reward == 1.0


async def test_scoring_service_reports_errors_not_zero():
    service = ScoringService(scorer_registry())
    unknown = await service.score(reward_pb2.ScoreRequest(scorer="nope"))
    assert unknown.status == reward_pb2.SCORE_STATUS_ERROR and "exact_match" in unknown.message
    no_ref = await service.score(
        reward_pb2.ScoreRequest(scorer="exact_match", task_json="{}", answer="1")
    )
    assert no_ref.status == reward_pb2.SCORE_STATUS_ERROR and "reference field" in no_ref.message
    bad_json = await service.score(
        reward_pb2.ScoreRequest(scorer="exact_match", task_json="{", answer="1")
    )
    assert bad_json.status == reward_pb2.SCORE_STATUS_ERROR and "not valid JSON" in bad_json.message


def test_lognormal_latency_is_reproducible_and_heavy_tailed():
    from treadle_env_gateway.latency import Latency

    spec = {"distribution": "lognormal", "median_ms": 100, "sigma": 1.0}
    a = [Latency(spec, seed=7).sample_ms() for _ in range(1)]
    draws = Latency(spec, seed=7)
    samples = sorted(draws.sample_ms() for _ in range(2000))
    assert a[0] == Latency(spec, seed=7).sample_ms()
    median, p99 = samples[1000], samples[1980]
    assert 80 < median < 125 and p99 > 5 * median  # heavy tail: p99 ~ 10x the median
