"""`treadle status` / `treadle run` say why a service is down: the last error its log holds."""

import pytest

from treadle_cli.stack import last_error

pytestmark = pytest.mark.unit


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
