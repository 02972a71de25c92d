"""Run pytest, handling exit code 5 ("no tests collected").

With a marker selection (`-m gpu` on a machine without GPU tests selected, say) an empty
selection is fine and exits 0; without one, collecting nothing means the suite is broken.
"""

import sys

import pytest


def main() -> int:
    args = sys.argv[1:]
    code = pytest.main(args)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        selected = "-m" in args or "-k" in args
        where = " for this selection" if selected else ""
        print(f"pytest collected no tests{where}", file=sys.stderr)
        code = 0 if selected else 1
    return int(code)


# guarded: vLLM starts its engine with multiprocessing `spawn`, which re-imports __main__
if __name__ == "__main__":
    sys.exit(main())
