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
