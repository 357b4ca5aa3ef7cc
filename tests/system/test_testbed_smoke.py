"""Smoke test of the emulated-cluster benchmark (benchmarks/testbed.py).

Runs the script for real, with 2 nodes, small files and high link rates so
it is quick, and checks that it builds the namespaces, runs one tiny DP
scenario (with the s3fs-direct peer, which needs no external tool) and one
tiny model load (``load``: a model put into the bucket from outside, loaded
by 1 and 2 nodes in each mode) to the end, and tears everything down: no
namespace with the run's
prefix, no mount under its directory, no registry entry left.  Skipped when
not root, when PostgreSQL or moto is missing, or when this machine does not
allow ``ip netns add`` (many CI containers do not).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time

import pytest
from mounting import REPO

TESTBED = os.path.join(REPO, "benchmarks", "testbed.py")
SMOKE_TIMEOUT_S = 300.0  # a hang guard: the run takes ~90 s on a quiet 2-core host (5 clusters: write-through, LP, dedup, 2 for load)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, FUSE mounts)"
    for tool in ("ip", "nsenter", "tc", "fusermount3", "curl"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    if not os.access("/usr/lib/postgresql/15/bin/pg_ctl", os.X_OK):
        return "PostgreSQL 15 not installed (apt-get install postgresql)"
    probe = f"atb-probe{secrets.token_hex(3)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return f"`ip netns add` not permitted here: {r.stderr.strip()}"
    try:
        for cmd in (["ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                    ["tc", "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1mbit", "burst", "32kbit", "latency", "50ms"]):
            r = subprocess.run(["ip", "netns", "exec", probe, *cmd], capture_output=True, text=True, check=False)
            if r.returncode != 0:
                return f"`{' '.join(cmd[:3])}` not permitted in a namespace here: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _leftovers(run_id: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    left = [line.split()[0] for line in ns.splitlines() if line.startswith(f"atb-{run_id}-")]
    with open("/proc/self/mountinfo") as f:
        left += [line.split()[4] for line in f if f"/tmp/atb-{run_id}" in line.split()[4]]
    if os.path.exists(f"/tmp/atb-{run_id}"):
        left.append(f"/tmp/atb-{run_id}")
    if os.path.exists(f"/run/aiturbo-testbed/{run_id}.json"):
        left.append(f"/run/aiturbo-testbed/{run_id}.json")
    return left


@pytest.mark.fuse
@pytest.mark.root("network namespaces, tc")
@pytest.mark.cluster
@pytest.mark.slow
def test_testbed_smoke_builds_runs_and_tears_down():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    run_id = f"t{secrets.token_hex(2)}"
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, TESTBED, "--nodes", "2", "--scenario", "dp,load", "--size-mib", "8", "--shard-mib", "8",
             "--fabric-mbit", "4000", "--storage-mbit", "2000", "--backend-mbit", "4000",
             "--check-s", "0.5", "--peers", "s3fs-direct", "--run-id", run_id],
            capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, cwd=REPO, check=False,
        )
    finally:
        left = _leftovers(run_id)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert not left, f"teardown left {left}\n{out[-3000:]}"
    assert f"testbed {run_id}: torn down" in p.stdout
    for mode in ("sync_close", "plain", "grouped", "s3fs-direct"):
        assert f"| {mode} |" in p.stdout, out[-3000:]
    assert "vs peers (peer time / aiturbofs grouped time): close-return s3fs-direct" in p.stdout, out[-3000:]
    for row in ("| plain | cold | 1 |", "| plain | cold | 2 |", "| tagged | cold | 2 |", "| tagged | warm | 2 |"):
        assert row in p.stdout, out[-3000:]  # a load row: every node loaded the model and its checksums matched
    assert "| autogroup | warm | 2 |" in p.stdout or "autogroup: not run:" in p.stdout, out[-3000:]
    assert "- storage/model <= 1.05" in p.stdout, out[-3000:]
    assert "fabric n0->n1" in p.stdout and "backend all 2->s3" in p.stdout
    assert time.monotonic() - t0 < SMOKE_TIMEOUT_S


def test_testbed_preflight_refuses_non_root(monkeypatch):
    """Not root: a clear error before anything is built (what main() prints, exit code 2)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import _netns

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(_netns.TestbedError, match="must run as root"):
        _netns.preflight("atb-never-made")


def test_testbed_scenario_flag_takes_a_list_or_all():
    """``--scenario`` is dp by default, takes a comma list (run in a fixed order) or ``all``, refuses typos."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import testbed

    assert testbed.parse_args([]).scenario == ["dp"]
    assert testbed.parse_args(["--scenario", "read,dp"]).scenario == ["dp", "read"]
    assert testbed.parse_args(["--scenario", "load,kv"]).scenario == ["kv", "load"]
    assert testbed.parse_args(["--scenario", "all"]).scenario == list(testbed.SCENARIOS)
    with pytest.raises(SystemExit):
        testbed.parse_args(["--scenario", "dp,shraded"])
    assert testbed.reader_counts(4) == [1, 2, 4] and testbed.reader_counts(6) == [1, 2, 4, 6]


def test_testbed_peers_flag_and_charts(tmp_path):
    """``--peers`` takes a comma list, ``all`` or ``none`` and refuses typos; a failed mode is a gap in the chart."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import _charts
    import testbed

    assert testbed.parse_args([]).peers == []
    assert testbed.parse_args(["--peers", "s3fs-direct,rclone"]).peers == ["rclone", "s3fs-direct"]
    assert testbed.parse_args(["--peers", "all"]).peers == ["rclone", "s3fs-fuse", "s3fs-direct"]
    with pytest.raises(SystemExit):
        testbed.parse_args(["--peers", "rclone,s3fs"])
    if not _charts.available():
        pytest.skip("matplotlib not installed (pip install -e .[bench])")
    rows = [{"mode": "grouped", "close_s": 0.2, "durable_s": 3.0}, {"mode": "rclone", "close_s": 0.1, "durable_s": 9.0},
            {"mode": "s3fs-fuse", "error": "mount failed"}]
    paths = _charts.save_all(str(tmp_path / "run"), {"dp": rows, "read": []}, {})
    assert paths == [str(tmp_path / "run-dp.png")]
    with open(paths[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_load_model_is_a_sharded_safetensors_directory_and_modes_map_to_options(tmp_path):
    """The load scenario's model: >= 2 shards, an index naming every tensor, loadable as a framework loads it;
    each mode's mount options in one table, and a daemon without -o autogroup skips only the mode that needs it."""
    pytest.importorskip("safetensors")
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import _load
    import _load_reader

    expected = _load.build_model(str(tmp_path), 2 << 20, 1 << 20, seed=1)
    assert expected["shards"] >= 2 and set(_load.JSON_FILES) <= set(expected["files"])
    sums, texts, _first_byte_s, total = _load_reader.load(str(tmp_path))
    assert sums == expected["tensors"] and total > 1 << 20
    assert len(_load.model_plan(64 << 20, 16 << 20)["shards"]) == 4
    assert _load.daemon_options("plain", None) == {"autogroup": "off"}
    assert _load.daemon_options("autogroup", None) == {"autogroup": "on"}
    assert _load.daemon_options("tagged", "unknown mount option 'autogroup'") == {}
    assert _load.daemon_options("autogroup", "unknown mount option 'autogroup'") is None
