"""`verifiers-v1`: any environment written for verifiers 0.4 (`verifiers.v1`: a taskset of
tasks with `@reward`s, played by a harness, tools served as MCP toolsets), installed as a
package in the verifiers virtualenv.

    env: {name: verifiers-v1, options: {id: vf1-tiny-arith, args: {num_tasks: 2000},
                                        eval_args: {num_tasks: 200, offset: 100000}}}

`args` is the taskset's config (`--env.taskset.*` in verifiers' CLI), `eval_args` the held-out
split's (default: `args`); `harness` pins the agent's harness id (default: the taskset's own,
else verifiers' `bash`). verifiers 0.4 pins `openai<3` and `mcp==2.0.0`, which the gateway's
environment cannot hold beside the OpenAI Agents SDK, so it lives in a virtualenv of its own
(`scripts/setup_verifiers.sh`: `.venv-verifiers`, locked) named by
`TREADLE_ENV_VERIFIERS_PYTHON`. Per (id, args) the gateway starts one worker there
(`vf1_worker.py`) and keeps it; its episodes run concurrently in it. An episode is played:
verifiers runs its harness against the base URL the gateway's loopback endpoint gives that
episode (`loopback.py`), whose requests rollout answers over `Play`, recording every turn
token-exact; the taskset's rewards score it in the worker. The reward is their weighted sum,
each reward and metric in the breakdown (`info.breakdown`, read by the `env_reward` scorer).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from pathlib import Path
from typing import Any

from treadle_common.runtime.logs import get_logger
from treadle_env_gateway.envs import register
from treadle_env_gateway.envs.base import EnvError, Message, Model, PlayedEnv, StepResult
from treadle_env_gateway.envs.loopback import LoopbackPolicy
from treadle_env_gateway.settings import EnvGatewaySettings

log = get_logger(__name__)
ID_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,127}$")
WORKER = Path(__file__).with_name("vf1_worker.py")
API_KEY_VAR = "VF1_WORKER_API_KEY"  # the worker's name for the loopback key


def _spec(options: dict[str, Any]) -> str:
    """The worker's configuration (JSON, sorted: the key of the worker that plays it)."""
    env_id = options.get("id")
    if not isinstance(env_id, str) or not ID_PATTERN.match(env_id):
        raise EnvError(
            "verifiers-v1 needs option 'id': the installed taskset package (e.g. "
            f"'vf1-tiny-arith'), got {env_id!r}"
        )
    args, eval_args = options.get("args", {}), options.get("eval_args", options.get("args", {}))
    if not isinstance(args, dict) or not isinstance(eval_args, dict):
        raise EnvError("verifiers-v1 options 'args' and 'eval_args' must be objects")
    harness = options.get("harness", "")
    if not isinstance(harness, str) or (harness and not ID_PATTERN.match(harness)):
        raise EnvError(f"verifiers-v1 option 'harness' must be a harness id, got {harness!r}")
    max_turns = options.get("max_turns")
    if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
        raise EnvError(
            f"verifiers-v1 option 'max_turns' must be a positive integer, got {max_turns!r}"
        )
    spec = {"id": env_id, "args": args, "eval_args": eval_args, "harness": harness}
    return json.dumps({**spec, "max_turns": max_turns}, sort_keys=True)


class Worker:
    """One worker process and its requests in flight (JSON lines, answered by id)."""

    def __init__(self, proc: asyncio.subprocess.Process, spec: str):
        self.proc, self.key, self.env_id = proc, spec, json.loads(spec)["id"]
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.next_id = 0
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                log.warning("verifiers worker wrote a line that is no reply", line=line[:200])
                continue
            future = self.pending.pop(reply.get("id"), None)
            if future is not None and not future.done():
                future.set_result(reply)
        code = await self.proc.wait()
        for future in self.pending.values():  # the worker died under them
            if not future.done():
                future.set_exception(
                    EnvError(f"the verifiers worker of {self.env_id!r} exited ({code})")
                )
        self.pending.clear()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and not self.reader.done()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """End of input: the worker closes its environments (their servers) and exits; one
        that does not within `timeout_s` is killed. Reaped either way."""
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await self.reader

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({**request, "id": self.next_id}) + "\n").encode())
        await self.proc.stdin.drain()
        reply = await future
        if "error" in reply:
            raise EnvError(f"verifiers environment {self.env_id!r}: {reply['error']}")
        return reply


@register("verifiers-v1")
class VerifiersV1Env(PlayedEnv):
    python = ""
    workers: dict[str, Worker] = {}
    tasks: dict[tuple[str, str], list[dict[str, Any]]] = {}
    loopback = LoopbackPolicy()
    _starting = asyncio.Lock()

    @classmethod
    def configure(cls, settings: EnvGatewaySettings) -> None:
        cls.python = settings.env_verifiers_python

    @classmethod
    async def shutdown(cls) -> None:
        workers, cls.workers = list(cls.workers.values()), {}
        await asyncio.gather(*(w.stop() for w in workers))

    @classmethod
    async def worker(cls, options: dict[str, Any]) -> Worker:
        spec = _spec(options)
        async with cls._starting:
            worker = cls.workers.get(spec)
            if worker is None or not worker.alive:
                worker = cls.workers[spec] = Worker(await cls._spawn(spec), spec)
        return worker

    @classmethod
    async def _spawn(cls, spec: str) -> Any:
        if not cls.python or not os.access(cls.python, os.X_OK):
            raise EnvError(
                "verifiers-v1 needs TREADLE_ENV_VERIFIERS_PYTHON: the interpreter of a "
                f"virtualenv with verifiers 0.4 (scripts/setup_verifiers.sh), got {cls.python!r}"
            )
        log.info("verifiers worker starting", spec=spec)
        return await asyncio.create_subprocess_exec(
            cls.python,
            str(WORKER),
            spec,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, API_KEY_VAR: cls.loopback.key},
            limit=64 * 1024 * 1024,
        )

    @classmethod
    async def sample_tasks(  # type: ignore[override]
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        worker = await cls.worker(options)
        source = "eval" if split == "eval" else "train"  # the taskset built with eval_args, or args
        if (worker.key, source) not in cls.tasks:
            reply = await worker.call({"op": "tasks", "split": source})
            cls.tasks[worker.key, source] = reply["tasks"]
        tasks = cls.tasks[worker.key, source]
        if not tasks:
            return []
        rng = random.Random(f"verifiers-v1-{split}-{seed}")
        if split == "eval":  # distinct tasks: every one counts once in an evaluation
            picked = rng.sample(range(len(tasks)), min(num_tasks, len(tasks)))
        else:
            picked = [rng.randrange(len(tasks)) for _ in range(num_tasks)]
        return [{**tasks[i], "split": source, "idx": i} for i in picked]

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        """The task's prompt (what the episode starts from; the SFT warm-up renders it)."""
        if not isinstance(task.get("idx"), int) or task.get("split") not in ("train", "eval"):
            raise EnvError("a verifiers-v1 task is one SampleTasks gave: its 'idx' and 'split'")
        await super().reset(task, seed)
        prompt = task.get("prompt")
        if isinstance(prompt, str):
            return [Message("user", prompt)]
        return [
            Message(str(m.get("role", "user")), m["content"])
            for m in prompt or []
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        ]

    async def play(self, model: Model, model_name: str, sampling: dict[str, Any]) -> StepResult:
        worker = await self.worker(self.options)
        async with self.loopback.episode(model) as base_url:
            reply = await worker.call(
                {
                    "op": "episode",
                    "split": self.task["split"],
                    "idx": self.task["idx"],
                    "base_url": base_url,
                    "model": model_name,
                    "sampling": sampling,
                }
            )
        result = reply["result"]
        if not result["ok"] and not result["model_calls"]:
            return StepResult([], done=True, status="env_error", error="; ".join(result["errors"]))
        info = {
            "model_error": "; ".join(result["errors"]),
            "reward": result["reward"],
            "breakdown": {**result["metrics"], **result["rewards"]},
            "answer": result["answer"],
            "stop_condition": result["stop_condition"],
            "truncated": result["timeout"],
        }
        return StepResult([], done=True, reward=float(result["reward"]), info=info)
