"""The reward service as real processes behind NATS request-reply with a queue group."""

import asyncio
import json

import httpx
import nats
import pytest

from treadle_common.clients.reward import RewardClient
from treadle_common.proto.treadle.v1 import reward_pb2 as pb

pytestmark = pytest.mark.integration


async def test_scoring_over_nats_shared_by_two_replicas(service, infra):
    a, b = service("reward"), service("reward")
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
    assert unknown.status == pb.SCORE_STATUS_ERROR and "known: ['exact_match']" in unknown.message
    malformed = pb.ScoreResult.FromString(
        (await nc.request("treadle.reward.exact_match", b"\xff\xff", timeout=5)).data
    )
    assert malformed.status == pb.SCORE_STATUS_ERROR and "malformed" in malformed.message
    await nc.close()

    http = httpx.post(
        f"{a.http}/v1/score", json={"scorer": "exact_match", "task": {"answer": "4"}, "answer": "4"}
    )
    assert http.json()["reward"] == 1.0 and http.json()["status"] == "SCORE_STATUS_OK"
    assert httpx.post(f"{a.http}/v1/score", json={"scorer": "nope"}).status_code == 404
    assert httpx.post(f"{a.http}/v1/score", json={"task": 3}).status_code == 422


def _requests_ok(http: str) -> int:
    for line in httpx.get(f"{http}/metrics").text.splitlines():
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
