#!/usr/bin/env bash
# Install aiturbofs and what it needs on a Debian 12 host (run as root).  Idempotent.
#
#   bash scripts/setup.sh             the single-node install: mount.aiturbo with SQLite metadata
#   bash scripts/setup.sh --cluster   plus the cluster extra (LP planner, PostgreSQL metadata)
#   bash scripts/setup.sh --test      plus what the tests need (fio, PostgreSQL, pyverbs, test extra)
#   bash scripts/setup.sh --bench     plus what the benchmarks need (benchmarks/README.md)
#
# The project goes into its own virtual environment, $AITURBOFS_VENV (default
# /opt/aiturbofs), so pip resolves current releases and nothing depends on the
# packages of the system Python.  mount.aiturbo is linked into /sbin (mount(8)
# and fstab look there) and aiturbo into /usr/local/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in
    ""|--cluster|--test|--bench) ;;
    *) echo "usage: bash scripts/setup.sh [--cluster|--test|--bench]" >&2; exit 2 ;;
esac
venv="${AITURBOFS_VENV:-/opt/aiturbofs}"
export DEBIAN_FRONTEND=noninteractive

# --- Debian packages ------------------------------------------------------------------
pkgs=(libfuse3-dev fuse3 attr pkg-config python3-venv)
if [ "$mode" = "--test" ] || [ "$mode" = "--bench" ]; then
    # gcc and linux-libc-dev: tests/fuse/test_fuse_abi.py checks the protocol layouts against <linux/fuse.h>
    pkgs+=(fio rsync postgresql gcc linux-libc-dev)
fi
if [ "$mode" = "--bench" ]; then
    # the testbed's links (ip, tc, nsenter, curl) and its external baselines: rclone mount, s3fs-fuse
    pkgs+=(iproute2 util-linux curl rclone s3fs)
fi
# The RDMA fabric (docs/rdma.md) needs pyverbs: on hosts with an RDMA device, and
# for the tests (which check that it loads, and skip the hardware runs without a device).
if [ "$mode" = "--test" ] || [ "$mode" = "--bench" ] || [ -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
    pkgs+=(python3-pyverbs)
fi
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- the virtual environment ----------------------------------------------------------
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# An old pip (Debian's, or the image's) backtracks for many minutes over the
# botocore versions that aiobotocore pins; a current one resolves in seconds.
"${pip[@]}" -U pip
case "$mode" in
    --test) "${pip[@]}" -e '.[test]' ;;
    --bench) "${pip[@]}" -e '.[test,bench]' ;;
    --cluster) "${pip[@]}" '.[cluster]' ;;
    *) "${pip[@]}" . ;;
esac

# Debian builds pyverbs for its own python3; lend it to the venv's python when that
# is another build of the same version (PyPI's pyverbs wants a libibverbs of its own
# rdma-core release, which Debian 12 does not have).
py="$venv/bin/python"
if dpkg -s python3-pyverbs >/dev/null 2>&1 && ! "$py" -c 'import pyverbs.device' 2>/dev/null; then
    platlib=$("$py" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
    suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    if ls /usr/lib/python3/dist-packages/pyverbs/*"$suffix" >/dev/null 2>&1 \
        && { [ ! -e "$platlib/pyverbs" ] || [ -L "$platlib/pyverbs" ]; }; then
        ln -sfn /usr/lib/python3/dist-packages/pyverbs "$platlib/pyverbs"
    fi
fi

# mount(8) and fstab look for the helper in /sbin
ln -sf "$venv/bin/mount.aiturbo" /sbin/mount.aiturbo
ln -sf "$venv/bin/aiturbo" /usr/local/bin/aiturbo
echo "aiturbofs installed in $venv ($("$py" -c 'import importlib.metadata as m; print(m.version("aiturbofs"))'))"
