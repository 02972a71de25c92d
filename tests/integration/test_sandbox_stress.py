"""The sandbox under siege, on every backend: 16 hostile programs at once (memory hogs, fork
bombs, floods of the protocol channel, disk fills) and honest runs beside them, all through
the real gRPC API of one env-gateway process held, like a container, by a memory cgroup of
2 GiB (the kernel mechanism a container's memory limit is). The gateway stays up, every
honest run passes, every hostile one ends `failed` or a limit status, never `sandbox_error`.

A machine where this process cannot make a cgroup (not root, no writable cgroup filesystem)
skips, saying so; a backend that cannot run here skips with its probe's reason."""

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_sandbox import BACKENDS, IMAGE
from tests.support import hostile
from tests.support.services import start_service
from treadle_common.clients.env import EnvClient
from treadle_env_gateway.sandbox.cgroups import _own_cgroup
from treadle_env_gateway.sandbox.factory import make_backend

pytestmark = [pytest.mark.integration, pytest.mark.docker]

CAP = 2 * 2**30
ROOT = Path("/sys/fs/cgroup")
RIGHT = "```python\n" + hostile.RIGHT + "```"
HOSTILE, ENDINGS = hostile.HOSTILE, hostile.ENDINGS


@contextlib.contextmanager
def memory_cgroup(cap: int):
    """A memory cgroup of `cap` bytes (no swap) beside this process's; yields its directory
    (a pid written to its `cgroup.procs` joins it). Skips where none can be made."""
    v2 = (ROOT / "cgroup.controllers").exists()
    try:
        hierarchy, controller = (ROOT, "") if v2 else (ROOT / "memory", "memory")
        own = hierarchy / _own_cgroup(controller).lstrip("/")
        box = (own.parent if v2 else own) / f"treadle-stress-{os.getpid()}"
        box.mkdir()
    except (OSError, ValueError) as exc:
        pytest.skip(f"no memory cgroup can be made here: {exc}")
    try:
        if v2:
            (box / "memory.max").write_text(str(cap))
            (box / "memory.swap.max").write_text("0")
        else:
            (box / "memory.limit_in_bytes").write_text(str(cap))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                (box / "memory.memsw.limit_in_bytes").write_text(str(cap))
        yield box
    finally:
        for _ in range(50):  # empty once its processes are gone
            with contextlib.suppress(OSError):
                for sub in sorted(box.rglob("*"), reverse=True):
                    if sub.is_dir():
                        sub.rmdir()
                box.rmdir()
                break
            time.sleep(0.2)


def _unavailable(backend: str, tmp: Path) -> str | None:
    return make_backend(backend, tmp, IMAGE).unavailable()


async def _play(client: EnvClient, code: str, timeout_s: float) -> tuple[dict, str, float]:
    session = await client.create(
        "python_tests",
        hostile.TASK,
        options={"timeout_s": timeout_s},
    )
    step = await client.step(session.session_id, text=code)
    return json.loads(step.info_json), step.status, step.reward


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sixteen_hostile_programs_do_not_take_the_gateway_down(backend, infra, tmp_path):
    # the gateway's state dir under the working dir: a root gateway's bwrap boxes run as
    # their own uids, which must reach it (not pytest's private tmp dir)
    state = Path.cwd() / ".treadle" / f"stress-{os.getpid()}-{backend}"
    state.mkdir(parents=True, exist_ok=True)
    if reason := _unavailable(backend, state):
        pytest.skip(f"sandbox backend {backend} unavailable here: {reason}")
    with memory_cgroup(CAP) as container:
        gateway = start_service(
            "env-gateway",
            infra,
            state,
            TREADLE_ENV_SANDBOX=backend,
            TREADLE_ENV_SANDBOX_IMAGE=IMAGE,
        )
        try:
            (container / "cgroup.procs").write_text(str(gateway.proc.pid))  # before any box
            client = EnvClient(gateway.grpc_addr)
            hostile = [
                _play(client, "```python\n" + HOSTILE[kind] + "```", 5.0)
                for kind in HOSTILE
                for _ in range(4)
            ]
            honest = [_play(client, RIGHT, 60.0) for _ in range(8)]
            results = await asyncio.gather(*hostile, *honest)
            kinds = [kind for kind in HOSTILE for _ in range(4)]
            for kind, (info, status, reward) in zip(kinds, results[:16], strict=True):
                assert status == "ok" and info["sandbox"] in ENDINGS, (kind, status, info)
                assert reward == 0.0, (kind, info)
            for info, status, reward in results[16:]:
                assert status == "ok" and info["sandbox"] == "ok" and reward == 1.0, info
            # the gateway stood through it, in its container, and still serves
            assert gateway.proc.poll() is None
            assert str(gateway.proc.pid) in (container / "cgroup.procs").read_text().split()
            ready = httpx.get(f"{gateway.http}/readyz", timeout=5)
            assert ready.status_code == 200, ready.text
            info, status, reward = await _play(client, RIGHT, 60.0)
            assert reward == 1.0, info
        finally:
            gateway.stop_checked()
