"""The sandbox against hostile code, on every backend (`unshare`, `bwrap`, `docker`): each
attack is contained and classified, nothing is left running, and the host is untouched.
Real processes, kernel namespaces and containers, no fakes. A backend that cannot run on
this machine skips with the reason its own probe gives."""

import ast
import asyncio
import contextlib
import ctypes
import dataclasses
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.support import hostile
from treadle_env_gateway.sandbox.docker import DockerBackend
from treadle_env_gateway.sandbox.local import BwrapBackend, UnshareBackend
from treadle_env_gateway.sandbox.runner import UID_BASE, UID_COUNT, Limits, Sandbox

pytestmark = [pytest.mark.integration, pytest.mark.docker]  # the docker backend's cases

BACKENDS = ["unshare", "bwrap", "docker"]
LOCAL_BASE = "treadle/base:bookworm"
"""`scripts/docker_base.sh`'s image, built where registries cannot be reached (`.ci/run`)."""


def _image() -> str:
    if image := os.environ.get("TREADLE_TEST_SANDBOX_IMAGE"):
        return image
    docker = shutil.which("docker")
    local = docker and subprocess.run([docker, "image", "inspect", LOCAL_BASE], capture_output=True)
    return LOCAL_BASE if local and local.returncode == 0 else "python:3.11-slim-bookworm"


IMAGE = _image()
LIMITS = Limits(wall_seconds=5, cpu_seconds=2)
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert pair(2) == (2, 2)\n"
RIGHT = "def add(a, b):\n    return a + b\ndef pair(x):\n    return (x, x)\n"
PR_SET_CHILD_SUBREAPER = 36
BOMB = hostile.BOMB


@pytest.fixture(scope="module", params=BACKENDS)
def sandbox(request):
    """Under the working dir's `.treadle` (as a gateway's state dir), not pytest's private
    tmp dir: a root gateway's bwrap sandboxes run as their own uids, which must reach it."""
    base = Path.cwd() / ".treadle" / f"sandbox-test-{os.getpid()}" / request.param
    base.mkdir(parents=True, exist_ok=True)
    box = Sandbox(base, LIMITS, backend=request.param, image=IMAGE)
    if reason := box.backend.unavailable():
        pytest.skip(f"sandbox backend {request.param} unavailable here: {reason}")
    yield box
    shutil.rmtree(base, ignore_errors=True)


def sandboxed_processes() -> list[str]:
    """Every live process of this test process's tree running as a sandbox uid (a zombie runs
    nothing: an exited bwrap waits a moment for the machine's init to reap it). Its tree: a
    sandbox's processes live in its PID namespace, under the bwrap/unshare this process
    started; other processes' sandboxes (a parallel worker's services) are theirs. And every
    orphan (reparented to PID 1) running as a sandbox uid: nobody's sandbox holds it."""
    out = subprocess.run(
        ["ps", "-eo", "uid=,pid=,ppid=,stat=,args="], capture_output=True, text=True
    )
    rows = [line.split(None, 4) for line in out.stdout.splitlines()]
    children: dict[str, list[str]] = {}
    for r in rows:
        children.setdefault(r[2], []).append(r[1])
    ours, todo = set(), [str(os.getpid())]
    while todo:
        pid = todo.pop()
        ours.add(pid)
        todo += children.get(pid, [])
    return [
        " ".join(r)
        for r in rows
        if UID_BASE <= int(r[0]) < UID_BASE + UID_COUNT
        and (r[1] in ours or r[2] == "1")
        and not r[3].startswith("Z")
    ]


def _settled(before: list[str], timeout_s: float = 10.0) -> list[str]:
    """The sandboxed processes once they are back to `before`, or after `timeout_s` (a
    process may still be exiting when its run has returned)."""
    deadline = time.monotonic() + timeout_s
    while (now := sandboxed_processes()) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


@pytest.fixture(autouse=True)
def no_leftovers(request):
    before = sandboxed_processes()
    yield
    assert _settled(before) == before, "sandboxed processes outlived their run"
    if "sandbox" in request.fixturenames:
        backend = request.getfixturevalue("sandbox").backend
        if isinstance(backend, DockerBackend):
            assert backend.leftovers() == [], "sandbox containers outlived their run"


async def test_plain_code_runs_as_its_own_uid_in_a_clean_environment(sandbox):
    result = await sandbox.run("import os\nprint(os.getuid(), sorted(os.environ))")
    uid = int(result.stdout.split()[0])
    assert result.status == "ok" and UID_BASE <= uid < UID_BASE + UID_COUNT, result
    assert result.network_isolated and result.backend == sandbox.backend.name


async def test_infinite_loop_is_a_timeout(sandbox):
    result = await sandbox.run("while True:\n    pass")
    assert result.status == "timeout"


async def test_sleeping_past_the_wall_clock_is_a_timeout(sandbox):
    result = await sandbox.run("import time\ntime.sleep(3600)", limits=Limits(wall_seconds=1))
    assert result.status == "timeout" and result.duration_s < 5


async def test_memory_hog_is_memory(sandbox):
    result = await sandbox.run("hog = bytearray(4 * 2**30)")
    assert result.status == "memory"


async def test_a_memory_hog_in_many_processes_leaves_the_gateway_standing(sandbox):
    """Several children each just under the per-process limit: contained (the docker
    backend's cgroup caps their sum), and this process (the gateway) carries on."""
    code = (
        "import os\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
        "        hog = bytearray(400 * 2**20)\n        os._exit(0)\n    kids.append(pid)\n"
        "print([os.waitpid(k, 0)[1] for k in kids])\n"
    )
    result = await sandbox.run(code)
    assert result.status in ("ok", "memory", "crash", "failed"), result
    assert (await sandbox.run("print(6 * 7)")).stdout.strip() == "42"


async def test_fork_bomb_is_contained(sandbox):
    result = await sandbox.run(BOMB)
    assert result.status in ("timeout", "failed", "crash")  # process limit, then killed


async def test_crash_is_a_crash(sandbox):
    result = await sandbox.run("import os\nos.abort()")
    assert result.status == "crash"


async def test_failing_tests_are_a_wrong_answer_not_an_error(sandbox):
    result = await sandbox.run("assert 1 + 1 == 3")
    assert result.status == "failed" and "AssertionError" in result.stderr


async def test_cannot_write_outside_its_directory(sandbox, tmp_path):
    code = (
        "open('mine.txt', 'w').write('ok')\n"
        "for path in ('/tmp/treadle-escape', '/treadle-escape', "
        f"{str(tmp_path / 'host-file')!r}):\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as e:\n        print('refused', type(e).__name__)\n"
    )
    result = await sandbox.run(code)
    assert result.status == "ok" and "wrote" not in result.stdout, result
    assert not os.path.exists("/tmp/treadle-escape") and not (tmp_path / "host-file").exists()


async def test_host_files_are_not_there(sandbox):
    """/etc/shadow, the repository (this file) and the gateway's state dir (the sandboxes'
    base dir) cannot be read: not there at all, or refused."""
    targets = ["/etc/shadow", __file__, str(sandbox.base_dir), str(Path.cwd() / "pyproject.toml")]
    code = (
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        print('READ', path, len(open(path).read()) if not path.endswith('/') and "
        "not __import__('os').path.isdir(path) else __import__('os').listdir(path))\n"
        "    except OSError as e:\n        print('refused', type(e).__name__)\n"
    )
    result = await sandbox.run(code)
    assert result.status == "ok" and "READ" not in result.stdout, result.stdout


async def test_host_secrets_do_not_reach_the_code(sandbox, monkeypatch):
    monkeypatch.setenv("TREADLE_S3_SECRET_KEY", "hunter2")
    code = (
        "import os\nprint('hunter2' in str(os.environ))\n"
        "for pid in os.listdir('/proc'):\n    if pid.isdigit():\n"
        "        try:\n            print('hunter2' in open(f'/proc/{pid}/environ').read())\n"
        "        except OSError as e:\n            print('denied')\n"
    )
    result = await sandbox.run(code)
    assert result.status == "ok" and "True" not in result.stdout, result.stdout


async def test_no_network(sandbox):
    """A listener on every host address gets no connection, whichever address is tried."""
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        hosts = ["127.0.0.1", socket.gethostbyname(socket.gethostname()), "172.17.0.1"]
        code = (
            f"import socket\nfor host in {hosts!r}:\n    try:\n"
            f"        socket.create_connection((host, {port}), timeout=2)\n"
            "        print('connected', host)\n"
            "    except OSError as e:\n        print('refused', type(e).__name__)\n"
        )
        result = await sandbox.run(code)
        with pytest.raises(TimeoutError):
            listener.accept()
    assert result.status == "ok" and "connected" not in result.stdout, result.stdout


async def test_setuid_gains_nothing(sandbox):
    code = (
        "import os, subprocess\n"
        "print(open('/proc/self/status').read().split('NoNewPrivs:')[1].split()[0])\n"
        "try:\n    os.setuid(0)\n    print('ROOT')\nexcept OSError as e:\n    print('refused')\n"
        "for su in ('/usr/bin/su', '/bin/su'):\n    if os.path.exists(su):\n"
        "        r = subprocess.run([su, '-c', 'id -u'], capture_output=True, text=True,"
        " stdin=subprocess.DEVNULL)\n"
        "        print('su', r.returncode, r.stdout.strip())\n        break\n"
    )
    result = await sandbox.run(code)
    lines = result.stdout.split("\n")
    assert result.status == "ok" and lines[:2] == ["1", "refused"], result
    assert "ROOT" not in result.stdout and "su 0" not in result.stdout, result.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 system call numbers")
async def test_kernel_attack_surface_is_refused(sandbox):
    """Keyrings and new user namespaces (what many kernel exploits start from) fail: our
    seccomp filter under unshare and bwrap, the engine's default profile under docker."""
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('add_key', libc.syscall(248, b'user', b'k', b'v', 1, -2))\n"
        "print('unshare', libc.unshare(0x10000000))\n"
    )
    result = await sandbox.run(code)
    assert result.status == "ok" and result.stdout.split() == ["add_key", "-1", "unshare", "-1"]


async def test_a_process_that_tries_to_outlive_the_step_is_killed(sandbox):
    code = "import subprocess\np = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
    code += "print(p.pid)"
    result = await sandbox.run(code)
    assert result.status == "ok"  # the autouse fixture checks that `sleep 300` is gone


async def test_output_is_truncated(sandbox):
    result = await sandbox.run("print('x' * 1_000_000)", limits=Limits(max_output_bytes=1000))
    assert result.status == "ok" and result.truncated and len(result.stdout) == 1000


async def test_tests_pass_a_right_answer_and_fail_a_wrong_one(sandbox):
    result = await sandbox.run_tests(RIGHT, TESTS)
    assert result.status == "ok" and result.verdict == "pass", result
    result = await sandbox.run_tests(RIGHT.replace("a + b", "a - b"), TESTS)
    assert result.status == "failed" and result.verdict == "fail"
    assert "AssertionError" in result.stdout


FORGERIES = [
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
]


@pytest.mark.parametrize("forgery", FORGERIES)
async def test_a_forged_verdict_does_not_pass(sandbox, forgery):
    result = await sandbox.run_tests(forgery, TESTS)
    assert result.status != "ok" and result.verdict != "pass", result


async def test_a_sandbox_sees_only_its_own_processes(sandbox):
    result = await sandbox.run(
        "import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))"
    )
    assert result.status == "ok"
    assert len(ast.literal_eval(result.stdout.strip())) <= 3, result.stdout  # init + the code


async def test_a_sandbox_cannot_read_a_siblings_work_dir(sandbox):
    """While one box holds a secret, another looks for it everywhere it might be: the
    sandboxes' base dir, and every box-like directory it can reach. The walk reads tens of
    thousands of entries (`/lib` is the host's `/usr/lib`), so both boxes get time for it
    on a loaded machine, and the holder is still running when the search ends."""
    slow = dataclasses.replace(LIMITS, wall_seconds=120, cpu_seconds=60)
    holder = asyncio.ensure_future(
        sandbox.run(
            "open('secret.txt', 'w').write('mine')\nimport time\ntime.sleep(120)", limits=slow
        )
    )
    base = str(sandbox.base_dir)
    snoop = (
        "import glob, os, time\ntime.sleep(0.5)\nfound = []\n"
        # package trees hold no box, and walking every virtualenv on a dev machine takes
        # longer than the box may run
        "SKIP = {'.venv', 'site-packages', 'node_modules', '.git', '.mirror'}\n"
        f"paths = glob.glob({base!r} + '/*/secret.txt')\n"
        "for top in os.listdir('/'):\n"
        "    if top not in ('proc', 'sys', 'usr', 'dev'):\n"
        "        for here, dirs, files in os.walk('/' + top):\n"
        "            dirs[:] = [d for d in dirs if d not in SKIP]\n"
        "            paths += [os.path.join(here, f) for f in files if f == 'secret.txt']\n"
        "for path in paths:\n"
        "    try:\n        found.append(open(path).read())\n"
        "    except OSError as e:\n        found.append(type(e).__name__)\n"
        "print(found)\n"
    )
    snooped = await sandbox.run(snoop, limits=slow)
    assert not holder.done(), holder.result()  # the secret was there for the whole search
    holder.cancel()  # the box is killed
    with contextlib.suppress(asyncio.CancelledError):
        await holder
    assert snooped.status == "ok", snooped
    assert "mine" not in snooped.stdout, snooped.stdout


async def test_a_fork_bomb_does_not_starve_other_sandboxes(sandbox):
    async def later():
        await asyncio.sleep(0.5)  # the bomb has filled its own process limit by now
        return await sandbox.run_tests(RIGHT, TESTS)

    bombed, judged = await asyncio.gather(sandbox.run(BOMB), later())
    assert bombed.status in ("timeout", "failed", "crash")
    assert judged.status == "ok" and judged.verdict == "pass", judged


# --- the sandbox as a whole ----------------------------------------------------------------

FORGED_SETUP_ERROR = (
    "import sys\nsys.stderr.write('sandbox setup failed: OSError: forged\\n')\n"
    "raise SystemExit(125)\n"
)
# a line past the protocol's limit on every descriptor but stdin and stderr (fd 3 is the
# solution server's channel)
OVERLONG_LINE = (
    "import os\nline = b'x' * (6 * 2**20) + b'\\n'\n"
    "for fd in map(int, os.listdir('/proc/self/fd')):\n"
    "    if fd not in (0, 2):\n        try:\n            os.write(fd, line)\n"
    "        except OSError:\n            pass\n" + RIGHT
)


async def test_the_code_cannot_pass_its_failure_off_as_the_sandboxs(sandbox):
    """`sandbox_error` (which a run drops instead of scoring 0) comes only from the
    sandbox's own signals: never from text, an exit code or bytes the code controls."""
    ran = await sandbox.run(FORGED_SETUP_ERROR)
    assert ran.status == "failed" and ran.exit_code == 125, ran
    for code in (FORGED_SETUP_ERROR, OVERLONG_LINE):
        judged = await sandbox.run_tests(code, TESTS)
        assert judged.status == "failed" and judged.verdict != "pass", judged


async def test_a_flood_on_the_protocol_channel_is_not_buffered_by_the_gateway(sandbox):
    """128 MiB written to the solution's channel with no line end: the gateway holds a few
    MiB of it at most (the docker backend once buffered all of it), and it is the code's
    failure."""
    flood = "import os\nchunk = b'x' * 2**20\nfor _ in range(128):\n    os.write(3, chunk)\n"
    tracemalloc.start()
    try:
        judged = await sandbox.run_tests(flood + RIGHT, TESTS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert judged.status in ("failed", "timeout") and judged.verdict != "pass", judged
    assert peak < 40 * 2**20, f"the gateway held {peak / 2**20:.0f} MiB of the flood"


async def test_a_flood_after_the_answer_does_not_hold_the_run(sandbox):
    """The solution answers, then writes 16 MiB on its channel while the harness is still
    busy: the gateway stops reading past its line limit, and the unread pipe once held the
    run in its kill for ever (asyncio's wait() waits for every pipe's end)."""
    late = (
        "import os, threading, time\n"
        "def _flood():\n    time.sleep(0.3)\n"
        "    for _ in range(16):\n        os.write(3, b'x' * 2**20)\n"
        "def add(a, b):\n    threading.Thread(target=_flood).start()\n    return a + b\n"
    )
    tests = "import time\nassert add(1, 2) == 3\ntime.sleep(1)\n"
    judged = await asyncio.wait_for(sandbox.run_tests(late, tests), 60)
    assert judged.status == "ok" and judged.verdict == "pass", judged


async def test_the_work_dir_is_capped_as_a_whole(sandbox):
    """Many files each under the per-file limit: the work dir's own size cap ends it (the
    code's ENOSPC), and the host's disk under the gateway's state dir is untouched."""
    fill = (
        "import os\nfor n in range(40):\n    with open(f'f{n}', 'wb') as f:\n"
        "        f.write(b'x' * 8 * 2**20)\nprint('wrote 320 MiB')\n"
    )
    before = tree_bytes(sandbox.base_dir)
    result = await sandbox.run(fill, limits=dataclasses.replace(LIMITS, wall_seconds=20))
    assert result.status == "failed" and "No space left" in result.stderr, result
    assert "wrote 320 MiB" not in result.stdout
    # what the box left under the gateway's state dir (the filesystem's own usage moves with
    # whatever else this machine writes meanwhile: another test, a build)
    assert tree_bytes(sandbox.base_dir) - before < 32 * 2**20


def tree_bytes(directory) -> int:
    """The disk blocks of every file under `directory` (what it holds, sparse files too)."""
    return sum(p.lstat().st_blocks * 512 for p in Path(directory).rglob("*") if p.is_file())


async def test_a_box_is_capped_as_a_whole_where_it_has_a_cgroup(sandbox):
    """Four processes of 200 MiB each, every one under the per-process limit: together past
    the box's memory, so its cgroup (the container's, under docker) ends the run `memory`;
    the pids cap likewise bounds the box. A gateway that cannot make cgroups (not root, or
    no writable cgroup filesystem) skips, saying so."""
    if not isinstance(sandbox.backend, DockerBackend) and sandbox.backend.cgroups is None:
        pytest.skip("this gateway cannot make cgroups here (rlimits and oom_score_adj hold)")
    code = (
        "import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n"
        "    if pid == 0:\n        hog = bytearray(200 * 2**20)\n        time.sleep(1)\n"
        "        os._exit(0)\n    kids.append(pid)\nprint([os.waitpid(k, 0)[1] for k in kids])\n"
    )
    result = await sandbox.run(code, limits=dataclasses.replace(LIMITS, wall_seconds=20))
    assert result.status == "memory", result
    assert (await sandbox.run("print(6 * 7)")).stdout.strip() == "42"


async def test_the_oom_killer_takes_a_sandbox_before_the_gateway(sandbox):
    """Where the gateway and its sandboxes share a memory limit (a bwrap gateway in its
    container), a box that exhausts it is the kernel's first pick, never the gateway."""
    result = await sandbox.run("print(open('/proc/self/oom_score_adj').read())")
    assert result.status == "ok" and result.stdout.strip() == "1000", result


def _zombies_of(pid: int, since: set[int] | None = None) -> list[str]:
    """Zombies whose parent is `pid`; with `since` (`_pids()` at a test's start), only those
    started after it: a process another test in this worker left running, orphaned to the
    subreaper while it is one, is not a sandbox's."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,comm="], capture_output=True, text=True)
    rows = [line.split(None, 3) for line in out.stdout.splitlines()]
    return [
        " ".join(r)
        for r in rows
        if r[1] == str(pid) and r[2].startswith("Z") and (since is None or int(r[0]) not in since)
    ]


def _pids() -> set[int]:
    return {int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()}


async def test_five_hundred_sandboxes_leave_no_zombie(sandbox):
    """As in a container whose PID 1 is the gateway (here: this process made a child
    subreaper, so that orphans come to it), every sandbox the gateway started is reaped:
    250 test runs (the solution's sandbox is killed while it still serves) are 500
    sandboxes."""
    if isinstance(sandbox.backend, DockerBackend):
        pytest.skip("a docker sandbox's processes are the engine's (docker-init reaps them)")
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    before = _pids()
    try:
        results = []
        for _ in range(25):
            results += await asyncio.gather(*(sandbox.run_tests(RIGHT, TESTS) for _ in range(10)))
        assert all(r.status == "ok" for r in results), [r for r in results if r.status != "ok"]
        await asyncio.sleep(1)  # anything still exiting has exited
        assert _zombies_of(os.getpid(), before) == []
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for zombie in _zombies_of(os.getpid()):  # what a failure left: reap it here
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(zombie.split()[0]), 0)


async def test_sandboxes_killed_as_they_start_leave_no_zombie(sandbox):
    """Killed within milliseconds of its start (the other side of a test run decided at
    once), a sandbox may not have forked its inner process yet when the kill looks for it:
    the group kill then takes both at once and the orphaned inner one is the gateway's to
    reap. Three busy loops load the machine so that the kills land in that window (without
    reaping it, 480 such kills left 3 zombies here)."""
    if isinstance(sandbox.backend, DockerBackend):
        pytest.skip("a docker sandbox's processes are the engine's (docker-init reaps them)")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    before = _pids()
    delays = [0.0, 0.0, 0.0005, 0.001, 0.002, 0.005]

    async def started_and_killed(delay: float) -> None:
        with sandbox._box({"main.py": "import time\ntime.sleep(30)\n"}) as box:
            proc = await sandbox.backend.spawn(box, sandbox.limits, interactive=False)
            await asyncio.sleep(delay)
            await proc.kill()
            proc.close()

    try:
        for i in range(40):
            await asyncio.gather(*(started_and_killed(delays[(i + j) % 6]) for j in range(12)))
        await asyncio.sleep(1)  # anything still exiting has exited
        assert _zombies_of(os.getpid(), before) == []
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for zombie in _zombies_of(os.getpid()):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(zombie.split()[0]), 0)


async def test_inner_processes_an_outer_one_did_not_reap_are_reaped_by_the_gateway(
    sandbox, monkeypatch
):
    """On a loaded machine the outer process (`unshare`, bwrap's monitor) may be killed before
    it reaped the inner ones it was given time to: orphaned, they are the subreaper's, and
    the gateway reaps them (no grace at all here, so every kill leaves them so)."""
    from treadle_env_gateway.sandbox import local

    if isinstance(sandbox.backend, DockerBackend):
        pytest.skip("a docker sandbox's processes are the engine's (docker-init reaps them)")
    monkeypatch.setattr(local, "OUTER_GRACE_S", 0.0)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    before = _pids()
    try:
        for _ in range(5):
            results = await asyncio.gather(*(sandbox.run_tests(RIGHT, TESTS) for _ in range(4)))
            assert all(r.status == "ok" for r in results), results
        assert _zombies_of(os.getpid(), before) == []  # reaped in the kill, not later
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for zombie in _zombies_of(os.getpid()):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(zombie.split()[0]), 0)


async def test_past_its_cap_a_run_waits_its_turn(sandbox):
    """At most `max_concurrent` runs at once: the others queue (counted) and all finish."""
    from treadle_env_gateway.sandbox.runner import QUEUED

    capped = Sandbox(sandbox.base_dir, LIMITS, backend=sandbox.backend, max_concurrent=2)
    queued = QUEUED._value.get()
    code = "import time\nstart = time.monotonic()\ntime.sleep(0.4)\nprint(start, time.monotonic())"
    results = await asyncio.gather(*(capped.run(code) for _ in range(6)))
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    overlaps = [sum(a <= t < b for a, b in spans) for t, _ in spans]
    assert max(overlaps) <= 2, spans
    assert QUEUED._value.get() - queued >= 4


async def test_the_docker_engine_is_asked_off_the_event_loop(tmp_path):
    """Whether the engine and the image are there is checked in a thread and cached, never
    on the event loop at every run (each check is a ping and an image lookup)."""
    backend = DockerBackend(IMAGE)
    if reason := backend.unavailable():
        pytest.skip(f"no Docker sandbox here: {reason}")
    asked: list[int] = []
    probe = backend._probe

    def counted() -> str | None:
        asked.append(threading.get_ident())
        return probe()

    backend._probe = counted  # type: ignore[method-assign]
    backend._checked = None
    box = Sandbox(tmp_path, LIMITS, backend=backend)
    for _ in range(3):
        assert (await box.run("print(1)")).status == "ok"
    assert len(asked) == 1 and threading.get_ident() not in asked


# --- fail closed --------------------------------------------------------------------------


async def _refuses(box: Sandbox, words: str) -> None:
    for result in (await box.run("print(1)"), await box.run_tests(RIGHT, TESTS)):
        assert result.status == "sandbox_error" and words in result.stderr, result
        assert not result.network_isolated


async def test_unshare_without_namespaces_runs_nothing(tmp_path):
    """As on a kernel that refuses `unshare --net`: no silent downgrade to the host's."""
    backend = UnshareBackend(tmp_path)
    backend._probe = "namespaces are unavailable here"
    await _refuses(Sandbox(tmp_path, backend=backend), "namespaces are unavailable")


async def test_bwrap_not_installed_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    await _refuses(Sandbox(tmp_path, backend=BwrapBackend(tmp_path)), "bubblewrap")


async def test_docker_without_an_engine_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    await _refuses(Sandbox(tmp_path, backend="docker"), "no Docker engine")


async def test_docker_without_the_image_runs_nothing(tmp_path):
    box = Sandbox(tmp_path, backend="docker", image="treadle/no-such-sandbox:0")
    if (reason := box.backend.unavailable()) and "no Docker engine" in reason:
        pytest.skip(f"no Docker engine here: {reason}")
    await _refuses(box, "treadle/no-such-sandbox:0")


async def test_python_tests_reports_the_backend_and_its_refusal(tmp_path, monkeypatch):
    """The env's step is a `sandbox_error` naming the reason, never a reward of 0."""
    from treadle_env_gateway.envs.base import Action
    from treadle_env_gateway.envs.python_tests import PythonTests
    from treadle_env_gateway.settings import EnvGatewaySettings

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    PythonTests.configure(EnvGatewaySettings(state_dir=tmp_path, env_sandbox="docker"))
    try:
        env = PythonTests({})
        task = PythonTests.sample_tasks(1, 0, "train", {})[0]
        await env.reset(task, 0)
        step = await env.step(Action(RIGHT))
        assert step.status == "sandbox_error" and "no Docker engine" in (step.error or "")
        assert step.info["backend"] == "docker"
    finally:
        PythonTests.configure(EnvGatewaySettings())
