#!/usr/bin/env bash
# Install everything aiturbofs and its tests need on a fresh Debian 12 host
# (run as root).  Idempotent.  Usage: bash scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
pkgs=(libfuse3-dev fuse3 attr pkg-config)
if [ "${1:-}" = "--test" ]; then
    pkgs+=(fio rsync postgresql)
fi
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [ "${1:-}" = "--test" ]; then
    python3 -m pip install -q --disable-pip-version-check -e '.[test]'
else
    python3 -m pip install -q --disable-pip-version-check -e .
fi
# mount(8) and fstab look for the helper in /sbin
scripts_dir=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
ln -sf "$scripts_dir/mount.aiturbo" /sbin/mount.aiturbo
ln -sf "$scripts_dir/aiturbo" /usr/local/bin/aiturbo 2>/dev/null || true
