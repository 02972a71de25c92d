"""`treadle status` / `treadle run` say why a service is down: the last error its log holds."""

import json

import pytest

from treadle_cli.stack import last_error

pytestmark = pytest.mark.unit


def a_spec(tmp_path, **fields):
    """A stack's spec on the default ports, `fields` set."""
    from treadle_cli.stack import StackSpec

    return StackSpec(
        state_dir=str(tmp_path),
        cwd=str(tmp_path),
        redis_url="redis://127.0.0.1:16379",
        nats_url="nats://127.0.0.1:14222",
        model_dir=str(tmp_path),
        model_name="m",
        ports=StackSpec.ports_from(None),
        **fields,
    )


def test_the_last_error_line_of_a_services_log_is_its_reason(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "trainer.log").write_text(
        "INFO treadle_trainer: starting\n"
        "ERROR treadle_trainer.run: an older failure\n"
        "ERROR treadle_trainer.backends.group: rank 0 of 2: the process group did not form\n"
        "INFO torch.distributed: shutting down\n"
    )
    (logs / "rollout.log").write_text(
        "Traceback (most recent call last):\n  File x\nRuntimeError: no model at /m\n"
    )
    (logs / "reward.log").write_text("INFO reward: ready\n")
    assert "process group did not form" in (last_error(tmp_path, "trainer") or "")
    assert last_error(tmp_path, "rollout") == "RuntimeError: no model at /m"
    assert last_error(tmp_path, "reward") is None
    assert last_error(tmp_path, "env-gateway") is None  # no log at all


def test_treadle_up_gives_each_service_only_the_environment_it_needs(monkeypatch):
    from treadle_cli.stack import passed_environment

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-cloud-key")
    monkeypatch.setenv("TREADLE_TOKEN", "the-callers-admin-token")
    monkeypatch.setenv("TREADLE_S3_SECRET_KEY", "s3-secret")
    monkeypatch.setenv("TREADLE_JUDGE_API_KEY", "judge-key")
    monkeypatch.setenv("TREADLE_TRAINER_LEASE_S", "15")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    envs = {s: passed_environment(s) for s in ("weight-store", "reward", "trainer", "rollout")}
    for service, env in envs.items():
        assert "AWS_SECRET_ACCESS_KEY" not in env and "TREADLE_TOKEN" not in env, service
        assert env["PATH"] and env["OMP_NUM_THREADS"] == "1"
        assert env["TREADLE_TRAINER_LEASE_S"] == "15"
        assert ("TREADLE_S3_SECRET_KEY" in env) == (service == "weight-store"), service
        assert ("TREADLE_JUDGE_API_KEY" in env) == (service == "reward"), service


def test_treadle_up_gives_redis_credentials_only_to_the_services_that_use_redis(
    tmp_path, monkeypatch
):
    from treadle_common import names
    from treadle_common.auth import infra as infra_auth

    secrets = infra_auth.InfraSecrets.generate()
    path = tmp_path / "infra.json"
    path.write_text(secrets.model_dump_json())
    monkeypatch.setenv("TREADLE_REDIS_URL", "redis://:the-admins-password@127.0.0.1:1")
    spec = a_spec(tmp_path, infra_secrets_file=str(path), secured_infra=["redis", "nats"])
    for service in names.SERVICES:
        env = spec.env(service)
        assert "the-admins-password" not in json.dumps(env), service
        if service in ("rollout", "trainer"):  # its own ACL user
            user = f"{service}:{secrets.redis[service]}@"
            assert env["TREADLE_REDIS_URL"] == f"redis://{user}127.0.0.1:16379"
        else:
            assert "TREADLE_REDIS_URL" not in env, service


def test_rollout_and_its_replicas_run_under_the_rollout_python_and_the_rest_under_ours(
    tmp_path, monkeypatch
):
    import sys

    from treadle_cli.settings import CliSettings
    from treadle_cli.stack import StackError, prepare

    spec = a_spec(tmp_path, served={"other": str(tmp_path)}, rollout_python="/opt/vllm/python")
    assert spec.command("rollout") == ["/opt/vllm/python", "-m", "treadle_rollout"]
    assert spec.command("rollout-other")[0] == "/opt/vllm/python"
    assert spec.command("trainer") == [sys.executable, "-m", "treadle_trainer"]
    assert spec.command("weight-store")[0] == sys.executable
    # a rollout Python that is not there fails before anything starts
    monkeypatch.setenv("TREADLE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("TREADLE_ROLLOUT_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(StackError, match="TREADLE_ROLLOUT_PYTHON=.*not an executable"):
        prepare(CliSettings(), None, None, base_port=None)
    assert not (tmp_path / "state" / "auth").exists()  # no token table written, no infra up
