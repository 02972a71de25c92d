"""The tests side of a test run, inside its own sandbox: run the task's tests against the
solution, which lives in another sandbox and is reached only through calls.

    python -I harness.py          (tests.py and entry_points.json beside it)

Each name in entry_points.json is bound to a proxy: calling it writes `{"call": NAME,
"args": REPR}` on stdout and reads the answer on stdin (the runner relays both to the
solution's sandbox); a value comes back through `ast.literal_eval`, an error is raised as
`SolutionError`. When the tests finish, the last line is `{"verdict": "pass"}` or
`{"verdict": "fail", "error": ...}`. The solution's code never runs in this process, so it
cannot print, exit or patch its way to a pass.
"""

import ast
import json
import os
import runpy
import sys


class SolutionError(Exception):
    """The solution raised (or could not answer) a call."""


def main() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the tests' own prints go to stderr
    sys.stdout = sys.stderr
    replies = sys.stdin

    def proxy(name):
        def call(*args):
            channel.write(json.dumps({"call": name, "args": repr(args)}) + "\n")
            line = replies.readline()
            if not line:
                raise SolutionError("the solution stopped answering")
            reply = json.loads(line)
            if "error" in reply:
                raise SolutionError(reply["error"])
            return ast.literal_eval(reply["value"])

        call.__name__ = name
        return call

    with open("entry_points.json") as names:
        namespace = {"SolutionError": SolutionError}
        namespace.update({name: proxy(name) for name in json.load(names)})
    try:
        runpy.run_path("tests.py", init_globals=namespace, run_name="tests")
    except BaseException as exc:  # noqa: BLE001 - a failed test, whatever it raised
        verdict = {"verdict": "fail", "error": f"{type(exc).__name__}: {exc}"[:2000]}
    else:
        verdict = {"verdict": "pass"}
    channel.write(json.dumps(verdict) + "\n")


if __name__ == "__main__":
    main()
