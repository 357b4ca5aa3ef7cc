#!/usr/bin/env bash
# Install everything aiturbofs and its tests need on a fresh Debian 12 host
# (run as root).  Idempotent.  Usage: bash scripts/setup.sh [--test|--bench]
# --bench: what --test installs, plus what the benchmarks need (benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
pkgs=(libfuse3-dev fuse3 attr pkg-config)
if [ "${1:-}" = "--test" ] || [ "${1:-}" = "--bench" ]; then
    pkgs+=(fio rsync postgresql)
fi
if [ "${1:-}" = "--bench" ]; then
    # the testbed's links (ip, tc, nsenter, curl) and its external baselines: rclone mount, s3fs-fuse
    pkgs+=(iproute2 util-linux curl rclone s3fs)
fi
# The RDMA fabric (docs/rdma.md) needs pyverbs: on hosts with an RDMA device, and
# for the tests (which check that it loads, and skip the hardware runs without a device).
if [ "${1:-}" = "--test" ] || [ "${1:-}" = "--bench" ] || [ -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
    pkgs+=(python3-pyverbs)
fi
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [ "${1:-}" = "--test" ]; then
    python3 -m pip install -q --disable-pip-version-check -e '.[test]'
elif [ "${1:-}" = "--bench" ]; then
    python3 -m pip install -q --disable-pip-version-check -e '.[test,bench]'
else
    python3 -m pip install -q --disable-pip-version-check -e .
fi
# Debian builds pyverbs for its own python3; lend it to the python3 running aiturbofs when
# that is another build of the same version (PyPI's pyverbs wants a libibverbs of its own
# rdma-core release, which Debian 12 does not have).
if dpkg -s python3-pyverbs >/dev/null 2>&1 && ! python3 -c 'import pyverbs.device' 2>/dev/null; then
    platlib=$(python3 -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
    suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    if ls /usr/lib/python3/dist-packages/pyverbs/*"$suffix" >/dev/null 2>&1 \
        && { [ ! -e "$platlib/pyverbs" ] || [ -L "$platlib/pyverbs" ]; }; then
        ln -sfn /usr/lib/python3/dist-packages/pyverbs "$platlib/pyverbs"
    fi
fi
# mount(8) and fstab look for the helper in /sbin
scripts_dir=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
ln -sf "$scripts_dir/mount.aiturbo" /sbin/mount.aiturbo
ln -sf "$scripts_dir/aiturbo" /usr/local/bin/aiturbo 2>/dev/null || true
