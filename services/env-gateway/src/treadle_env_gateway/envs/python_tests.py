"""`python_tests`: the policy writes a function; hidden unit tests run in the sandbox.

A wrong answer (tests fail, or the code times out, exhausts memory or crashes) is reward 0
with the sandbox's classification in `info`; a failure of the sandbox itself is not the
model's fault and ends the step with status `sandbox_error`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from treadle_env_gateway.envs import register
from treadle_env_gateway.envs.base import Action, Env, EnvError, Message, StepResult, option
from treadle_env_gateway.sandbox.runner import Limits, Sandbox
from treadle_env_gateway.settings import EnvGatewaySettings

MAX_TIMEOUT_S = 60.0
"""The longest a client may let its tests run (`timeout_s`)."""
PROBLEMS = [
    (
        "add",
        "add(a, b) returning the sum of two integers",
        "assert add(2, 3) == 5\nassert add(-1, 1) == 0",
    ),
    (
        "reverse",
        "reverse(s) returning the string s reversed",
        "assert reverse('abc') == 'cba'\nassert reverse('') == ''",
    ),
    (
        "is_palindrome",
        "is_palindrome(s) telling whether s reads the same backwards",
        "assert is_palindrome('level')\nassert not is_palindrome('ab')",
    ),
    (
        "factorial",
        "factorial(n) for n >= 0",
        "assert factorial(0) == 1\nassert factorial(5) == 120",
    ),
    (
        "fib",
        "fib(n), the n-th Fibonacci number with fib(0) == 0 and fib(1) == 1",
        "assert fib(0) == 0\nassert fib(10) == 55",
    ),
    (
        "count_vowels",
        "count_vowels(s) counting a, e, i, o, u in s",
        "assert count_vowels('banana') == 3\nassert count_vowels('xyz') == 0",
    ),
    (
        "maximum",
        "maximum(xs) returning the largest item of a non-empty list",
        "assert maximum([3, 9, 2]) == 9\nassert maximum([-5]) == -5",
    ),
    (
        "fizzbuzz",
        "fizzbuzz(n) returning 'Fizz', 'Buzz', 'FizzBuzz' or str(n)",
        "assert fizzbuzz(3) == 'Fizz'\nassert fizzbuzz(10) == 'Buzz'\n"
        "assert fizzbuzz(15) == 'FizzBuzz'\nassert fizzbuzz(7) == '7'",
    ),
]
_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text


@register("python_tests")
class PythonTests(Env):
    _settings: EnvGatewaySettings | None = None
    _sandbox: Sandbox | None = None  # one runner per gateway process, made on first use

    @classmethod
    def configure(cls, settings: EnvGatewaySettings) -> None:
        """The sandbox backend of the settings; work dirs under the gateway's state dir."""
        cls._settings, cls._sandbox = settings, None

    @classmethod
    def sandbox(cls) -> Sandbox:
        if cls._sandbox is None:
            settings = cls._settings or EnvGatewaySettings()
            cls._sandbox = Sandbox(
                settings.state_dir / "sandbox",
                backend=settings.env_sandbox,
                image=settings.env_sandbox_image,
                max_concurrent=settings.env_sandbox_max_concurrent,
            )
        return cls._sandbox

    @classmethod
    def sample_tasks(
        cls, num_tasks: int, seed: int, split: str, options: dict[str, Any]
    ) -> list[dict[str, Any]]:
        rng = random.Random(f"python-{split}-{seed}")
        picks = [rng.choice(PROBLEMS) for _ in range(num_tasks)]
        return [
            {"entry_point": name, "prompt": f"Write a Python function {spec}.", "tests": tests}
            for name, spec, tests in picks
        ]

    async def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        if not all(isinstance(task.get(k), str) for k in ("prompt", "tests")):
            raise EnvError("python_tests task needs 'prompt' and 'tests' strings")
        self.task = task
        timeout_s = option(self.options, "timeout_s", 10.0, 0.1, MAX_TIMEOUT_S)
        self.limits = Limits(wall_seconds=timeout_s)
        return [Message("user", task["prompt"] + " Reply with the code in a ```python block.")]

    async def step(self, action: Action) -> StepResult:
        code, tests = extract_code(action.text), self.task["tests"]
        result = await self.sandbox().run_tests(code, tests, limits=self.limits)
        info = {
            "sandbox": result.status,
            "exit_code": result.exit_code,
            "stderr": result.stderr[-2000:],
            "network_isolated": result.network_isolated,
            "backend": result.backend,
            "verdict": result.verdict,
            "error": result.stdout[-2000:],
        }
        if result.infrastructure_error:
            return StepResult(
                [], done=True, info=info, status="sandbox_error", error=result.stderr[-500:]
            )
        passed = result.status == "ok" and result.verdict == "pass"
        return StepResult([], done=True, reward=float(passed), info=info)
