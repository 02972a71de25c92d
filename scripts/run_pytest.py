"""Run pytest, handling exit code 5 ("no tests collected").

With a marker selection (`-m gpu` on a machine without GPU tests selected, say) an empty
selection is fine and exits 0; without one, collecting nothing means the suite is broken.
"""

import sys

import pytest

args = sys.argv[1:]
code = pytest.main(args)
if code == pytest.ExitCode.NO_TESTS_COLLECTED:
    selected = "-m" in args or "-k" in args
    print(f"pytest collected no tests{' for this selection' if selected else ''}", file=sys.stderr)
    code = 0 if selected else 1
sys.exit(int(code))
