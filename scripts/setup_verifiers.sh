#!/usr/bin/env bash
# Build the verifiers 0.4 virtualenv (.venv-verifiers): verifiers 0.4 pins openai<3 and
# mcp==2.0.0, which .venv cannot hold beside the OpenAI Agents SDK (openai 3), so the
# env-gateway's `verifiers-v1` env runs its workers here (TREADLE_ENV_VERIFIERS_PYTHON=
# .venv-verifiers/bin/python), with the example tasksets (examples/verifiers/vf1-tiny).
# Environments for verifiers 0.4 are installed into it the same way (pip install ...).
# Idempotent: reruns only when the specs, the lock or the example package change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VERIFIERS_VENV:-.venv-verifiers}
# the default spec installs from requirements/verifiers.txt (hashes; `make lock`); another
# (or TREADLE_UNLOCKED=1, `make lock`) resolves unpinned
LOCK=requirements/verifiers.txt
[[ -n "${VERIFIERS_SPEC:-}${TREADLE_UNLOCKED:-}" || ! -f "$LOCK" ]] && LOCK=
VERIFIERS_SPEC=${VERIFIERS_SPEC:-verifiers==0.4.0}
EXAMPLE=examples/verifiers/vf1-tiny
key="$VERIFIERS_SPEC|${LOCK:+$(sha256sum "$LOCK" | cut -c1-16)}|$(find "$EXAMPLE" -name '*.py' -o -name pyproject.toml | sort | xargs cat | sha256sum | cut -c1-16)"
stamp="$VENV/.treadle-installed"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; then
  exit 0
fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
if [[ -n "$LOCK" ]]; then  # every package pinned with its hashes; ours without resolving
  "${pip[@]}" install --quiet --require-hashes --no-deps -r "$LOCK"
  "${pip[@]}" install --quiet --no-deps --no-build-isolation -e "$EXAMPLE"
  "${pip[@]}" check
else
  "${pip[@]}" install --quiet --upgrade pip
  "${pip[@]}" install --quiet "$VERIFIERS_SPEC" hatchling editables
  "${pip[@]}" install --quiet -e "$EXAMPLE"
fi
"$VENV/bin/python" -c "import verifiers.v1, vf1_tiny_arith, vf1_tiny_calc, vf1_tiny_guess" >/dev/null
echo "$key" > "$stamp"
