"""`verifiers`: any environment written for the `verifiers` library (0.1.14, the pinned
`treadle-env-gateway[verifiers]` extra), installed as a package that exposes
`load_environment()`, e.g. from PyPI or the Environments Hub.

    env: {name: verifiers, options: {id: vf-tiny-arith, args: {num_train: 2000}}}

Tasks are rows of the environment's dataset (split `eval`: its eval dataset). An episode is
played, not stepped: the environment's own `run_rollout` runs its loop (single-turn, tools,
multi-turn) with an OpenAI client whose requests rollout answers over `Play`, recording every
turn token-exact, and the environment's rubric scores it here. The reward is the rubric's;
its functions' values are the breakdown (`info.breakdown`, read by the `env_reward` scorer).

Why the rubric runs here and not in the reward service: a rubric is code of the environment
package and reads the rollout's whole state (the completion, tool results, the env's own
state keys), which exists only where the environment ran; the reward service would have to
load every environment package and rebuild that state from the transcript.
"""

from __future__ import annotations

import json
import random
import re
import signal
from functools import cache
from importlib import metadata
from typing import Any

from treadle_env_gateway.envs import register
from treadle_env_gateway.envs.base import EnvError, Message, Model, PlayedEnv, StepResult
from treadle_env_gateway.envs.relay import openai_client

ID_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,127}$")


def _key(options: dict[str, Any]) -> tuple[str, str]:
    env_id = options.get("id")
    if not isinstance(env_id, str) or not ID_PATTERN.match(env_id):
        raise EnvError(
            "verifiers needs option 'id': the installed environment package (e.g. "
            f"'vf-tiny-arith'), got {env_id!r}"
        )
    args = options.get("args", {})
    if not isinstance(args, dict):
        raise EnvError(f"verifiers option 'args' must be an object, got {args!r}")
    return env_id, json.dumps(args, sort_keys=True)


def _is_environment_package(env_id: str) -> bool:
    """Whether `env_id` names an installed distribution that depends on verifiers: only such
    a package is imported, never an arbitrary module a recipe names."""
    try:
        requirements = metadata.requires(env_id) or []
    except metadata.PackageNotFoundError:
        return False
    return any(  # a hard dependency: not one of an optional extra
        re.match(r"^verifiers\b", r) and not re.search(r";.*\bextra\s*==", r) for r in requirements
    )


@cache
def _load(env_id: str, args_json: str) -> Any:
    """The environment, loaded once per (id, args) in this process."""
    try:
        import verifiers as vf
    except ImportError as exc:
        raise EnvError(
            "the verifiers env needs the verifiers package: pip install "
            "'treadle-env-gateway[verifiers]'"
        ) from exc
    if not _is_environment_package(env_id):
        raise EnvError(
            f"no verifiers environment {env_id!r} is installed (an environment is a "
            "distribution of that name that depends on verifiers)"
        )
    module = env_id.replace("-", "_").split("/")[-1]
    # a verifiers Environment installs its own SIGTERM/SIGINT handlers (which exit at once);
    # the gateway's own, which drain it, are put back
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return vf.load_environment(env_id, **json.loads(args_json))
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise EnvError(f"no verifiers environment {env_id!r} is installed") from exc
        raise
    except (AttributeError, TypeError, ValueError) as exc:
        raise EnvError(f"verifiers environment {env_id!r}: {exc}") from exc
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def environment(options: dict[str, Any]) -> Any:
    return _load(*_key(options))


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(row, default=str))


@register("verifiers")
class VerifiersEnv(PlayedEnv):
    @classmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        env = environment(options)
        dataset = env.get_eval_dataset() if split == "eval" else env.get_dataset()
        size = len(dataset)
        if size == 0:
            return []
        rng = random.Random(f"verifiers-{split}-{seed}")
        if split == "eval":  # distinct rows: every one counts once in an evaluation
            rows = rng.sample(range(size), min(num_tasks, size))
        else:
            rows = [rng.randrange(size) for _ in range(num_tasks)]
        return [_json_safe(dataset[i]) for i in rows]

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        """The task's prompt messages (what the episode starts from; e.g. the SFT warm-up
        renders them), though the episode itself is played."""
        prompt = task.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
            raise EnvError("a verifiers task needs its dataset row's 'prompt' (messages)")
        self.env = environment(self.options)
        await super().reset(task, seed)
        return [
            Message(str(m.get("role", "user")), m["content"])
            for m in prompt
            if isinstance(m.get("content"), str)
        ]

    async def play(self, model: Model, model_name: str, sampling: dict[str, Any]) -> StepResult:
        from verifiers.clients import OpenAIChatCompletionsClient

        task = self.task
        rollout_input: dict[str, Any] = {
            "prompt": task["prompt"],
            "example_id": task.get("example_id", 0),
        }
        for key in ("answer", "info", "task"):
            if key in task:
                rollout_input[key] = task[key]
        client = OpenAIChatCompletionsClient(openai_client(model))
        output = await self.env.run_rollout(
            rollout_input, client=client, model=model_name, sampling_args=sampling
        )
        error = output.get("error")
        if error and not _models_doing(error):
            return StepResult([], done=True, status="env_error", error=_error_text(error))
        metrics = {k: float(v) for k, v in (output.get("metrics") or {}).items()}
        reward = float(output.get("reward") or 0.0)
        info = {
            "model_error": _error_text(error) if error else "",
            "reward": reward,
            "breakdown": metrics,
            "answer": _last_content(output.get("completion")),
            "target": task.get("answer"),
            "stop_condition": output.get("stop_condition"),
            "truncated": bool(output.get("is_truncated")),
        }
        return StepResult([], done=True, reward=reward, info=info)


MODELS_ERRORS = ("InvalidModelResponseError", "OverlongPromptError", "ToolParseError")
"""verifiers errors that the policy's own output caused (an empty or unparsable reply, a
context it filled, a malformed tool call): the episode is valid and earns the rubric's reward
(0 when the rollout stopped there). Every other error is the environment's: `env_error`."""


def _models_doing(error: Any) -> bool:
    import verifiers.errors

    name = error.get("error") if isinstance(error, dict) else None
    cls = getattr(verifiers.errors, str(name), None)
    causes = tuple(getattr(verifiers.errors, n) for n in MODELS_ERRORS)
    return isinstance(cls, type) and issubclass(cls, causes)


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('error', 'error')}: {error.get('error_chain_str') or ''}".strip()
    return str(error)


def _last_content(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    for message in reversed(completion or []):
        if hasattr(message, "model_dump"):  # verifiers' typed messages
            message = message.model_dump()
        if isinstance(message, dict) and message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""
