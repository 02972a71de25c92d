"""`llm_judge` against a local fake OpenAI-compatible server (a real HTTP server on a free
port, started by the test; no network)."""

import pytest
from fastapi import FastAPI

from tests.support.services import serving
from treadle_reward.scorers.base import ScoreInput
from treadle_reward.scorers.llm_judge import LLMJudge

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fake_openai():
    app = FastAPI()
    seen: list[dict] = []

    @app.post("/v1/chat/completions")
    async def complete(body: dict) -> dict:
        seen.append(body)
        answer = body["messages"][-1]["content"]
        content = (
            "I cannot say"
            if "mumble" in answer
            else ("Fine work. Score: 9" if "42" in answer else "Score: 1")
        )
        return {"choices": [{"message": {"role": "assistant", "content": content}}]}

    with serving(app) as url:
        yield f"{url}/v1", seen


async def test_judge_scores_good_and_bad_answers(fake_openai):
    url, seen = fake_openai
    judge = LLMJudge(base_url=url, model="judge-1", api_key="k")
    good = await judge.score(
        ScoreInput(task={"question": "6*7"}, answer="42", options={"rubric": "Be strict."})
    )
    bad = await judge.score(ScoreInput(task={"question": "6*7"}, answer="41"))
    assert good.reward == pytest.approx(0.9) and bad.reward == pytest.approx(0.1)
    assert seen[0]["model"] == "judge-1" and seen[0]["messages"][0]["content"].startswith(
        "Be strict."
    )
    with pytest.raises(ValueError, match="no score"):
        await judge.score(ScoreInput(task={}, answer="mumble"))
    with pytest.raises(ValueError, match="TREADLE_JUDGE_BASE_URL"):
        await LLMJudge(base_url="").score(ScoreInput(task={}, answer="42"))


async def test_reward_model_scores_in_batches(tmp_path):
    import asyncio

    from treadle_cli.tiny_model import init_tiny_classifier
    from treadle_reward.scorers.reward_model import RewardModel

    scorer = RewardModel(init_tiny_classifier(tmp_path / "rm"))
    forwards: list[int] = []
    original = scorer._forward
    scorer._forward = lambda requests: forwards.append(len(requests)) or original(requests)
    inputs = [ScoreInput(task={"q": "2+2"}, answer=a) for a in ("4", "5", "four", "4")]
    scores = await asyncio.gather(*(scorer.score(i) for i in inputs))
    assert forwards == [4]  # concurrent requests shared one forward pass
    assert all(0.0 < s.reward < 1.0 for s in scores)
    assert scores[0].reward == pytest.approx(scores[3].reward)  # same input, same score
    assert scores[0].reward != pytest.approx(scores[1].reward)
    raw = await scorer.score(
        ScoreInput(task={"q": "2+2"}, answer="4", options={"activation": "none"})
    )
    assert raw.reward == pytest.approx(scores[0].breakdown["reward_model_logit"], abs=1e-5)
    with pytest.raises(ValueError, match="TREADLE_REWARD_MODEL_DIR"):
        await RewardModel(model_dir="").score(inputs[0])
