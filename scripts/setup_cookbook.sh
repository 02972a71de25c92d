#!/usr/bin/env bash
# Build the Tinker Cookbook virtualenv (.venv-cookbook): tinker-cookbook pins transformers
# (<= 5.5.4 in 0.5.8) below what Treadle runs, so it lives apart from .venv, as a client of a
# Treadle stack (tests/integration/test_tinker_cookbook.py runs its RL loop in it).
# tinker-cookbook 0.6.1 (the newest) needs tml-renderers>=0.4.1, which the package index this
# project installs from does not carry; 0.5.8 is the newest that installs.
# Idempotent: reruns only when the specs change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${COOKBOOK_VENV:-.venv-cookbook}
# the default specs install from requirements/cookbook.txt (hashes; `make lock`); others (or
# TREADLE_UNLOCKED=1, `make lock`) resolve unpinned
LOCK=requirements/cookbook.txt
[[ -n "${COOKBOOK_SPEC:-}${TINKER_SPEC:-}${TORCH_SPEC:-}${TREADLE_UNLOCKED:-}" || ! -f "$LOCK" ]] && LOCK=
COOKBOOK_SPEC=${COOKBOOK_SPEC:-tinker-cookbook==0.5.8}
TINKER_SPEC=${TINKER_SPEC:-tinker==0.38.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
key="$COOKBOOK_SPEC|$TINKER_SPEC|$TORCH_SPEC|${LOCK:+$(sha256sum "$LOCK" | cut -c1-16)}"
stamp="$VENV/.treadle-installed"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; then
  exit 0
fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
if [[ -n "$LOCK" ]]; then  # every package pinned with its hashes
  "${pip[@]}" install --quiet --require-hashes --no-deps -r "$LOCK"
  "${pip[@]}" check
else
  "${pip[@]}" install --quiet --upgrade pip
  "${pip[@]}" install --quiet "$TORCH_SPEC"  # first: the CPU build, kept by what follows
  "${pip[@]}" install --quiet "$TINKER_SPEC" "$COOKBOOK_SPEC"
fi
"$VENV/bin/python" -c "import tinker, tinker_cookbook.rl.train" >/dev/null
echo "$key" > "$stamp"
