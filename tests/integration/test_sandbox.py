"""The sandbox against hostile code: each attack is contained and classified, nothing is left
running, and the host is untouched. Real processes and kernel namespaces, no fakes."""

import os
import socket
import subprocess

import pytest

from treadle_env_gateway.sandbox.runner import Limits, Sandbox

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return Sandbox(tmp_path_factory.mktemp("sandbox"), Limits(wall_seconds=5, cpu_seconds=2))


def nobody_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-u", "nobody", "-a"], capture_output=True, text=True)
    return out.stdout.splitlines()


@pytest.fixture(autouse=True)
def no_leftovers():
    before = nobody_processes()
    yield
    assert nobody_processes() == before, "sandboxed processes outlived their run"


async def test_plain_code_runs_as_nobody_in_a_clean_environment(sandbox):
    result = await sandbox.run("import os\nprint(os.getuid(), sorted(os.environ))")
    assert result.status == "ok" and result.stdout.startswith("65534 ")
    assert result.network_isolated


async def test_infinite_loop_is_a_timeout(sandbox):
    result = await sandbox.run("while True:\n    pass")
    assert result.status == "timeout"


async def test_sleeping_forever_is_a_timeout_by_wall_clock(sandbox):
    result = await sandbox.run("import time\ntime.sleep(3600)", limits=Limits(wall_seconds=1))
    assert result.status == "timeout" and result.duration_s < 5


async def test_memory_hog_is_memory(sandbox):
    result = await sandbox.run("hog = bytearray(4 * 2**30)")
    assert result.status == "memory"


async def test_fork_bomb_is_contained(sandbox):
    result = await sandbox.run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    assert result.status in (
        "timeout",
        "failed",
        "crash",
    )  # contained: limit on processes, then killed


async def test_crash_is_a_crash(sandbox):
    result = await sandbox.run("import os\nos.abort()")
    assert result.status == "crash"


async def test_failing_tests_are_a_wrong_answer_not_an_error(sandbox):
    result = await sandbox.run("assert 1 + 1 == 3")
    assert result.status == "failed" and "AssertionError" in result.stderr


async def test_cannot_write_outside_its_directory(sandbox, tmp_path):
    code = (
        "open('mine.txt', 'w').write('ok')\n"
        "open('/tmp/treadle-escape', 'w').write('x')\n"  # lands on a private tmpfs
        f"open({str(tmp_path / 'host-file')!r}, 'w').write('x')\n"
    )
    result = await sandbox.run(code)
    assert result.status == "failed" and "PermissionError" in result.stderr
    assert not os.path.exists("/tmp/treadle-escape") and not (tmp_path / "host-file").exists()


async def test_host_secrets_do_not_reach_the_code(sandbox, monkeypatch):
    monkeypatch.setenv("TREADLE_S3_SECRET_KEY", "hunter2")
    code = (
        "import os\nprint('hunter2' in str(os.environ))\n"
        "try:\n    print(open('/proc/1/environ').read())\n"
        "except OSError as e:\n    print('denied', type(e).__name__)\n"
    )
    result = await sandbox.run(code)
    assert result.status == "ok" and "hunter2" not in result.stdout
    assert result.stdout.splitlines() == ["False", "denied PermissionError"]


async def test_no_network(sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        code += "print('connected')"
        result = await sandbox.run(code)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert result.status == "failed" and "connected" not in result.stdout
    assert "Error" in result.stderr


async def test_a_process_that_tries_to_outlive_the_step_is_killed(sandbox):
    code = "import subprocess\np = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
    code += "print(p.pid)"
    result = await sandbox.run(code)
    assert result.status == "ok"  # the autouse fixture checks that `sleep 300` is gone


async def test_output_is_truncated(sandbox):
    result = await sandbox.run("print('x' * 1_000_000)", limits=Limits(max_output_bytes=1000))
    assert result.status == "ok" and result.truncated and len(result.stdout) == 1000
