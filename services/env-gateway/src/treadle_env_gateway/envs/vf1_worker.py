"""The `verifiers-v1` env's worker: plays episodes of an environment written for verifiers
0.4 (`verifiers.v1`), in the interpreter of a virtualenv that has it (verifiers 0.4 pins
`openai<3` and `mcp==2.0.0`, which the gateway's own environment cannot hold). It imports
only the standard library and verifiers; the gateway runs it as a script and speaks JSON
lines over its stdin and stdout (logs go to stderr):

    python vf1_worker.py '{"id": "vf1-tiny-arith", "args": {...}, "eval_args": {...},
                           "harness": "", "max_turns": null}'

    {"id": 1, "op": "tasks", "split": "train"}
        -> {"id": 1, "tasks": [<TaskData as JSON>, ...]}
    {"id": 2, "op": "episode", "split": "train", "idx": 7, "base_url": "...", "model": "...",
     "sampling": {"temperature": 1.0, "max_tokens": 64}}
        -> {"id": 2, "result": {"reward": 1.0, "rewards": {...}, "metrics": {...}, ...}}
    any op that fails -> {"id": n, "error": "..."}

Episodes run concurrently. The policy is reached at `base_url`, the gateway's endpoint for
that one episode, with the key the gateway put in `VF1_WORKER_API_KEY`.

A harness's program (the chat loop of verifiers' default `null` harness, say) is a PEP 723
script that verifiers runs with `uv sync --script`, resolving its dependencies from PyPI at
run time, unpinned. Here it runs on this interpreter instead, whose locked virtualenv holds
those dependencies (verifiers' own): nothing is downloaded while a run trains.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

API_KEY_VAR = "VF1_WORKER_API_KEY"
MAX_TASKS = 100_000
"""An infinite taskset is read up to this many tasks."""


async def _script_on_this_interpreter(
    self: SubprocessRuntime, script: str | bytes, env: dict[str, str] | None = None, **_: Any
) -> list[str]:
    data = script.encode() if isinstance(script, str) else script
    assert self.workdir is not None  # started
    path = self.workdir / f".treadle-{hashlib.sha256(data).hexdigest()[:16]}.py"
    path.write_bytes(data)
    return [sys.executable, str(path)]


SubprocessRuntime.prepare_uv_script = _script_on_this_interpreter  # type: ignore[method-assign]


class Worker:
    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.configs = {"train": spec["args"], "eval": spec["eval_args"]}
        self.envs: dict[str, Any] = {}
        self.tasks: dict[str, list[Any]] = {}
        self.stack = contextlib.AsyncExitStack()

    async def env(self, split: str) -> Any:
        if split not in self.configs:
            raise ValueError(f"split must be train or eval, got {split!r}")
        if split not in self.envs:
            _check_installed(self.spec["id"])
            agent: dict[str, Any] = {"runtime": {"type": "subprocess"}}
            if self.spec["harness"]:
                agent["harness"] = {"id": self.spec["harness"]}
            if self.spec["max_turns"]:
                agent["max_turns"] = self.spec["max_turns"]
            # the harness's program runs on this machine, in the worker's interpreter: an
            # environment's own code is trusted as an installed package (the gateway's
            # sandboxes are for the code a policy writes)
            config = vf.SingleAgentEnvConfig.model_validate(
                {"taskset": {"id": self.spec["id"], **self.configs[split]}, "agent": agent}
            )
            env = vf.SingleAgentEnv(config)
            view = env.taskset if env.taskset.bounded else env.taskset.take(MAX_TASKS)
            self.tasks[split] = list(view)[:MAX_TASKS]
            await self.stack.enter_async_context(env.serving())
            self.envs[split] = env
        return self.envs[split]

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        split = str(request.get("split", "train"))
        env = await self.env(split)
        if request["op"] == "tasks":
            return {"tasks": [t.data.model_dump(mode="json") for t in self.tasks[split]]}
        if request["op"] != "episode":
            raise ValueError(f"unknown op {request['op']!r}")
        task = self.tasks[split][int(request["idx"])]
        ctx = vf.ModelContext(
            model=str(request["model"]),
            client=vf.EvalClientConfig(base_url=str(request["base_url"]), api_key_var=API_KEY_VAR),
            sampling=vf.SamplingConfig(**(request.get("sampling") or {})),
        )
        episode = await env.run_episode(task, ctx)
        return {"result": summary(episode)}


def summary(episode: Any) -> dict[str, Any]:
    """What the gateway needs of an episode: its reward and why it ended."""
    traces = list(episode.traces)
    rewards: dict[str, float] = {}
    metrics: dict[str, float] = {}
    for trace in traces:
        rewards.update({k: r.value for k, r in trace.rewards.items() if r is not None})
        metrics.update({k: float(v) for k, v in trace.metrics.items() if v is not None})
    errors = [f"{e.type}: {e.message}" for t in traces for e in t.errors] + [
        f"{e.type}: {e.message}" for e in episode.errors
    ]
    return {
        "ok": bool(episode.ok),
        "reward": sum(t.reward for t in traces),
        "rewards": rewards,
        "metrics": metrics,
        "answer": traces[-1].last_reply if traces else "",
        "stop_condition": traces[-1].stop_condition if traces else None,
        "timeout": bool(episode.is_timeout),
        "errors": errors,
        "model_calls": sum(len(t.calls) for t in traces),
    }


async def serve(worker: Worker, replies: Any) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    lock = asyncio.Lock()
    pending: set[asyncio.Task[None]] = set()

    async def answer(request: dict[str, Any]) -> None:
        try:
            reply = {"id": request.get("id"), **await worker.handle(request)}
        except Exception as exc:  # noqa: BLE001 - every failure is answered, the worker stays
            logging.warning("request %s failed: %s: %s", request.get("id"), type(exc).__name__, exc)
            reply = {"id": request.get("id"), "error": f"{type(exc).__name__}: {exc}"}
        async with lock:
            replies.write(json.dumps(reply) + "\n")
            replies.flush()

    try:
        while line := await reader.readline():
            task = asyncio.ensure_future(answer(json.loads(line)))
            pending.add(task)
            task.add_done_callback(pending.discard)
    finally:
        for task in list(pending):
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await worker.stack.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec", help='JSON: {"id", "args", "eval_args", "harness", "max_turns"}')
    spec = json.loads(parser.parse_args().spec)
    # verifiers' own logs at the gateway's level, but no quieter than a warning: its INFO is a
    # line per rollout
    named = getattr(logging, os.environ.get("TREADLE_LOG_LEVEL", "INFO").upper(), logging.INFO)
    level = max(logging.WARNING, named if isinstance(named, int) else logging.INFO)
    logging.basicConfig(level=level, stream=sys.stderr)
    # the replies keep stdout's pipe; whatever else writes to stdout (a taskset's print, a
    # child process) goes to stderr, so it cannot break a reply
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    asyncio.run(serve(Worker(spec), replies))


def _check_installed(taskset_id: str) -> None:
    """Only a module of an installed distribution that depends on verifiers is imported, never
    an arbitrary module a recipe names. The module is found without running it; it must be one
    such a distribution installed (listed in its files, or, installed editable, under a
    directory its `.pth` file adds to the path)."""
    module = taskset_id.replace("-", "_").lower()
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    for dist in importlib.metadata.distributions():
        requirements = dist.requires or []
        if origin is None or not any(
            re.match(r"^verifiers\b", r) and "extra ==" not in r for r in requirements
        ):
            continue
        if module in (dist.read_text("top_level.txt") or "").split():
            return
        for file in dist.files or []:
            path = Path(str(dist.locate_file(file))).resolve()
            if path == origin or path in origin.parents:
                return
            if path.suffix == ".pth" and any(
                Path(line.strip()).resolve() in origin.parents
                for line in path.read_text().splitlines()
                if line.strip() and not line.startswith(("#", "import"))
            ):
                return
    raise ValueError(
        f"no verifiers environment {taskset_id!r} is installed (a taskset is a module of a "
        "distribution that depends on verifiers)"
    )


if __name__ == "__main__":
    main()
