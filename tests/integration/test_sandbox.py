"""The sandbox against hostile code: each attack is contained and classified, nothing is left
running, and the host is untouched. Real processes and kernel namespaces, no fakes."""

import asyncio
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from treadle_env_gateway.sandbox.runner import UID_BASE, UID_COUNT, Limits, Sandbox

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return Sandbox(tmp_path_factory.mktemp("sandbox"), Limits(wall_seconds=5, cpu_seconds=2))


def sandboxed_processes() -> list[str]:
    """Every process running as a sandbox uid."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in out.stdout.splitlines()]
    return [" ".join(r) for r in rows if UID_BASE <= int(r[0]) < UID_BASE + UID_COUNT]


@pytest.fixture(autouse=True)
def no_leftovers():
    before = sandboxed_processes()
    yield
    assert sandboxed_processes() == before, "sandboxed processes outlived their run"


async def test_plain_code_runs_as_its_own_uid_in_a_clean_environment(sandbox):
    result = await sandbox.run("import os\nprint(os.getuid(), sorted(os.environ))")
    uid = int(result.stdout.split()[0])
    assert result.status == "ok" and UID_BASE <= uid < UID_BASE + UID_COUNT
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


TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert pair(2) == (2, 2)\n"


async def test_tests_pass_a_right_answer_and_fail_a_wrong_one(sandbox):
    right = "def add(a, b):\n    return a + b\ndef pair(x):\n    return (x, x)\n"
    result = await sandbox.run_tests(right, TESTS)
    assert result.status == "ok" and result.verdict == "pass", result
    result = await sandbox.run_tests(right.replace("a + b", "a - b"), TESTS)
    assert result.status == "failed" and result.verdict == "fail"
    assert "AssertionError" in result.stdout


@pytest.mark.parametrize(
    "forgery",
    [
        "print('ALL TESTS PASSED')\nraise SystemExit(0)\n",  # the success line, then exit 0
        "import os\nos._exit(0)\n",
        "import sys, json\nsys.__stdout__.write(json.dumps({'verdict': 'pass'}) + '\\n')\n"
        'print(\'{"verdict": "pass"}\')\ndef add(a, b):\n    raise SystemExit(0)\n',
        # an answer that claims to equal everything is not plain data: it cannot come back
        "class Yes:\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Yes()\ndef pair(x):\n    return Yes()\n",
        # patching what the tests use: the tests run in another process
        "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
        "def add(a, b):\n    return 0\ndef pair(x):\n    return 0\n",
        # writing the verdict on every open descriptor it can find
        "import os, json\nline = json.dumps({'verdict': 'pass'}).encode() + b'\\n'\n"
        "for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "    try:\n        os.write(fd, line)\n    except OSError:\n        pass\n"
        "def add(a, b):\n    return 0\n",
    ],
)
async def test_a_forged_verdict_does_not_pass(sandbox, forgery):
    result = await sandbox.run_tests(forgery, TESTS)
    assert result.status != "ok" and result.verdict != "pass", result


async def test_a_sandbox_sees_only_its_own_processes(sandbox):
    result = await sandbox.run(
        "import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))"
    )
    assert result.status == "ok"
    assert len(eval_list(result.stdout)) <= 3, result.stdout  # bootstrap, the code (and ps)


def eval_list(text: str) -> list:
    import ast

    return ast.literal_eval(text.strip())


async def test_a_sandbox_cannot_read_a_siblings_work_dir():
    """The sandboxes' base dir is reachable from inside (a gateway's state dir may be; /tmp
    is not, it is a private tmpfs there): each box is still its own uid's alone."""
    reachable = Path.cwd() / ".treadle" / f"sandbox-test-{os.getpid()}"
    reachable.mkdir(parents=True, exist_ok=True)
    for path in (reachable, *reachable.parents):
        if path.stat().st_uid == os.getuid() and path != Path("/"):
            os.chmod(path, path.stat().st_mode | 0o005)
    try:
        await _siblings(Sandbox(reachable, Limits(wall_seconds=5, cpu_seconds=2)))
    finally:
        shutil.rmtree(reachable, ignore_errors=True)


async def _siblings(sandbox: Sandbox) -> None:
    holder = sandbox.run("open('secret.txt', 'w').write('mine')\nimport time\ntime.sleep(2)")
    base = str(sandbox.base_dir)
    snoop = (
        "import os, time\ntime.sleep(0.5)\n"
        f"boxes = [os.path.join({base!r}, b) for b in os.listdir({base!r})]\n"
        "found = []\n"
        "for box in boxes:\n"
        "    try:\n        found.append(open(os.path.join(box, 'secret.txt')).read())\n"
        "    except OSError as e:\n        found.append(type(e).__name__)\n"
        "print(len(boxes), found)\n"
    )
    held, snooped = await asyncio.gather(holder, sandbox.run(snoop))
    assert held.status == "ok" and snooped.status == "ok", (held, snooped)
    assert snooped.stdout.startswith("2 "), snooped.stdout  # it saw both boxes
    assert "mine" not in snooped.stdout and "PermissionError" in snooped.stdout, snooped.stdout


async def test_a_fork_bomb_does_not_starve_other_sandboxes(sandbox):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    right = "def add(a, b):\n    return a + b\ndef pair(x):\n    return (x, x)\n"

    async def later():
        await asyncio.sleep(0.5)  # the bomb has filled its own process limit by now
        return await sandbox.run_tests(right, TESTS)

    bombed, judged = await asyncio.gather(sandbox.run(bomb), later())
    assert bombed.status in ("timeout", "failed", "crash")
    assert judged.status == "ok" and judged.verdict == "pass", judged


async def test_without_a_network_namespace_nothing_runs(tmp_path):
    """Fail closed: no silent downgrade to the host's network."""
    closed = Sandbox(tmp_path / "closed")
    closed.network_isolated = False  # as on a kernel that refuses `unshare --net`
    for result in (await closed.run("print(1)"), await closed.run_tests("x = 1", TESTS)):
        assert result.status == "sandbox_error" and "network namespaces" in result.stderr
