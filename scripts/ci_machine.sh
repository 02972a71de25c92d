#!/usr/bin/env bash
# Prepare a Debian CI machine (root): docker.io, bubblewrap and debootstrap from apt; start
# dockerd (without iptables: this machine's network is managed outside) unless an engine
# already answers; build the local Python base image for the sandbox and the compose smoke.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "ci_machine: not root or no apt-get; skipping" >&2
  exit 1
fi
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
fi
if ! docker info >/dev/null 2>&1; then
  mkdir -p .treadle
  nohup dockerd --iptables=false </dev/null >.treadle/dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 .treadle/dockerd.log >&2; exit 1; }
fi
docker image inspect python:3.11-slim-bookworm >/dev/null 2>&1 \
  || docker pull -q python:3.11-slim-bookworm >/dev/null 2>&1 \
  || scripts/docker_base.sh >/dev/null
