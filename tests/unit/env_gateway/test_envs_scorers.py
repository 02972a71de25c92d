import pytest

from treadle_common.proto.treadle.v1 import reward_pb2
from treadle_env_gateway.envs import registry as env_registry
from treadle_env_gateway.envs.base import Action, EnvError
from treadle_env_gateway.sessions import SessionManager
from treadle_reward.scorers import registry as scorer_registry
from treadle_reward.scorers.base import ScoreInput
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


def test_arith_held_out_part_never_meets_the_training_splits():
    arith = env_registry()["arith"]
    options = {"min_operand": 10, "max_operand": 99, "eval_fraction": 0.05}
    held_out = arith.sample_tasks(200, seed=0, split="eval", options=options)
    keys = {(t["a"], t["b"]) for t in held_out}
    assert len(keys) == 200  # distinct problems
    for split, seed in (("train", 0), ("sft", 1), ("sft_val", 2)):
        rows = arith.sample_tasks(2000, seed=seed, split=split, options=options)
        assert not keys & {(t["a"], t["b"]) for t in rows}
        assert all(10 <= t["a"] <= 99 and 10 <= t["b"] <= 99 for t in rows)
    # another seed draws other held-out problems, still from the held-out part only
    other = arith.sample_tasks(200, seed=7, split="eval", options=options)
    assert {(t["a"], t["b"]) for t in other} != keys
    everything = arith.sample_tasks(10_000, seed=0, split="eval", options=options)
    assert len(everything) < 8100 * 0.07  # capped at the size of the held-out part
    assert keys <= {(t["a"], t["b"]) for t in everything}
    with pytest.raises(EnvError, match="min_operand"):
        arith.sample_tasks(1, seed=0, split="train", options={"min_operand": 5, "max_operand": 2})
    with pytest.raises(EnvError, match="eval_fraction"):
        arith.sample_tasks(1, seed=0, split="train", options={"eval_fraction": 1.5})


async def test_arith_words_its_question_from_a_template_of_its_fields_only():
    arith = env_registry()["arith"]
    options = {"question": "What is {a}{op}{b}? Answer with the number only."}
    (task,) = arith.sample_tasks(1, seed=0, split="train", options=options)
    asked = f"What is {task['a']}+{task['b']}? Answer with the number only."
    assert task["question"] == asked
    (plain,) = arith.sample_tasks(1, seed=0, split="train", options={})
    assert "question" not in plain and {**plain, "question": asked} == task
    env = arith()
    (message,) = await env.reset(task, 0)
    assert message.content == asked
    (message,) = await arith().reset(plain, 0)
    assert message.content == f"{plain['a']}+{plain['b']}="
    for bad in ("{a.__class__}", "{a!r}", "{a:>9}", "{x}", "{0}", "{", 7, "x" * 1001):
        with pytest.raises(EnvError, match="option 'question'"):
            arith.sample_tasks(1, seed=0, split="train", options={"question": bad})


async def test_digit_match_gives_partial_credit_from_the_units_digit():
    scorer = scorer_registry()["digit_match"]

    async def credit(answer: str, reference: str = "123") -> float:
        return (await scorer.score(ScoreInput(task={"answer": reference}, answer=answer))).reward

    assert await credit(" 123 ") == 1.0
    assert await credit("133") == pytest.approx(2 / 3)  # a missed carry keeps the units
    assert await credit("23") == pytest.approx(2 / 3)  # a dropped digit
    assert await credit("1123") == pytest.approx(3 / 4)  # too long costs
    assert await credit("") == 0.0 and await credit("x") == 0.0
    composite = scorer_registry()["composite"]
    both = ScoreInput(
        task={"answer": "123"},
        answer="124",
        options={
            "scorers": [
                {"name": "exact_match", "weight": 0.5},
                {"name": "digit_match", "weight": 0.5},
            ]
        },
    )
    assert (await composite.score(both)).reward == pytest.approx(1 / 3)


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


async def test_env_reward_is_the_envs_own_reward_and_never_a_silent_zero():
    scorer = scorer_registry()["env_reward"]
    given = ScoreInput(
        task={}, answer="x", info={"reward": 0.75, "breakdown": {"exact": 0.5, "note": "text"}}
    )
    score = await scorer.score(given)
    assert score.reward == 0.75 and score.breakdown == {"exact": 0.5}
    service = ScoringService(scorer_registry())
    for info in ("{}", '{"reward": "1"}', '{"reward": true}'):
        result = await service.score(reward_pb2.ScoreRequest(scorer="env_reward", info_json=info))
        assert result.status == reward_pb2.SCORE_STATUS_ERROR and "reward" in result.message


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


@pytest.mark.parametrize(
    ("answer", "reference", "reward"),
    [
        ("so the result is \\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("The answer is 1,000.", "1000", 1.0),
        ("we get \\boxed{2x+2}", "2*(x+1)", 1.0),
        ("\\boxed{x^2-1}", "(x-1)*(x+1)", 1.0),
        ("50%", "1/2", 1.0),
        ("\\boxed{\\frac{2}{3}}", "0.66", 0.0),
        ("\\boxed{x^2+1}", "(x+1)**2", 0.0),
        ("I give up", "7", 0.0),
    ],
)
async def test_math_verify(answer, reference, reward):
    scorer = scorer_registry()["math_verify"]
    assert (
        await scorer.score(ScoreInput(task={"answer": reference}, answer=answer))
    ).reward == reward


async def test_format_regex_and_composite():
    scorers = scorer_registry()
    fmt = ScoreInput(
        task={}, answer="<think>..</think> 42", options={"pattern": r"^<think>.*</think>"}
    )
    assert (await scorers["format_regex"].score(fmt)).reward == 1.0
    fmt.options = {"pattern": r"^\d+$", "full_match": True}
    assert (await scorers["format_regex"].score(fmt)).reward == 0.0
    with pytest.raises(ValueError, match="invalid pattern"):
        await scorers["format_regex"].score(
            ScoreInput(task={}, answer="x", options={"pattern": "("})
        )
    combo = ScoreInput(
        task={"answer": "4"},
        answer="\\boxed{4}",
        options={
            "scorers": [
                {"name": "math_verify", "weight": 0.8},
                {"name": "format_regex", "weight": 0.2, "options": {"pattern": "^done"}},
            ]
        },
    )
    score = await scorers["composite"].score(combo)
    assert score.reward == pytest.approx(0.8) and score.breakdown == {
        "math_verify": 1.0,
        "format_regex": 0.0,
    }
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        await scorers["composite"].score(
            ScoreInput(task={}, answer="", options={"scorers": [{"name": "nope"}]})
        )


async def test_timeouts_exceptions_and_concurrency_limits():
    import asyncio

    from treadle_reward.scorers.base import Score, Scorer

    class Slow(Scorer):
        running = peak = 0

        async def score(self, request):
            Slow.running += 1
            Slow.peak = max(Slow.peak, Slow.running)
            try:
                await asyncio.sleep(float(request.options.get("sleep", 0.05)))
            finally:
                Slow.running -= 1
            return Score(1.0)

    class Broken(Scorer):
        async def score(self, request):
            raise KeyError("reference")

    service = ScoringService({"slow": Slow(), "broken": Broken()}, timeout_s=0.2, max_concurrency=2)
    late = await service.score(reward_pb2.ScoreRequest(scorer="slow", options_json='{"sleep": 1}'))
    assert late.status == reward_pb2.SCORE_STATUS_TIMEOUT and "longer than 0.2s" in late.message
    broken = await service.score(reward_pb2.ScoreRequest(scorer="broken"))
    assert (
        broken.status == reward_pb2.SCORE_STATUS_ERROR and broken.message == "KeyError: 'reference'"
    )
    Slow.peak = 0
    results = await asyncio.gather(
        *(service.score(reward_pb2.ScoreRequest(scorer="slow")) for _ in range(6))
    )
    assert all(r.status == reward_pb2.SCORE_STATUS_OK for r in results) and Slow.peak == 2


def test_safe_math_refuses_a_tower_of_small_powers_before_computing_it():
    from fractions import Fraction

    from treadle_common.tasks.safe_math import MAX_POWER_BITS, ExpressionError, evaluate

    with pytest.raises(ExpressionError, match=f"{MAX_POWER_BITS} bits"):
        evaluate("((9**64)**64)**64", allow_pow=True)
    with pytest.raises(ExpressionError, match="bits"):
        evaluate("(1/(7**60))**64", allow_pow=True)  # a huge denominator too
    assert evaluate("(2**8)**8", allow_pow=True)[0] == 2**64
    assert evaluate("(1/2)**3", allow_pow=True)[0] == Fraction(1, 8)


def test_verifiers_errors_the_policy_caused_are_episodes_not_env_errors():
    from treadle_env_gateway.envs.vf import _models_doing

    for name in ("EmptyModelResponseError", "OverlongPromptError", "ToolParseError"):
        assert _models_doing({"error": name, "error_chain_str": "..."})
    for name in ("ToolCallError", "SandboxError", "ModelError", "ValueError", "NoSuchError"):
        assert not _models_doing({"error": name})
    assert not _models_doing("a plain string")


async def test_requests_past_a_replicas_in_flight_slots_are_counted_as_queued():
    """What the autoscaler reads: requests a replica holds but has not begun."""
    import asyncio

    from treadle_reward.scorers.base import Score, Scorer
    from treadle_reward.worker import QUEUED

    release = asyncio.Event()

    class Held(Scorer):
        async def score(self, request):
            await release.wait()
            return Score(1.0)

    class Msg:
        subject = "treadle.reward.held"
        data = reward_pb2.ScoreRequest(scorer="held").SerializeToString()
        headers = None
        answered = 0

        async def respond(self, data):
            Msg.answered += 1

    service = ScoringService({"held": Held()}, max_in_flight=2)
    before = QUEUED._value.get()
    waiting = [asyncio.create_task(service.dispatch(Msg())) for _ in range(5)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert QUEUED._value.get() - before == 3  # two in flight, three queued
    release.set()
    await asyncio.gather(*waiting)
    await asyncio.gather(*service._tasks)
    assert QUEUED._value.get() == before and Msg.answered == 5
