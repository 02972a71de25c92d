"""The solution side of a test run, inside its own sandbox: load the model's code, then
answer calls to its functions.

    python -I server.py          (solution.py beside it)

Protocol, one JSON object per line: the process writes `{"ready": true}` once the code is
loaded (or `{"load_error": "..."}`), then reads `{"call": NAME, "args": REPR}` and answers
`{"value": REPR}` or `{"error": "..."}`. Arguments and values cross as Python literals
(`repr` / `ast.literal_eval`): an object that is not plain data cannot come back as a value,
so a result that claims to equal everything is not a result.

The code's own `print`s go to stderr: the protocol owns stdout. Whatever this process says
concerns only its own functions' answers; the verdict is the harness's, in another sandbox.
"""

import ast
import json
import os
import runpy
import sys

MAX_VALUE_CHARS = 1_000_000


def main() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the code's prints (and any write to fd 1) land on stderr
    sys.stdout = sys.stderr
    try:
        namespace = runpy.run_path("solution.py", run_name="solution")
    except BaseException as exc:  # the code's failure to load is its answer
        channel.write(json.dumps({"load_error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    channel.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            function = namespace[request["call"]]
            args = ast.literal_eval(request["args"])
            value = repr(function(*args))
            if len(value) > MAX_VALUE_CHARS:
                raise ValueError(f"value longer than {MAX_VALUE_CHARS} characters")
            reply = {"value": value}
        except BaseException as exc:  # noqa: BLE001 - every failure is the call's answer
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        channel.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
