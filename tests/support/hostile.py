"""Hostile programs for the sandbox under siege (`tests/integration/test_sandbox_stress.py`
and the compose smoke's container check): each within the per-process limits, together past
the box's, the host's or the protocol's."""

BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
HOSTILE = {
    # four processes of 400 MiB: each under its own rlimit, together past the box's memory
    "memory": "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
    "        hog = bytearray(400 * 2**20)\n        time.sleep(3)\n        os._exit(0)\n"
    "os.wait()\n",
    "pids": BOMB,
    # 128 MiB on the solution's channel, no line end
    "flood": "import os\nchunk = b'x' * 2**20\nfor _ in range(128):\n    os.write(3, chunk)\n",
    "disk": "for n in range(40):\n    with open(f'f{n}', 'wb') as f:\n"
    "        f.write(b'x' * 8 * 2**20)\n",
}
ENDINGS = {"failed", "timeout", "memory", "crash"}
"""How a hostile run may end: the code's failure or a limit, never `sandbox_error`."""
RIGHT = "def add(a, b):\n    return a + b\n"
TASK = {"prompt": "Write add(a, b).", "tests": "assert add(1, 2) == 3\n", "entry_point": "add"}
