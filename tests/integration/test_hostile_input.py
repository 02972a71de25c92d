"""Hostile input at every edge gets its clear 4xx / INVALID_ARGUMENT, and leaves other runs,
sessions and files untouched (checked on disk and in Redis).

The trainer here allows client-named paths only under `allowed/` (TREADLE_TRAINER_PATH_ROOTS);
`outside/` holds files a hostile request names and must never change.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from tests.support.services import ADMIN, TOKENS, start_service
from treadle_common import names
from treadle_common.auth import policy as auth
from treadle_common.clients.weights import RawTensor, WeightStoreClient, layout_manifest
from treadle_common.model.export import write_hf

pytestmark = pytest.mark.integration
JSON = {"content-type": "application/json"}
TOKENS_ROLLOUT = auth.bearer(TOKENS["rollout"])
SESSION = "X-Treadle-Session"


@pytest.fixture(scope="module")
def hostile(infra, tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    allowed, outside = tmp / "allowed", tmp / "outside"
    shutil.copytree(tiny_model, allowed / "model")
    (allowed / "tasks.jsonl").write_text('{"q": 1}\n')
    outside.mkdir()
    (outside / "secret.jsonl").write_text('{"q": "do not read"}\n')
    shutil.copytree(tiny_model, outside / "model")
    (tmp / "allowed-link").symlink_to(outside)  # a link out of nowhere allowed
    (allowed / "escape").symlink_to(outside)  # a link inside that leads out
    started = []
    try:
        store = start_service("weight-store", infra, tmp, TREADLE_WEIGHT_STORE_DIR=str(tmp / "ws"))
        started.append(store)
        limits = {"TREADLE_MAX_BODY_MB": "2"}
        gateway = start_service("env-gateway", infra, tmp, **limits)
        started.append(gateway)
        reward = start_service(
            "reward", infra, tmp, TREADLE_REWARD_TIMEOUT_S="0.5", TREADLE_REWARD_CPU_WORKERS="1"
        )
        started.append(reward)
        addr = {
            "TREADLE_WEIGHT_STORE_ADDR": store.grpc_addr or "",
            "TREADLE_ENV_GATEWAY_ADDR": gateway.grpc_addr or "",
        }
        roots = json.dumps([str(allowed)])
        trainer = start_service(
            "trainer",
            infra,
            tmp,
            TREADLE_TRAINER_PATH_ROOTS=roots,
            TREADLE_TRAINER_MAX_TRAINING_SESSIONS="1",
            **addr,
        )
        started.append(trainer)
        model = str(tiny_model)
        rollout = start_service(
            "rollout",
            infra,
            tmp,
            TREADLE_ROLLOUT_MODEL=model,
            TREADLE_ROLLOUT_MAX_QUEUED="1",
            **addr,
        )
        started.append(rollout)
        yield {
            "tmp": tmp,
            "store": store,
            "trainer": trainer,
            "rollout": rollout,
            "gateway": gateway,
            "reward": reward,
        }
    finally:  # a service that failed to start stops the ones before it
        for proc in reversed(started):
            proc.stop_checked()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def recipe(run: str, allowed: Path, **changes) -> dict:
    body = {
        "run_id": run,
        "model": {"path": str(allowed / "model"), "name": "hostile"},
        "data": {"path": str(allowed / "tasks.jsonl")},
        "trainer": {"num_steps": 1},
        "output_dir": str(allowed / "runs"),
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            body[section] = {**body[section], field: value}
        else:
            body[section] = value
    return body


def outside_paths(tmp: Path) -> dict[str, dict]:
    allowed, outside = tmp / "allowed", tmp / "outside"
    return {
        "model outside": {"model__path": str(outside / "model")},
        "model via ..": {"model__path": str(allowed / ".." / "outside" / "model")},
        "model via a link": {"model__path": str(allowed / "escape" / "model")},
        "data outside": {"data__path": str(outside / "secret.jsonl")},
        "data /etc/passwd": {"data__path": "/etc/passwd"},
        "output_dir /": {"output_dir": "/"},
        "output_dir outside": {"output_dir": str(outside)},
        "output_dir via a link": {"output_dir": str(tmp / "allowed-link")},
    }


@pytest.mark.parametrize(
    "case",
    [
        "model outside",
        "model via ..",
        "model via a link",
        "data outside",
        "data /etc/passwd",
        "output_dir /",
        "output_dir outside",
        "output_dir via a link",
    ],
)
def test_a_recipe_naming_a_path_outside_the_roots_is_refused(hostile, infra, case):
    tmp = hostile["tmp"]
    before = snapshot(tmp / "outside")
    run = f"hostile-{uuid.uuid4().hex[:6]}"
    body = recipe(run, tmp / "allowed", **outside_paths(tmp)[case])
    answer = httpx.post(f"{hostile['trainer'].http}/v1/runs", json=body, headers=ADMIN, timeout=30)
    assert answer.status_code == 400, (case, answer.text)
    field = next(iter(outside_paths(tmp)[case])).replace("__", ".")
    detail = answer.json()["detail"]
    assert field in detail and "TREADLE_TRAINER_PATH_ROOTS" in detail, detail
    r = redis.Redis.from_url(infra.redis_url)
    assert r.keys(f"treadle:{run}:*") == [] and not r.sismember(names.RUNS_KEY, run)
    assert snapshot(tmp / "outside") == before
    assert not (tmp / "allowed" / "runs" / run).exists()


@pytest.mark.parametrize(
    ("trainer", "reason"),
    [
        ({"backend": "megatron", "tensor_parallel": 2}, "needs a multiple of 2 ranks"),
        ({"backend": "single", "tensor_parallel": 2}, "need backend megatron"),
        ({"backend": "megatron", "pipeline_parallel": 2}, "less than or equal to 1"),
        ({"backend": "deepspeed"}, "'auto', 'single', 'fsdp' or 'megatron'"),
    ],
)
def test_a_backend_the_trainer_cannot_run_is_refused_with_the_reason(
    hostile, infra, trainer, reason
):
    """This trainer is one process: a recipe asking for two tensor-parallel ranks is refused
    before anything of the run exists."""
    run = f"hostile-{uuid.uuid4().hex[:6]}"
    body = recipe(run, hostile["tmp"] / "allowed", trainer={"num_steps": 1, **trainer})
    answer = httpx.post(f"{hostile['trainer'].http}/v1/runs", json=body, headers=ADMIN, timeout=30)
    assert answer.status_code == 422 and reason in answer.text, answer.text
    r = redis.Redis.from_url(infra.redis_url)
    assert r.keys(f"treadle:{run}:*") == [] and not r.sismember(names.RUNS_KEY, run)


def test_the_training_api_confines_paths_and_names(hostile):
    tmp, http = hostile["tmp"], hostile["trainer"].http
    before = snapshot(tmp / "outside")
    with httpx.Client(base_url=http, headers=ADMIN, timeout=60) as client:
        for path in (tmp / "outside" / "model", "/etc", tmp / "allowed" / "escape" / "model"):
            answer = client.post("/v1/training/sessions", json={"model_path": str(path)})
            assert answer.status_code == 400 and "model_path" in answer.text, answer.text
        bad_name = {"model_path": str(tmp / "allowed" / "model"), "model_name": "a..b"}
        assert client.post("/v1/training/sessions", json=bad_name).status_code == 422
        created = client.post(
            "/v1/training/sessions", json={"model_path": str(tmp / "allowed" / "model")}
        )
        assert created.status_code == 201, created.text
        sid = created.json()["session_id"]
        for name in ("..", "../../outside", "a/b", ".hidden", "x" * 200):
            answer = client.post(f"/v1/training/sessions/{sid}/save_state", json={"name": name})
            assert answer.status_code == 422, (name, answer.text)
        second = client.post(
            "/v1/training/sessions", json={"model_path": str(tmp / "allowed" / "model")}
        )
        assert second.status_code == 429 and "MAX_TRAINING_SESSIONS" in second.text, second.text
        fb = f"/v1/training/sessions/{sid}/forward_backward"
        datum = {"model_input": [1, 2], "target_tokens": [2, 3]}
        for bad in (
            {"data": [{**datum, "advantages": [float("nan"), 1.0]}]},  # would poison the weights
            {"data": [datum], "loss_params": {"clip_high": float("inf")}},
            {"data": [datum] * 4097},
            {"data": [{"model_input": [1] * 131_073, "target_tokens": [1] * 131_073}]},
        ):
            answer = client.post(fb, content=json.dumps(bad), headers=JSON)
            assert answer.status_code == 422, answer.text[:300]
        saved = client.post(f"/v1/training/sessions/{sid}/save_state", json={"name": "ok.1"})
        assert saved.status_code == 200, saved.text
        for path in (tmp / "outside", "/etc", tmp / "allowed" / "escape"):
            answer = client.post(
                f"/v1/training/sessions/{sid}/load_state", json={"path": str(path)}
            )
            assert answer.status_code == 400 and "path" in answer.text, answer.text
        assert client.delete(f"/v1/training/sessions/{sid}").status_code == 204
    assert snapshot(tmp / "outside") == before


async def test_the_weight_store_refuses_bad_model_and_asset_names(hostile):
    client = WeightStoreClient(
        hostile["store"].grpc_addr or "", attempts=1, token=TOKENS["trainer"]
    )
    tensors = {"w": RawTensor("F32", (4,), memoryview(bytes(16)))}
    try:
        for model in ("a..b", "../x", "a/b", "a b", "x" * 200, "treadle.weights.>"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.publish(model, tensors)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, model
            assert "invalid model name" in (refused.value.details() or "")
        for asset in ("../evil", "a/b", "..", "."):
            pending = layout_manifest("good", tensors, assets={asset: b"x"})
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.publish_pending(pending)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, asset
            assert "invalid asset name" in (refused.value.details() or "")
        assert await client.list_versions("good") == []  # nothing was committed
    finally:
        await client.close()


def test_an_export_never_writes_outside_its_directory(tmp_path):
    """A store of another origin may hold any asset name: the export refuses it whole."""
    from treadle_common.clients.weights import FetchResult, hash_pieces

    tensors = {"w": RawTensor("F32", (4,), memoryview(bytes(16)))}
    pending = layout_manifest("m", tensors, assets={"../escaped.json": b"{}"})
    hash_pieces(pending.pieces)
    chunks = {ref.hash: bytes(data) for ref, data in pending.pieces}
    fetched = FetchResult(pending.manifest, chunks, 0)
    with pytest.raises(ValueError, match="not a file name"):
        write_hf(fetched, tmp_path / "out")
    assert not (tmp_path / "escaped.json").exists()


def test_a_recorded_session_finishes_only_into_an_active_run_and_never_self_graded(hostile):
    http = hostile["rollout"].http
    agent = auth.bearer(TOKENS["agent"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=http, timeout=60) as client:
        bad = client.post(
            "/v1/chat/completions",
            json=chat,
            headers={**agent, "X-Treadle-Session": "../../x"},
        )
        assert bad.status_code == 400 and "X-Treadle-Session" in bad.text, bad.text
        made = client.post(
            "/v1/chat/completions", json=chat, headers={**agent, "X-Treadle-Session": "s1"}
        )
        assert made.status_code == 200, made.text
        finish = "/v1/sessions/s1/finish"
        self_graded = client.post(finish, json={"run_id": "somerun", "reward": 1.0}, headers=agent)
        assert self_graded.status_code == 403 and "only says" in self_graded.text
        for run in ("a:b", "../x", "UPPER"):
            answer = client.post(finish, json={"run_id": run, "reward": 1.0}, headers=ADMIN)
            assert answer.status_code in (400, 422) and "run_id" in answer.text, answer.text
        inactive = client.post(finish, json={"run_id": "no-such-run", "reward": 1.0}, headers=ADMIN)
        assert inactive.status_code == 404 and "no active run" in inactive.text
        assert client.get("/v1/sessions/s1", headers=agent).status_code == 200  # still there
        assert client.get("/v1/sessions/a..b", headers=agent).status_code == 422


async def test_an_agent_is_judged_only_against_the_task_its_trainer_issued(hostile, redis_client):
    """An agent that names the scorer and a task whose answer is its own reply would score 1;
    it may only say "done", on a session a trainer opened against a task (`POST
    /v1/sessions`), and is judged against that task, once."""
    agent, trainer = auth.bearer(TOKENS["agent"]), auth.bearer(TOKENS["trainer"])
    run = f"judged-{uuid.uuid4().hex[:8]}"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    await redis_client.sadd(names.RUNS_KEY, run)
    try:
        async with httpx.AsyncClient(base_url=hostile["rollout"].http, timeout=60) as client:

            async def play(sid: str) -> str:
                said = await client.post(
                    "/v1/chat/completions", json=chat, headers={**agent, SESSION: sid}
                )
                assert said.status_code == 200, said.text
                return said.json()["choices"][0]["message"]["content"]

            mine = f"own-{uuid.uuid4().hex[:6]}"
            reply = await play(mine)
            own_answer = {"scorer": "exact_match", "task_json": json.dumps({"answer": reply})}
            for body in ({"run_id": run, **own_answer}, {"run_id": run}, {}):
                graded = await client.post(f"/v1/sessions/{mine}/finish", json=body, headers=agent)
                assert graded.status_code == 403, (body, graded.text)
            assert await redis_client.xlen(names.trajectories_stream(run)) == 0
            secret = json.dumps({"answer": uuid.uuid4().hex})
            task = {"run_id": run, "scorer": "exact_match", "task_json": secret}
            assert (await client.post("/v1/sessions", json=task, headers=agent)).status_code == 403
            opened = await client.post("/v1/sessions", json=task, headers=trainer)
            assert opened.status_code == 201, opened.text
            sid = opened.json()["session_id"]
            await play(sid)
            finish = f"/v1/sessions/{sid}/finish"
            swapped = await client.post(finish, json=own_answer, headers=agent)
            assert swapped.status_code == 403, swapped.text
            done = await client.post(finish, json={}, headers=agent)
            assert done.status_code == 200, done.text
            assert done.json()["reward"] == 0.0  # judged against the issued answer, not its reply
            again = await client.post(finish, json={}, headers=agent)
            assert again.status_code in (403, 404)
            assert await redis_client.xlen(names.trajectories_stream(run)) == 1
            taken = await client.post(
                "/v1/sessions", json={**task, "session_id": mine}, headers=trainer
            )
            assert taken.status_code == 409  # an agent's own session is not bound after the fact
    finally:
        await redis_client.srem(names.RUNS_KEY, run)
        await redis_client.delete(names.trajectories_stream(run))


async def test_a_run_config_planted_in_redis_is_checked_before_a_resume(hostile, redis_client):
    """Redis is not trusted more than a caller: a run whose stored config names a path
    outside the allowed roots (as if written by another service with Redis access) is not
    resumed, and says so; nothing is written there."""
    import asyncio

    from treadle_common.config.recipe import load_recipe

    run = f"planted-{uuid.uuid4().hex[:6]}"
    outside = hostile["tmp"] / "outside"
    root = Path(__file__).resolve().parents[2]
    cfg = load_recipe(
        root / "recipes" / "skeleton.yaml",
        [f"run_id={run}", f"output_dir={outside / 'runs'}", f"model.path={outside / 'model'}"],
    )
    before = snapshot(outside)
    await redis_client.set(names.run_config(run), cfg.model_dump_json())
    await redis_client.sadd(names.RUNS_KEY, run)
    log = hostile["trainer"].log
    try:
        for _ in range(40):  # the trainer looks for orphans every second
            if "refusing to resume run" in log.read_text() and run in log.read_text():
                break
            await asyncio.sleep(0.25)
        assert "its stored config fails" in log.read_text(), log.read_text()[-2000:]
        assert await redis_client.get(names.run_owner(run)) is None  # not taken
        assert snapshot(outside) == before
    finally:
        await redis_client.srem(names.RUNS_KEY, run)
        await redis_client.delete(names.run_config(run))


def test_bodies_past_the_cap_are_refused_before_parsing(hostile):
    """413 whether the body declares its length or streams it (chunked), and the service
    counts the drop and stays up."""
    http = hostile["gateway"].http
    big = b'{"env": "arith", "task": {"pad": "' + b"x" * (3 * 1024 * 1024) + b'"}}'

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    with httpx.Client(base_url=http, headers={**TOKENS_ROLLOUT, **JSON}, timeout=60) as client:
        declared = client.post("/v1/sessions", content=big)
        assert declared.status_code == 413 and "TREADLE_MAX_BODY_MB" in declared.text
        streamed = client.post("/v1/sessions", content=chunks())
        assert streamed.status_code == 413, streamed.text[:200]
        metrics = client.get("/metrics").text
        assert 'reason="body_too_large"' in metrics
        assert client.get("/v1/envs").status_code == 200


@pytest.mark.parametrize(
    ("env", "options", "named"),
    [
        ("python_tests", {"timeout_s": 1e9}, "timeout_s"),
        ("python_tests", {"timeout_s": "10"}, "timeout_s"),
        ("arith", {"latency": {"fixed_ms": 1e12}}, "fixed_ms"),
        ("arith", {"latency": {"sigma": float("nan")}}, "sigma"),
        ("calculator", {"max_turns": 10**6}, "max_turns"),
    ],
)
def test_session_options_out_of_bounds_are_refused(hostile, env, options, named):
    tasks = {
        "python_tests": {"prompt": "p", "tests": "assert True", "entry_point": "f"},
        "arith": {"a": 1, "b": 2, "op": "+", "answer": "3"},
        "calculator": {"expression": "(1+2)*3", "answer": "9"},
    }
    body = json.dumps({"env": env, "task": tasks[env], "options": options})
    with httpx.Client(base_url=hostile["gateway"].http, headers=TOKENS_ROLLOUT) as client:
        answer = client.post("/v1/sessions", content=body, headers=JSON)
    assert answer.status_code == 400 and named in answer.text, answer.text


@pytest.mark.parametrize(
    ("env", "options", "named"),
    [
        ("countdown", {"num_numbers": 0}, "num_numbers"),
        ("countdown", {"max_number": 10**9}, "max_number"),
        ("frozenlake", {"size": 10_000}, "size"),
        ("frozenlake", {"hole_prob": 0.99}, "hole_prob"),
        ("arith", {"max_operand": 10**9}, "max_operand"),
        ("guess_number", {"low": 5, "high": 1}, "high"),
    ],
)
async def test_dataset_options_out_of_bounds_are_refused(hostile, env, options, named):
    from treadle_common.clients.env import EnvClient

    client = EnvClient(hostile["gateway"].grpc_addr or "", token=TOKENS["rollout"])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.sample_tasks(env, 4, seed=0, split="train", options=options)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert named in (refused.value.details() or "")
        assert len(await client.sample_tasks(env, 2, seed=0, split="train", options={})) == 2
    finally:
        await client.close()


def test_scoring_limits_and_a_runaway_scorer_is_killed(hostile):
    """Batch length and answer size are bounded; a regex that backtracks past the service's
    timeout has its worker process killed, is answered TIMEOUT, and the next score works.
    (The service's timeout here, 0.5 s, is below format_regex's own 1 s match timeout, so it
    is the kill that ends the match.)"""
    workers = auth.bearer(TOKENS["rollout"])
    with httpx.Client(base_url=hostile["reward"].http, headers=workers, timeout=60) as client:
        one = {"scorer": "exact_match", "task": {"answer": "1"}, "answer": "1"}
        assert client.post("/v1/score:batch", json=[one] * 1025).status_code == 422
        assert client.post("/v1/score:batch", json=[one] * 3).status_code == 200
        long = {**one, "answer": "1" * 1_000_001}
        assert client.post("/v1/score", json=long).status_code == 422
        runaway = {
            "scorer": "format_regex",
            "answer": "a" * 60 + "b",
            "options": {"pattern": "(a|aa)+$", "full_match": True},
        }
        answer = client.post("/v1/score", json=runaway).json()
        assert answer["status"] == "SCORE_STATUS_TIMEOUT", answer
        assert "worker was killed" in answer["message"]
        killed = 'treadle_reward_workers_killed_total{reason="timeout",scorer="format_regex"} 1.0'
        assert killed in client.get("/metrics").text
        math = {"scorer": "math_verify", "task": {"answer": "3"}, "answer": "\\boxed{6/2}"}
        assert client.post("/v1/score", json=math).json()["reward"] == 1.0


async def test_client_generation_past_the_queue_bound_gets_429(hostile):
    """The rollout admits TREADLE_ROLLOUT_MAX_QUEUED=1 client request at a time: of several
    at once, the first generates and the others are refused at once with 429."""
    import asyncio

    agent = auth.bearer(TOKENS["agent"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 48}
    async with httpx.AsyncClient(
        base_url=hostile["rollout"].http, headers=agent, timeout=120
    ) as client:
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=chat) for _ in range(6))
        )
    codes = sorted(a.status_code for a in answers)
    assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
    refused = next(a for a in answers if a.status_code == 429)
    assert "TREADLE_ROLLOUT_MAX_QUEUED" in refused.json()["error"]["message"]


def test_an_unknown_env_fails_its_episode_at_once(hostile):
    """NOT_FOUND from a session create names a missing env, not a restarted gateway: the
    episode fails as env_error without being played again."""
    body = {"env": "no-such-env", "tasks": [{}], "max_new_tokens": 2}
    with httpx.Client(base_url=hostile["rollout"].http, headers=ADMIN, timeout=30) as client:
        answer = client.post("/v1/evaluate", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["statuses"] == {"TRAJECTORY_STATUS_ENV_ERROR": 1}
        assert "treadle_rollout_episode_retries_total 0.0" in client.get("/metrics").text


async def test_grpc_generation_past_the_queue_bound_gets_resource_exhausted(hostile):
    import asyncio

    from treadle_common.proto.treadle.v1 import common_pb2, generation_pb2, generation_pb2_grpc
    from treadle_common.runtime import grpc_options

    sampling = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=48)
    request = generation_pb2.GenerateRequest(prompt_tokens=[1, 2, 3], sampling=sampling)
    channel = grpc_options.channel(hostile["rollout"].grpc_addr or "", TOKENS["agent"])
    stub = generation_pb2_grpc.GenerationStub(channel)

    async def one() -> grpc.StatusCode:
        try:
            await stub.Generate(request, timeout=120)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            assert exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or (
                "TREADLE_ROLLOUT_MAX_QUEUED" in (exc.details() or "")
            )
            return exc.code()

    try:
        codes = await asyncio.gather(*(one() for _ in range(6)))
    finally:
        await channel.close()
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes
