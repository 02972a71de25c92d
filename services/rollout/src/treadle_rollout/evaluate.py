"""`POST /v1/evaluate`: score the current policy on given tasks, greedy by default.

Each task is played as one episode on the normal path (env-gateway sessions, the reward
service's scorer), but its trajectory is returned as a score, never queued for training.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections import Counter
from typing import Any

from treadle_common.api.rollout import EvaluateRequest, EvaluateResult
from treadle_common.proto.treadle.v1 import common_pb2, task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout.episodes import EpisodeRunner
from treadle_rollout.errors import NoPolicy, NotConnected, PolicyConflict
from treadle_rollout.policies import PolicyError, RunPolicies


async def _policy(policies: RunPolicies | None, request: EvaluateRequest) -> str:
    """The policy `request` names (a LoRA run's, at `min_version` or newer), "" for the
    served one; `policies` None: only the served policy."""
    model = request.model or ""
    if model and (policies is None or model != policies.engine.model_name):
        if policies is None or not policies.is_adapter(model):
            raise NoPolicy(f"rollout serves no policy {model}")
        try:
            await asyncio.wait_for(policies.ensure(model, request.min_version), 60.0)
        except TimeoutError as exc:
            raise NoPolicy(f"no version {request.min_version} of {model}") from exc
        except PolicyError as exc:
            raise PolicyConflict(str(exc)) from exc
    return model


async def evaluate(
    episodes: EpisodeRunner | None, policies: RunPolicies | None, request: EvaluateRequest
) -> EvaluateResult:
    """Each task played once (greedy unless the request samples), scored, never queued."""
    if episodes is None:
        raise NotConnected("rollout is still connecting to NATS; retry shortly")
    runner = episodes
    model = await _policy(policies, request)
    started = time.perf_counter()
    gate = asyncio.Semaphore(request.concurrency)
    sampling = common_pb2.SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        max_new_tokens=request.max_new_tokens,
    )
    eval_id = f"eval-{uuid.uuid4().hex[:8]}"
    scorer_options = json.dumps(request.scorer_options)
    env_options = json.dumps(request.env_options)

    async def play(index: int, payload: dict[str, Any]) -> tpb.Trajectory:
        seeded = common_pb2.SamplingParams()
        seeded.CopyFrom(sampling)
        seeded.seed = request.seed + index if request.seed else 0
        task = task_pb2.Task(
            task_id=f"{eval_id}-{index}",
            run_id=eval_id,
            env=request.env,
            payload_json=json.dumps(payload),
            env_options_json=env_options,
            group_size=1,
            max_turns=request.max_turns,
            sampling=seeded,
            scorer=request.scorer,
            scorer_options_json=scorer_options,
            created_at=time.time(),
            model=model,
        )
        async with gate:
            return await runner.run(task, 0)

    trajs = await asyncio.gather(*(play(i, t) for i, t in enumerate(request.tasks)))
    rewards = [t.reward for t in trajs]  # a failed episode keeps its reward at 0
    versions = sorted({v for t in trajs for v in t.token_versions if v >= 0})
    return EvaluateResult(
        num_tasks=len(trajs),
        mean_reward=statistics.fmean(rewards),
        rewards=rewards,
        statuses=dict(Counter(tpb.TrajectoryStatus.Name(t.status) for t in trajs)),
        policy_versions=versions,
        seconds=time.perf_counter() - started,
    )
