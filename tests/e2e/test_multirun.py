"""Many runs, one fleet: concurrent `treadle run`s on one `treadle up` stack (real CLI,
real services, private infrastructure and free ports)."""

import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from tests.support.cli import TREADLE, treadle
from tests.support.services import ROOT
from treadle_cli.tiny_model import init_tiny
from treadle_common.auth import policy as auth
from treadle_common.clients.http import ApiError
from treadle_common.clients.trainer import TrainerClient
from treadle_common.clients.weights import WeightStoreClient, chunk_positions
from treadle_common.config.recipe import RunConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _run(run_id: str, seed: int, env: dict, cwd: Path, *sets: str) -> subprocess.Popen:
    overrides = [f"run_id={run_id}", f"trainer.seed={seed}", *sets]
    args = [a for o in overrides for a in ("--set", o)]
    return subprocess.Popen(
        [TREADLE, "run", str(ROOT / "recipes/skeleton.yaml"), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


async def _chunk_positions(addr: str, token: str, model: str) -> list[dict]:
    store = WeightStoreClient(addr, token=token)
    try:
        versions = await store.list_versions(model)
        return [chunk_positions(await store.get_manifest(model, v.version)) for v in versions]
    finally:
        await store.close()


def _where_runs_are(cwd: Path) -> str:
    """What the trainer says of each run, and the tail of every service's log: a run that
    hangs says where (its CLI prints its table only at its end when not on a terminal)."""
    state = cwd / ".treadle"
    parts = []
    try:
        spec = json.loads((state / "stack.json").read_text())["spec"]
        token = (state / "auth" / "admin.token").read_text()
        url = f"http://127.0.0.1:{spec['ports']['trainer']['http']}/v1/runs"
        for run in httpx.get(url, headers=auth.bearer(token), timeout=10).json():
            run.pop("steps", None)
            parts.append(json.dumps(run))
    except Exception as exc:  # a diagnosis, whatever it finds
        parts.append(f"the trainer did not answer: {exc!r}")
    for log in sorted((state / "logs").glob("*.log")):
        parts.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-40:]))
    return "\n".join(parts)


def test_two_lora_runs_at_once_on_one_stack_each_train_and_export_their_own(cli_env, tmp_path):
    """The issue's reproduction: two LoRA runs of the skeleton, different seeds, started at
    once on one stack. Each publishes under its own policy model over the one shared base,
    rollout serves both as adapters on its one model, and each run trains exactly once and
    exports its own merged adapter."""
    up = treadle("up", "--detach", env=cli_env, cwd=tmp_path, timeout=240)
    try:
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        lora = ("trainer.lora.rank=8", "trainer.loss=cross_entropy", "trainer.lr=0.01")
        procs = {rid: _run(rid, i, cli_env, tmp_path, *lora) for i, rid in enumerate(["la", "lb"])}
        outs = {rid: p.communicate(timeout=400)[0] for rid, p in procs.items()}
        for rid, p in procs.items():
            assert p.returncode == 0, outs[rid][-4000:]
        runs = tmp_path / ".treadle" / "runs"
        summaries = {rid: json.loads((runs / rid / "summary.json").read_text()) for rid in procs}
        for summary in summaries.values():
            assert summary["state"] == "succeeded" and summary["exactly_once"] is True
            assert summary["trajectories_trained"] == 48 and summary["duplicates"] == 0
            # its own version sequence: the new adapter, then one per step
            assert summary["weight_store_versions"] == [1, 2, 3, 4]
            assert summary["rollout_policy_version"] == 4
            used = summary["usage"]  # accounted per run, on both sides
            assert used["episodes"] == summary["trajectories_produced"] == used["reward_calls"]
            assert used["generated_tokens"] > 0 and used["prompt_tokens"] > 0
            assert used["trained_tokens"] > 0 and used["trainer_s"] > 0 and used["env_s"] > 0
            assert used["weight_bytes_published"] > 0 and used["weight_bytes_fetched"] > 0
        spec = json.loads((tmp_path / ".treadle" / "stack.json").read_text())["spec"]
        token = (tmp_path / ".treadle" / "auth" / "admin.token").read_text()
        info = httpx.get(
            f"http://127.0.0.1:{spec['ports']['rollout']['http']}/v1/info",
            headers=auth.bearer(token),
        ).json()
        assert info["policies"] == {"tiny.la": 4, "tiny.lb": 4}, info["policies"]
        assert info["policy_version"] <= 2  # the model's own weights never changed
        merged = {
            rid: load_file(str(tmp_path / s["final_model_dir"] / "model.safetensors"))
            for rid, s in summaries.items()
        }
        base = load_file(str(tmp_path / ".treadle/models/tiny/model.safetensors"))
        moved = {rid: [k for k in base if not (m[k] == base[k]).all()] for rid, m in merged.items()}
        assert moved["la"] and moved["lb"], moved  # each exported its adapter, merged
        assert any(not (merged["la"][k] == merged["lb"][k]).all() for k in moved["la"])
        trainer_url = f"http://127.0.0.1:{spec['ports']['trainer']['http']}"
        by_tenant = httpx.get(f"{trainer_url}/v1/usage", headers=auth.bearer(token)).json()
        episodes = sum(s["usage"]["episodes"] for s in summaries.values())
        assert by_tenant["default"]["episodes"] == episodes, by_tenant
        metrics = httpx.get(
            f"http://127.0.0.1:{spec['ports']['rollout']['http']}/metrics",
            headers=auth.bearer(token),
        ).text
        assert 'treadle_rollout_tenant_usage_total{kind="episodes",tenant="default"}' in metrics
        # the base, published by each run that found none, is one set of chunks
        addr = f"127.0.0.1:{spec['ports']['weight-store']['grpc']}"
        bases = asyncio.run(_chunk_positions(addr, token, "tiny"))
        assert 1 <= len(bases) <= 2 and all(b == bases[0] for b in bases)
    finally:
        down = treadle("down", env=cli_env, cwd=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_full_weight_runs_of_two_models_each_use_their_own_replica(cli_env, tmp_path):
    """`treadle up --serve tiny-b=DIR`: a rollout replica per model. Two full-weight runs, one
    per model, started at once, each train exactly once and each replica swaps to its own
    model's versions only. While one trains `tiny`, the trainer refuses a LoRA run on it
    (409: a full-weight run needs its model alone), and a run of a model no replica serves
    waits, counted in `treadle status` (`unserved`)."""
    other = tmp_path / "models" / "tiny-b"
    up = treadle(
        "up", "--detach", "--serve", f"tiny-b={other}", env=cli_env, cwd=tmp_path, timeout=300
    )
    try:
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        spec = json.loads((tmp_path / ".treadle" / "stack.json").read_text())["spec"]
        token = (tmp_path / ".treadle" / "auth" / "admin.token").read_text()
        http = httpx.Client(headers=auth.bearer(token))
        trainer = TrainerClient(f"http://127.0.0.1:{spec['ports']['trainer']['http']}", http)
        steps = "trainer.num_steps=12"
        procs = {
            "fa": _run("fa", 0, cli_env, tmp_path, steps),
            "fb": _run("fb", 1, cli_env, tmp_path, "model.name=tiny-b", f"model.path={other}"),
        }
        deadline = time.monotonic() + 120
        while "fa" not in {r.run_id for r in trainer.list_runs()}:
            assert time.monotonic() < deadline and procs["fa"].poll() is None
            time.sleep(0.2)
        base = {"model": {"path": spec["model_dir"], "name": "tiny"}, "run_id": "lc"}
        lora = RunConfig.model_validate({**base, "trainer": {"lora": {"rank": 4}}})
        with pytest.raises(ApiError) as refused:
            trainer.start_run(lora)
        assert refused.value.status_code == 409 and "run fa is a full-weight run of tiny" in str(
            refused.value
        )
        orphan_dir = tmp_path / ".treadle" / "models" / "tiny-c"
        init_tiny(orphan_dir)
        orphan = {"model": {"path": str(orphan_dir), "name": "tiny-c"}, "run_id": "fc"}
        trainer.start_run(RunConfig.model_validate(orphan))
        outs = {rid: p.communicate(timeout=400)[0] for rid, p in procs.items()}
        for rid, p in procs.items():
            assert p.returncode == 0, outs[rid][-4000:]
        runs = tmp_path / ".treadle" / "runs"
        for rid, versions in (("fa", 12), ("fb", 3)):
            summary = json.loads((runs / rid / "summary.json").read_text())
            assert summary["state"] == "succeeded" and summary["exactly_once"] is True
            assert summary["rollout_policy_version"] == versions  # its own replica's model
        status = json.loads(treadle("status", "--json", env=cli_env, cwd=tmp_path).stdout)
        assert set(status["services"]) >= {"rollout", "rollout-tiny-b"}
        assert status["unserved"].get("tiny-c", 0) > 0, status["unserved"]
        infos = {
            name: http.get(f"http://127.0.0.1:{spec['ports'][name]['http']}/v1/info").json()
            for name in ("rollout", "rollout-tiny-b")
        }
        assert infos["rollout"]["model"] == "tiny" and infos["rollout-tiny-b"]["model"] == "tiny-b"
        assert infos["rollout"]["policy_version"] == 12
        assert infos["rollout-tiny-b"]["policy_version"] == 3
    finally:
        down = treadle("down", env=cli_env, cwd=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr


def test_a_poisoned_run_and_a_broken_run_leave_two_others_exactly_once(cli_env, tmp_path):
    """Failure containment: four LoRA runs share one stack. `nan` trains with an absurd
    learning rate (its loss and weights go NaN, and rollout serves its NaN adapter in the
    same batches as the others'); `broken` has an env whose every session fails (each of its
    episodes an env error, its groups unusable, its tasks fed again and again). The other two
    train exactly once, with finite losses (PPO: their recorded behaviour logprobs are
    finite), and each exports a finite adapter."""
    up = treadle("up", "--detach", env=cli_env, cwd=tmp_path, timeout=240)
    procs: dict[str, subprocess.Popen] = {}
    try:
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        lora = ("trainer.lora.rank=4", "trainer.num_steps=6", "trainer.loss=ppo")
        procs = {
            "ok-a": _run("ok-a", 0, cli_env, tmp_path, *lora),
            "ok-b": _run("ok-b", 1, cli_env, tmp_path, *lora),
            "nan": _run("nan", 2, cli_env, tmp_path, *lora, "trainer.lr=1e30"),
            "broken": _run(
                "broken",
                3,
                cli_env,
                tmp_path,
                *lora,
                "env.options.latency.distribution=bogus",
                "trainer.batch_timeout_s=600",
            ),
        }
        outs: dict[str, str] = {}
        try:  # within pytest's own timeout, so that a run that hangs says where it was
            for rid in ("ok-a", "ok-b"):
                outs[rid] = procs[rid].communicate(timeout=480)[0]
        except subprocess.TimeoutExpired:
            where = _where_runs_are(tmp_path)  # before the runs' CLIs are killed
            for rid, proc in procs.items():
                proc.kill()
                outs.setdefault(rid, proc.communicate()[0] or "")
            tails = {rid: out[-3000:] for rid, out in outs.items()}
            pytest.fail(f"the two good runs did not end within 480 s: {where}; outputs: {tails}")
        runs = tmp_path / ".treadle" / "runs"
        spec = json.loads((tmp_path / ".treadle" / "stack.json").read_text())["spec"]
        token = (tmp_path / ".treadle" / "auth" / "admin.token").read_text()
        trainer = TrainerClient(
            f"http://127.0.0.1:{spec['ports']['trainer']['http']}",
            httpx.Client(headers=auth.bearer(token)),
        )
        for rid in ("ok-a", "ok-b"):
            assert procs[rid].returncode == 0, outs[rid][-4000:]
            summary = json.loads((runs / rid / "summary.json").read_text())
            assert summary["state"] == "succeeded" and summary["exactly_once"] is True
            assert summary["trajectories_trained"] == 96 and summary["dropped"] == {}
            # PPO's ratios use the behaviour logprobs rollout recorded: a NaN one (a row of
            # the NaN adapter's leaking into theirs) would make a step's loss NaN
            steps = trainer.get_run(rid).steps
            assert len(steps) == 6 and all(math.isfinite(s.loss) for s in steps), rid
            assert all(math.isfinite(x) for x in summary["mean_reward_per_step"])
            merged = load_file(str(tmp_path / summary["final_model_dir"] / "model.safetensors"))
            assert all(bool(t.isfinite().all()) for t in merged.values())
        broken = trainer.get_run("broken")
        assert broken.step < 6 and broken.trajectories_trained == 0  # never a usable group
        assert trainer.get_run("nan").step >= 1  # it trained (into NaN) beside the others
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        down = treadle("down", env=cli_env, cwd=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr
