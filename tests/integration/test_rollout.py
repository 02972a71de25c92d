"""Rollout against real servers: the OpenAI-compatible API driven by the official `openai`
client over real HTTP (recorded sessions land in a real Redis), staleness admission and
malformed tasks against real Redis."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest
import uvicorn

from tests.support.openai_server import openai_app
from tests.support.services import free_port
from treadle_common import names
from treadle_common.clients import streams
from treadle_common.fleet import admission
from treadle_common.proto.treadle.v1 import task_pb2
from treadle_common.proto.treadle.v1 import trajectory_pb2 as tpb
from treadle_rollout import chat, openai_api
from treadle_rollout.engines.hf import HFEngine
from treadle_rollout.worker import TaskWorker

pytestmark = pytest.mark.integration


@pytest.fixture
async def openai_server(tiny_model, redis_client):
    """The rollout's OpenAI routes over a real HF engine, served by uvicorn on a free port."""
    engine = HFEngine(tiny_model, "tiny")
    frontend = openai_api.OpenAIFrontend(
        engine, chat.SessionRecorder(engine.tokenizer), redis=redis_client
    )
    app = openai_app(frontend)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    yield client, engine
    await client.close()
    server.should_exit = True
    await task
    await engine.close()


async def test_official_openai_client(openai_server):
    client, _ = openai_server
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    chat = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "12+7="}],
        max_tokens=6,
        n=2,
        logprobs=True,
        seed=1,
    )
    assert len(chat.choices) == 2 and chat.usage.completion_tokens > 0
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert all(t.logprob <= 0 for t in chat.choices[0].logprobs.content)
    text = await client.completions.create(model="tiny", prompt="1+1=", max_tokens=4)
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage.prompt_tokens > 0

    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.code == "model_not_found" and "gpt-9" in missing.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="tiny", messages=[])
    assert bad.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as long_prompt:
        await client.completions.create(model="tiny", prompt=[5] * 5000, max_tokens=2)
    assert long_prompt.value.code == "context_length_exceeded"


async def test_recorded_session_becomes_a_token_exact_trajectory(openai_server, redis_client):
    client, engine = openai_server
    session, run = uuid.uuid4().hex, uuid.uuid4().hex
    headers = {openai_api.SESSION_HEADER: session}
    messages = [{"role": "user", "content": "guess a number"}]
    replies = []
    for follow_up in ("lower", None):
        reply = await client.chat.completions.create(  # seeded: the same replies every run
            model="tiny", messages=messages, max_tokens=5, extra_headers=headers, seed=11
        )
        replies.append(reply.choices[0].message.content)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    with pytest.raises(openai.NotFoundError, match="no active run"):  # only into a live run
        await client.post(
            f"/sessions/{session}/finish", body={"run_id": run, "reward": 0.5}, cast_to=dict
        )
    await redis_client.sadd(names.RUNS_KEY, run)
    done = await client.post(
        f"/sessions/{session}/finish", body={"run_id": run, "reward": 0.5}, cast_to=dict
    )
    assert done["num_generated"] > 0

    entries = await redis_client.xrange(names.trajectories_stream(run))
    assert len(entries) == 1
    traj = streams.decode(entries[0][1], tpb.Trajectory)
    assert traj.trajectory_id == done["trajectory_id"] and traj.reward == 0.5
    assert traj.num_turns == 2 and traj.group_id == session
    tok = engine.tokenizer
    rendered = tok.apply_chat_template(messages, tokenize=False)
    decoded = tok.decode(list(traj.tokens))

    def strip(text: str) -> str:
        """Without special tokens: a reply cut at max_tokens has no end-of-turn token of its
        own (the template adds it when the reply is sent back), and the tiny random model may
        sample one (e.g. <|pad|>), which a reply's text leaves out (`skip_special_tokens`).
        Other added tokens (e.g. <|im_start|>) stay in both."""
        for special in tok.all_special_tokens:
            text = text.replace(special, "")
        return text

    # the trajectory is the conversation as the engine saw it
    assert strip(decoded) == strip(rendered).rstrip("\n")
    generated = [t for t, m in zip(traj.tokens, traj.loss_mask, strict=True) if m]
    assert strip(tok.decode(generated)) == strip("".join(replies))
    assert all(v == 0 for v, m in zip(traj.token_versions, traj.loss_mask, strict=True) if m)
    assert all(lp < 0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m)

    with pytest.raises(openai.NotFoundError):  # finished sessions are gone
        await client.get(f"/sessions/{session}", cast_to=dict)


async def test_staleness_admission_bounds_groups_in_flight(redis_client):
    run = uuid.uuid4().hex
    await admission.configure(redis_client, run, groups_per_step=2, max_staleness=1, base_version=3)
    decisions = [await admission.admit(redis_client, run, f"t{i}", version=3) for i in range(5)]
    assert [d.admitted for d in decisions] == [True, True, True, True, False]
    assert [d.group_index for d in decisions[:4]] == [0, 1, 2, 3]
    again = await admission.admit(redis_client, run, "t1", version=3)  # a retried task
    assert again.admitted and again.group_index == 1
    newer = await admission.admit(redis_client, run, "t4", version=4)
    assert newer.admitted and newer.group_index == 4
    state = await redis_client.hgetall(names.run_state(run))
    assert int(state[b"admission_refused"]) == 1 and int(state[b"admission_started"]) == 5
    # groups no step will train free their places for the tasks that replace them
    assert (await admission.admit(redis_client, run, "t5", version=4)).admitted  # 6 of 6
    assert not (await admission.admit(redis_client, run, "t6", version=4)).admitted
    await redis_client.hincrby(names.run_state(run), "groups_unusable", 1)
    assert (await admission.admit(redis_client, run, "t6", version=4)).admitted
    assert not (await admission.admit(redis_client, run, "t7", version=4)).admitted
    await redis_client.hincrby(names.run_state(run), "admission_released", 1)
    assert (await admission.admit(redis_client, run, "t7", version=4)).admitted


async def test_closed_admission_cancels_unstarted_groups_only(redis_client):
    run = uuid.uuid4().hex
    await admission.configure(redis_client, run, groups_per_step=1, max_staleness=0, base_version=0)
    assert (await admission.admit(redis_client, run, "started", version=0)).admitted
    await admission.close(redis_client, run)
    late = await admission.admit(redis_client, run, "late", version=5)
    assert late.closed and not late.admitted
    retried = await admission.admit(redis_client, run, "started", version=0)  # keeps its number
    assert retried.admitted and not retried.closed and retried.group_index == 0
    await admission.configure(redis_client, run, groups_per_step=1, max_staleness=0, base_version=0)
    reopened = await admission.admit(redis_client, run, "late", version=1)  # a restarted trainer
    assert reopened.admitted and reopened.group_index == 1


class NoEpisodes:
    async def run(self, task, index, gate=None):
        raise AssertionError("an invalid or cancelled task must not be played")


class AnyVersion:
    """Weight sync stand-in: the engine already holds every version."""

    class engine:  # noqa: N801
        version = 0

    async def ensure_version(self, version):
        return None


async def work_until(redis_client, run: str, sync, done) -> TaskWorker:
    """A rollout worker on `run`'s task stream (no episodes played) until `done(worker)`."""
    await redis_client.sadd(names.RUNS_KEY, run)
    worker = TaskWorker(redis_client, NoEpisodes(), sync=sync, consumer="c1")
    job = asyncio.create_task(worker.run())
    try:
        for _ in range(100):
            if done(worker):
                break
            await asyncio.sleep(0.05)
    finally:
        await worker.drain()
        job.cancel()
        await redis_client.srem(names.RUNS_KEY, run)
    return worker


async def test_tasks_of_a_closed_run_are_acked_as_cancelled(redis_client):
    run = uuid.uuid4().hex
    stream = names.tasks_stream(run)
    await streams.ensure_group(redis_client, stream, names.ROLLOUT_GROUP)
    await admission.configure(redis_client, run, groups_per_step=2, max_staleness=1, base_version=0)
    await admission.close(redis_client, run)
    for i in range(3):
        task = task_pb2.Task(task_id=f"t{i}", run_id=run, env="e", scorer="s", group_size=2)
        await streams.add(redis_client, stream, task)
    worker = await work_until(redis_client, run, AnyVersion(), lambda w: w.cancelled_tasks == 3)
    assert worker.cancelled_tasks == 3 and worker.tasks_done == 0
    assert (await redis_client.xpending(stream, names.ROLLOUT_GROUP))["pending"] == 0
    state = await redis_client.hgetall(names.run_state(run))
    assert int(state[b"tasks_cancelled"]) == 3 and b"trajectories_produced" not in state


async def test_malformed_tasks_are_acked_and_counted(redis_client):
    run = uuid.uuid4().hex
    stream = names.tasks_stream(run)
    await streams.ensure_group(redis_client, stream, names.ROLLOUT_GROUP)
    await redis_client.xadd(stream, {"pb": b"\xff\xff\xff"})  # not a protobuf
    await streams.add(redis_client, stream, task_pb2.Task(task_id="x", run_id=run, scorer="s"))
    worker = await work_until(redis_client, run, None, lambda w: w.invalid_tasks == 2)
    assert worker.invalid_tasks == 2
    pending = await redis_client.xpending(stream, names.ROLLOUT_GROUP)
    assert pending["pending"] == 0
    state = await redis_client.hgetall(names.run_state(run))
    assert int(state[b"tasks_invalid"]) == 2 and state[b"last_invalid_task"]
    assert int(state[b"tasks_dead"]) == 2 and int(state[b"dead:invalid"]) == 2
    dead = await redis_client.xrange(names.dead_letters(run))
    assert [f[b"reason"] for _, f in dead] == [b"invalid", b"invalid"]
    errors = sorted(f[b"error"] for _, f in dead)  # the two ran concurrently: either order
    assert b"not a Task protobuf" in errors[0] and b"task has no env" in errors[1]


async def test_openai_engine_is_token_exact_against_an_openai_compatible_server(
    openai_server, tiny_model
):
    """The `openai` engine driving a Treadle rollout's /v1/completions: same tokens, and
    logprobs that match the served model."""
    from tests.support.reference import teacher_forced_logprobs
    from treadle_rollout.engines.base import Sampling
    from treadle_rollout.engines.openai import OpenAIEngine

    client, served = openai_server
    engine = OpenAIEngine(tiny_model, "tiny", base_url=str(client.base_url))
    prompt = served.tokenizer("3+4= what is the answer", add_special_tokens=False)["input_ids"]
    gen = await engine.generate(prompt, Sampling(1.0, 1.0, 8, seed=5))
    direct = await served.generate(prompt, Sampling(1.0, 1.0, 8, seed=5))
    assert gen.tokens == direct.tokens and gen.finish_reason == direct.finish_reason
    reference = teacher_forced_logprobs(served.model, prompt, gen.tokens)
    assert gen.logprobs == pytest.approx(reference, abs=1e-4)
    with pytest.raises(NotImplementedError):
        await engine.update_to(None, 1)  # type: ignore[arg-type]
    await engine.close()


# --- exactly-once task handling: heartbeats, owned commits, dead letters ------------------------
class CountingEpisodes:
    """Episodes that wait for their gate (the task's version), then return a trajectory;
    `fail` makes every attempt raise."""

    def __init__(self, fail: bool = False):
        self.calls: list[str] = []
        self.fail = fail

    async def run(self, task, index, gate=None):
        self.calls.append(f"{task.task_id}/{index}")
        if gate is not None:
            await gate
        if self.fail:
            raise RuntimeError(f"scripted failure of {task.task_id}")
        return tpb.Trajectory(
            trajectory_id=f"{task.task_id}/{index}", group_id=task.task_id, run_id=task.run_id
        )


class SlowVersion:
    """Weight sync stand-in: the task's version arrives only after `delay_s`."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.engine = type("Engine", (), {"version": 0})()

    async def ensure_version(self, version):
        await asyncio.sleep(self.delay_s)
        self.engine.version = max(self.engine.version, version)

    async def wait_for_newer(self, version, timeout_s):
        await asyncio.sleep(timeout_s)


async def _one_task(redis_client, group_size: int = 2) -> tuple[str, str]:
    run = uuid.uuid4().hex
    stream = names.tasks_stream(run)
    await streams.ensure_group(redis_client, stream, names.ROLLOUT_GROUP)
    await admission.configure(redis_client, run, groups_per_step=1, max_staleness=4, base_version=0)
    task = task_pb2.Task(
        task_id="t0", run_id=run, env="e", scorer="s", group_size=group_size, min_policy_version=1
    )
    await streams.add(redis_client, stream, task)
    await redis_client.sadd(names.RUNS_KEY, run)
    return run, stream


async def _until(predicate, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_a_task_waiting_longer_than_the_reclaim_time_is_not_run_twice(redis_client):
    """The task waits 4 s for its version, 4x the reclaim idle time: its replica's heartbeat
    keeps it, so the second replica never reclaims and replays it. (A reclaim time of 1 s:
    with 0.4 s a loaded machine delayed a beat past it, and the replicas passed the task back
    and forth.)"""
    run, stream = await _one_task(redis_client)
    episodes = CountingEpisodes()
    workers = [
        TaskWorker(redis_client, episodes, SlowVersion(4.0), consumer=c, reclaim_idle_ms=1000)
        for c in ("c1", "c2")
    ]
    jobs = [asyncio.create_task(w.run()) for w in workers]
    try:
        await _until(lambda: sum(w.tasks_done for w in workers) == 1)
        await asyncio.sleep(1.0)  # a second attempt would show up by now
    finally:
        for w, job in zip(workers, jobs, strict=True):
            await w.drain()
            job.cancel()
        await redis_client.srem(names.RUNS_KEY, run)
    assert sorted(episodes.calls) == ["t0/0", "t0/1"]  # one attempt
    assert await redis_client.xlen(names.trajectories_stream(run)) == 2
    assert (await redis_client.xpending(stream, names.ROLLOUT_GROUP))["pending"] == 0
    assert all(w.lost_tasks == 0 for w in workers)


async def test_a_replica_that_lost_its_task_cannot_commit_it(redis_client):
    """Another replica took the task over while this one was stalled (an XCLAIM, as its
    reclaim does): this one's heartbeat finds it gone, drops its attempt and writes nothing."""
    run, stream = await _one_task(redis_client)
    worker = TaskWorker(
        redis_client, CountingEpisodes(), SlowVersion(3.0), consumer="c1", reclaim_idle_ms=400
    )
    job = asyncio.create_task(worker.run())
    try:
        await _until(lambda: len(worker.in_flight) == 1)
        entry = streams.text((await redis_client.xrange(stream))[0][0])
        await redis_client.xclaim(stream, names.ROLLOUT_GROUP, "c2", 0, [entry])

        async def c2_alive():  # the new owner heartbeats it, as a live replica does
            while await streams.heartbeat(redis_client, stream, names.ROLLOUT_GROUP, "c2", entry):
                await asyncio.sleep(0.1)

        alive = asyncio.create_task(c2_alive())
        await _until(lambda: worker.lost_tasks == 1)
        await asyncio.sleep(3.0)  # past the version's arrival: nothing may be committed
    finally:
        await worker.drain()
        job.cancel()
        alive.cancel()
        await redis_client.srem(names.RUNS_KEY, run)
    assert worker.tasks_done == 0
    assert await redis_client.xlen(names.trajectories_stream(run)) == 0
    pending = await redis_client.xpending_range(stream, names.ROLLOUT_GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"c2"]  # still the new owner's


async def test_a_task_that_keeps_failing_is_dead_lettered_with_its_last_error(redis_client):
    run, stream = await _one_task(redis_client, group_size=1)
    worker = TaskWorker(
        redis_client,
        CountingEpisodes(fail=True),
        SlowVersion(0.0),
        consumer="c1",
        reclaim_idle_ms=200,
        max_deliveries=2,
    )
    job = asyncio.create_task(worker.run())
    try:
        await _until(lambda: worker.dead_lettered == 1)
    finally:
        await worker.drain()
        job.cancel()
        await redis_client.srem(names.RUNS_KEY, run)
    dead = await redis_client.xrange(names.dead_letters(run))
    assert len(dead) == 1
    fields = dead[0][1]
    assert fields[b"reason"] == b"max_deliveries" and int(fields[b"deliveries"]) == 3
    assert b"scripted failure of t0" in fields[b"error"]
    assert task_pb2.Task.FromString(fields[b"pb"]).task_id == "t0"  # kept for a replay
    assert (await redis_client.xpending(stream, names.ROLLOUT_GROUP))["pending"] == 0
    state = await redis_client.hgetall(names.run_state(run))
    assert int(state[b"tasks_dead"]) == 1 and int(state[b"dead:max_deliveries"]) == 1
    assert int(state[b"admission_released"]) == 1  # it was admitted: its place is freed
    assert b"trajectories_produced" not in state
    assert not await redis_client.exists(names.task_errors(run))


# --- failed episodes: retried in their group, quarantined whole, circuit-broken -------------------
class FlakyEpisodes:
    """Episodes of which `fails[task/index]` attempts fail first (an env error, as the
    episode runner reports one), the others played."""

    def __init__(self, fails: dict[str, int] | None = None, every: int = 0):
        self.fails = fails or {}
        self.every = every
        self.calls: list[str] = []

    async def run(self, task, index, gate=None):
        key = f"{task.task_id}/{index}"
        self.calls.append(key)
        traj = tpb.Trajectory(trajectory_id=key, group_id=task.task_id, run_id=task.run_id)
        if self.calls.count(key) <= self.fails.get(key, self.every):
            traj.status = tpb.TRAJECTORY_STATUS_ENV_ERROR
            traj.error = f"scripted env failure of {key}"
        else:
            traj.status = tpb.TRAJECTORY_STATUS_OK
        return traj


async def _failing_run(
    redis_client, episodes, tasks: int = 1, group_size: int = 3, **failures
) -> tuple[str, str, TaskWorker]:
    """A run of `tasks` tasks of env `e`, and the worker that plays them one at a time."""
    run = uuid.uuid4().hex
    stream = names.tasks_stream(run)
    await streams.ensure_group(redis_client, stream, names.ROLLOUT_GROUP)
    await admission.configure(redis_client, run, groups_per_step=8, max_staleness=4, base_version=0)
    for i in range(tasks):
        task = task_pb2.Task(
            task_id=f"t{i}",
            run_id=run,
            env="e",
            scorer="s",
            group_size=group_size,
            failures=task_pb2.EpisodeFailures(**failures),
        )
        await streams.add(redis_client, stream, task)
    await redis_client.sadd(names.RUNS_KEY, run)
    worker = TaskWorker(
        redis_client, episodes, SlowVersion(0.0), consumer="c1", max_concurrent_tasks=1
    )
    return run, stream, worker


async def _play_until(redis_client, run: str, worker: TaskWorker, predicate) -> None:
    job = asyncio.create_task(worker.run())
    try:
        await _until(predicate)
    finally:
        await worker.drain()
        job.cancel()
        await redis_client.srem(names.RUNS_KEY, run)


async def test_a_failed_episode_is_played_again_and_its_group_lands_whole(redis_client):
    episodes = FlakyEpisodes({"t0/1": 2})
    run, stream, worker = await _failing_run(redis_client, episodes, retries=2)
    await _play_until(redis_client, run, worker, lambda: worker.tasks_done == 1)
    assert sorted(episodes.calls) == ["t0/0", "t0/1", "t0/1", "t0/1", "t0/2"]
    landed = [
        tpb.Trajectory.FromString(f[b"pb"])
        for _, f in await redis_client.xrange(names.trajectories_stream(run))
    ]
    assert [t.trajectory_id for t in landed] == ["t0/0", "t0/1", "t0/2"]
    assert all(t.status == tpb.TRAJECTORY_STATUS_OK for t in landed)
    assert await redis_client.xlen(names.quarantine(run)) == 0
    assert worker.groups.retries.retried == 2


async def test_a_group_with_an_episode_failing_past_its_retries_is_quarantined_whole(
    redis_client,
):
    """Never trained on its survivors: nothing of the group reaches the trainer; the failed
    episode is in the quarantine stream with why, the task dead-lettered (the trainer feeds
    another), the survivors counted as discarded, all with the task's ack."""
    episodes = FlakyEpisodes({"t0/1": 99})
    run, stream, worker = await _failing_run(redis_client, episodes, retries=2)
    await _play_until(redis_client, run, worker, lambda: worker.dead_lettered == 1)
    assert episodes.calls.count("t0/1") == 3  # the first attempt and two retries
    assert await redis_client.xlen(names.trajectories_stream(run)) == 0
    [(_, q)] = await redis_client.xrange(names.quarantine(run))
    assert q[b"trajectory_id"] == b"t0/1" and q[b"reason"] == b"env_error"
    assert int(q[b"attempts"]) == 3 and b"scripted env failure of t0/1" in q[b"error"]
    assert tpb.Trajectory.FromString(q[b"pb"]).status == tpb.TRAJECTORY_STATUS_ENV_ERROR
    [(_, dead)] = await redis_client.xrange(names.dead_letters(run))
    assert (
        dead[b"reason"] == b"episodes_failed"
        and b"1 of 3 episodes failed 3 times" in dead[b"error"]
    )
    state = await redis_client.hgetall(names.run_state(run))
    assert int(state[b"trajectories_quarantined"]) == 1
    assert int(state[b"trajectories_discarded"]) == 2
    assert int(state[b"dead:episodes_failed"]) == 1 and int(state[b"tasks_dead"]) == 1
    assert (await redis_client.xpending(stream, names.ROLLOUT_GROUP))["pending"] == 0


async def test_an_env_failing_past_its_threshold_is_circuit_broken_for_the_run(redis_client):
    """Window 4, rate 0.5: once 4 of the run's last 4 episodes failed, the breaker opens (why
    in the run's state) and the run's later tasks of that env are dead-lettered unplayed."""
    episodes = FlakyEpisodes(every=99)
    run, _, worker = await _failing_run(
        redis_client,
        episodes,
        tasks=4,
        group_size=2,
        retries=1,
        breaker_window=4,
        breaker_failure_rate=0.5,
    )
    await _play_until(redis_client, run, worker, lambda: worker.dead_lettered == 4)
    assert sorted(set(episodes.calls)) == ["t0/0", "t0/1", "t1/0", "t1/1"]  # t2, t3 unplayed
    state = await redis_client.hgetall(names.run_state(run))
    why = streams.text(state[b"broken:e"])
    assert why.startswith("4 of its last 4 episodes failed; the last: env_error: scripted")
    assert int(state[b"dead:episodes_failed"]) == 2
    assert int(state[b"dead:env_circuit_open"]) == 2
    dead = [f for _, f in await redis_client.xrange(names.dead_letters(run))]
    assert [d[b"task_id"] for d in dead] == [b"t0", b"t1", b"t2", b"t3"]
    assert streams.text(dead[3][b"error"]) == why
    assert await redis_client.hget(names.env_health(run), "e") == b"1111"
