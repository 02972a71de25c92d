"""The reward service as real processes behind NATS request-reply with a queue group."""

import asyncio
import json

import nats
import pytest

from tests.support.services import api_get, api_post
from treadle_common.clients.reward import RewardClient
from treadle_common.proto.treadle.v1 import reward_pb2 as pb

pytestmark = pytest.mark.integration


async def test_scoring_over_nats_shared_by_two_replicas(service, infra):
    a, b = (
        service("reward", TREADLE_REWARD_CACHE_SIZE="0"),
        service("reward", TREADLE_REWARD_CACHE_SIZE="0"),
    )
    nc = await nats.connect(infra.nats_url)
    client = RewardClient(nc, timeout_s=10)
    results = await asyncio.gather(
        *(
            client.score(
                pb.ScoreRequest(
                    scorer="exact_match", task_json=json.dumps({"answer": str(i % 2)}), answer="1"
                )
            )
            for i in range(40)
        )
    )
    assert [r.reward for r in results] == [float(i % 2) for i in range(40)]
    assert all(r.status == pb.SCORE_STATUS_OK for r in results)
    served = [_requests_ok(s.http) for s in (a, b)]
    assert sum(served) == 40 and all(n > 0 for n in served)  # the queue group spread the load

    unknown = await client.score(pb.ScoreRequest(scorer="nope"))
    assert unknown.status == pb.SCORE_STATUS_ERROR and "'exact_match'" in unknown.message
    malformed = pb.ScoreResult.FromString(
        (await nc.request("treadle.reward.exact_match", b"\xff\xff", timeout=5)).data
    )
    assert malformed.status == pb.SCORE_STATUS_ERROR and "malformed" in malformed.message
    await nc.close()

    http = api_post(
        f"{a.http}/v1/score", json={"scorer": "exact_match", "task": {"answer": "4"}, "answer": "4"}
    )
    assert http.json()["reward"] == 1.0 and http.json()["status"] == "SCORE_STATUS_OK"
    assert api_post(f"{a.http}/v1/score", json={"scorer": "nope"}).status_code == 404
    assert api_post(f"{a.http}/v1/score", json={"task": 3}).status_code == 422


def _requests_ok(http: str) -> int:
    for line in api_get(f"{http}/metrics").text.splitlines():
        if line.startswith(
            'treadle_requests_total{method="exact_match",outcome="ok",service="reward"}'
        ):
            return int(float(line.split()[-1]))
    return 0


async def test_no_replica_is_an_error_not_a_zero(infra):
    nc = await nats.connect(infra.nats_url)
    result = await RewardClient(nc, timeout_s=2).score(
        pb.ScoreRequest(scorer="unserved_scorer_xyz")
    )
    await nc.close()
    assert result.status in (pb.SCORE_STATUS_ERROR, pb.SCORE_STATUS_TIMEOUT)


async def test_batch_path_over_nats_and_http_and_cache(service, infra):
    replica = service("reward")
    nc = await nats.connect(infra.nats_url)
    client = RewardClient(nc, timeout_s=10)
    requests = [
        pb.ScoreRequest(
            request_id="a",
            scorer="math_verify",
            task_json=json.dumps({"answer": "1/2"}),
            answer="\\boxed{0.5}",
        ),
        pb.ScoreRequest(
            request_id="b", scorer="exact_match", task_json=json.dumps({"answer": "x"}), answer="y"
        ),
        pb.ScoreRequest(request_id="c", scorer="nope"),
    ]
    results = await client.score_batch(requests)
    assert [(r.request_id, r.reward, r.status) for r in results[:2]] == [
        ("a", 1.0, pb.SCORE_STATUS_OK),
        ("b", 0.0, pb.SCORE_STATUS_OK),
    ]
    assert results[2].status == pb.SCORE_STATUS_ERROR and "unknown scorer" in results[2].message
    again = await client.score(requests[0])  # deterministic scorer: served from the cache
    assert again.reward == 1.0
    await nc.close()
    metrics_text = api_get(f"{replica.http}/metrics").text
    assert (
        'treadle_requests_total{method="math_verify",outcome="cached",service="reward"} 1.0'
        in metrics_text
    )
    body = [
        {"scorer": "exact_match", "task": {"answer": "4"}, "answer": "4"},
        {"scorer": "format_regex", "answer": "abc", "options": {"pattern": "^a"}},
    ]
    http = api_post(f"{replica.http}/v1/score:batch", json=body).json()["results"]
    assert [r["reward"] for r in http] == [1.0, 1.0]
    assert api_post(f"{replica.http}/v1/score:batch", json=[{"scorer": "nope"}]).status_code == 404


async def test_one_replica_scores_requests_side_by_side_while_a_scorer_is_slow(service, infra):
    """A replica handles each request in a task of its own: a judge that answers only once
    three requests wait on it at once gets them from one replica (handled one at a time,
    the first would wait on the judge alone, and all three time out)."""
    import threading

    from fastapi import FastAPI

    from tests.support.services import serving

    app = FastAPI()
    together = threading.Barrier(3, timeout=20)

    @app.post("/v1/chat/completions")
    def complete(body: dict) -> dict:  # sync: each request on a thread of its own
        together.wait()  # BrokenBarrierError (a 500) unless three are here at once
        return {"choices": [{"message": {"role": "assistant", "content": "Score: 7"}}]}

    with serving(app) as url:
        service(
            "reward",
            TREADLE_REWARD_CACHE_SIZE="0",
            TREADLE_JUDGE_BASE_URL=f"{url}/v1",
            TREADLE_JUDGE_MODEL="judge",
        )
        nc = await nats.connect(infra.nats_url)
        client = RewardClient(nc, timeout_s=40)
        results = await asyncio.gather(
            *(
                client.score(pb.ScoreRequest(scorer="llm_judge", task_json="{}", answer=str(i)))
                for i in range(3)
            )
        )
        await nc.close()
        assert [(r.status, r.reward) for r in results] == [(pb.SCORE_STATUS_OK, 0.7)] * 3


async def test_a_timeout_is_asked_again_and_a_stalled_replica_that_resumes_answers(service, infra):
    """The only replica is frozen (SIGSTOP) when a request goes out: the first attempt times
    out; the replica resumes during the next one, which it answers (a dropped trajectory
    before: the first timeout was final)."""
    import os
    import signal

    from treadle_common.clients import reward as reward_client

    replica = service("reward", TREADLE_REWARD_CACHE_SIZE="0")
    nc = await nats.connect(infra.nats_url)
    client = reward_client.RewardClient(nc, timeout_s=2, attempts=4)
    request = pb.ScoreRequest(scorer="exact_match", task_json='{"answer": "7"}', answer="7")
    retried = reward_client.RETRIES._value.get()
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        scoring = asyncio.create_task(client.score(request))
        await asyncio.sleep(3)  # the first attempt (2 s) has timed out
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    result = await scoring
    await nc.close()
    assert result.status == pb.SCORE_STATUS_OK and result.reward == 1.0, result
    assert reward_client.RETRIES._value.get() > retried
