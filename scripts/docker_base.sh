#!/usr/bin/env bash
# A Python base image built from Debian packages, for Docker engines that cannot pull
# python:3.11-slim-bookworm from a registry: debootstrap (minbase + python3, venv, certs)
# from the machine's own Debian mirror, then `docker import`. Idempotent; prints the name.
#   scripts/docker_base.sh [IMAGE]        (default treadle/base:bookworm; needs root)
set -euo pipefail
IMAGE=${1:-treadle/base:bookworm}
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE"
  exit 0
fi
# the first deb822 or one-line source of the machine's apt configuration
MIRROR=${DEBIAN_MIRROR:-$(grep -h -m1 -oE '^URIs: *\S+' /etc/apt/sources.list.d/*.sources 2>/dev/null \
  | head -1 | awk '{print $2}')}
MIRROR=${MIRROR:-$(grep -h -m1 -oE '^deb +\S+' /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}')}
: "${MIRROR:?no Debian mirror found in /etc/apt (set DEBIAN_MIRROR)}"
ROOTFS=$(mktemp -d)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
  bookworm "$ROOTFS" "$MIRROR" >&2
tar -C "$ROOTFS" -c . | docker import - "$IMAGE" >&2
echo "$IMAGE"
