#!/usr/bin/env python3
"""Grouped read on a 3-node cluster over loopback: N nodes loading one model file from cold pools.

    python benchmarks/read_bench.py [--size-mib 128] [--repeat 1] [--keep]

Starts PostgreSQL, moto S3 (behind a byte-counting proxy), ``aiturbo
controller`` and three node daemons (tests/cluster.py), writes one model file
of ``--size-mib`` and waits until it is durable.  Then, per run, a fresh
directory gets a copy of it made inside the mount (``cp`` on node 0; durable
before anything is measured), every node's pool is emptied (replicas released,
then ``aiturbo drop-cache``), and N nodes read the copy in full at once:

* ``plain`` N = 3 — an untagged directory: each reader takes each chunk from
  the file's holders' DRAM if they have it by then, else from storage;
* ``grouped`` N = 1, 2, 3 — the directory is tagged ``user.aiturbo.group``
  with ``group.size`` = N: the controller's read round gives each chunk one
  storage fetch (spread over the readers) and a chain of the other readers.

A fresh copy per run, not a hard link: a node joins a file's read round once
per (inode, version), and tags belong to the inode.  The copy is written into
a directory tagged with the group only (no size: its one-writer round closes
after the batching window; its chunks are already durable, so the backend
copies them server side); ``group.size`` is set on the directory and the copy
once it is durable.

For each run: wall time from the readers' common start until the last one
finished (each checks its sha256), the bytes S3 sent through the proxy
(GET bodies and headers) against the file size, and each node's
``persist.bytes_fetched`` (what it read from the backend) next to what the
read plan gave it (``last_read_plan.fetch_bytes``), and ``chunks_from_chain``.  Moto on loopback (~180 MiB/s on these 2-core VMs)
is the S-NIC of every node at once, so grouped reads gain in bytes at the
backend far more than in time here.
Results: benchmarks/results/read-<time>.{md,json}.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402
from cluster import Cluster  # noqa: E402  (tests/ is on sys.path via _harness)
from pgserver import PgServer  # noqa: E402
from s3server import S3Server  # noqa: E402

from aiturbofs._limits import CLUSTER_CHAIN_LINGER_S  # noqa: E402

MiB = 1 << 20
DURABLE_TIMEOUT_S = 600.0
SETTLE_TIMEOUT_S = 60.0  # replicas are released by a 1 s housekeeping pass once a file is durable
READ_TIMEOUT_S = 600.0
GROUP = "user.aiturbo.group"
GROUP_SIZE = "user.aiturbo.group.size"
# The plain run goes first: a node's read chain is keyed by chunk hash and lingers
# CLUSTER_CHAIN_LINGER_S after its round, so a plain read of a copy right after a
# grouped round of the same bytes would still be served along that round's chains.
RUNS = [("plain", 3), ("grouped", 1), ("grouped", 2), ("grouped", 3)]


def write_file(path: str, data: bytes) -> None:
    with open(path, "wb", buffering=0) as f:
        view = memoryview(data)
        for off in range(0, len(data), MiB):
            f.write(view[off: off + MiB])


def cold_pools(cluster: Cluster) -> None:
    """No node pins a chunk (replicas released), then every node's clean cache dropped."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        st = cluster.statuses()
        busy = {cluster.name(i): s["pool"]["dirty_bytes"] for i, s in st.items()
                if s["pool"]["dirty_bytes"] or s["cluster"]["replica_files_held"]}
        if not busy:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"pools still hold dirty bytes after {SETTLE_TIMEOUT_S:.0f} s: {busy}")
        time.sleep(0.2)
    cluster.drop_cache()
    left = {cluster.name(i): s["pool"]["clean_bytes"] for i, s in cluster.statuses().items()}
    if any(left.values()):
        raise RuntimeError(f"bytes left in the pools after drop-cache: {left}")


def counters(cluster: Cluster) -> dict[str, dict]:
    return {cluster.name(i): {"fetched": s["persist"]["bytes_fetched"],
                              "from_chain": s["cluster"]["chunks_from_chain"],
                              "from_peers": s["cluster"]["chunks_fetched"],
                              "read_rounds": s["cluster"]["read_rounds"]}
            for i, s in cluster.statuses().items()}


def prepare(cluster: Cluster, source: str, mode: str, n: int, step: int) -> str:
    """A durable copy of ``source`` in a fresh directory, tagged for ``n`` readers if grouped."""
    d = f"read-{mode}-{n}-{step}"
    os.mkdir(cluster.path(0, d))
    if mode == "grouped":
        os.setxattr(cluster.path(0, d), GROUP, f"load{n}-{step}".encode())
    name = f"{d}/model.bin"
    shutil.copyfile(cluster.path(0, source), cluster.path(0, name))
    h.wait_durable([cluster.path(0, name)], DURABLE_TIMEOUT_S)
    if mode == "grouped":
        for p in (cluster.path(0, d), cluster.path(0, name)):
            os.setxattr(p, GROUP_SIZE, str(n).encode())
    time.sleep(1.1)  # the other nodes' kernels see the new directory (attribute timeout)
    return name


def run(cluster: Cluster, source: str, want: str, size: int, mode: str, n: int, step: int) -> dict:
    name = prepare(cluster, source, mode, n, step)
    cold_pools(cluster)
    nodes = list(range(n))
    before, s3_before = counters(cluster), cluster.s3_sent_bytes()
    started = time.strftime("%H:%M:%S")  # to find the run in the daemons' logs (--keep)
    ends = h.read_together([cluster.path(i, name) for i in nodes], [want] * n, READ_TIMEOUT_S, f"{mode} N={n}")
    wall_s = max(ends)
    s3_sent = cluster.s3_sent_bytes() - s3_before
    after = counters(cluster)
    diff = {node: {k: v - before[node][k] for k, v in c.items()} for node, c in after.items()}
    planned = cluster.status(0)["cluster"]["last_read_plan"] if mode == "grouped" else None
    return {
        "mode": mode, "readers": n, "file_bytes": size, "started": started, "wall_s": wall_s, "s3_sent_bytes": s3_sent,
        "planned_fetch_by_node": planned and planned["fetch_bytes"],
        "fetched_by_node": {node: c["fetched"] for node, c in diff.items()},
        "from_chain_by_node": {node: c["from_chain"] for node, c in diff.items()},
        "from_peers_by_node": {node: c["from_peers"] for node, c in diff.items()},
        "read_rounds_by_node": {node: c["read_rounds"] for node, c in diff.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=128, help="model file size (default 128 MiB)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="leave the temp dir (daemon and controller logs) in place")
    args = ap.parse_args()
    h.sigterm_as_interrupt()
    root = h.temp_dir("aiturbo-read-bench-")
    size = args.size_mib * MiB
    results = []
    with PgServer() as pg, S3Server() as s3, Cluster(root, pg=pg, s3=s3) as cluster:
        data = os.urandom(size)
        want = hashlib.sha256(data).hexdigest()
        os.mkdir(cluster.path(0, "models"))
        source = "models/model.bin"
        write_file(cluster.path(0, source), data)
        h.wait_durable([cluster.path(0, source)], DURABLE_TIMEOUT_S)
        del data
        grouped_done = None  # when the last grouped readers finished
        for step in range(args.repeat):
            for mode, n in RUNS:
                if mode == "plain" and grouped_done is not None:  # let the last round's chains expire
                    time.sleep(max(0.0, grouped_done + CLUSTER_CHAIN_LINGER_S + 1.0 - time.monotonic()))
                r = run(cluster, source, want, size, mode, n, step)
                results.append(r)
                if mode == "grouped":
                    grouped_done = time.monotonic()
                print(f"{mode:7} N={n}: {r['wall_s']:.2f} s, S3 sent {r['s3_sent_bytes'] / MiB:.1f} MiB "
                      f"({r['s3_sent_bytes'] / size:.2f}x), fetched "
                      f"{({k: round(v / MiB) for k, v in r['fetched_by_node'].items()})} MiB, "
                      f"from chain {r['from_chain_by_node']}, from peers {r['from_peers_by_node']}", flush=True)
    if args.keep:
        print(f"logs kept in {root}")
    else:
        h.remove_tree(root)
    rows = []
    for r in results:
        rows.append([
            str(r["readers"]), r["mode"], f"{r['wall_s']:.2f}",
            f"{r['readers'] * r['file_bytes'] / MiB / r['wall_s']:.0f}",
            f"{r['s3_sent_bytes'] / r['file_bytes']:.2f}",
            " ".join(f"{node}:{b / MiB:.0f}" for node, b in sorted(r["fetched_by_node"].items())),
            " ".join(f"{node}:{b / MiB:.0f}" for node, b in sorted(r["planned_fetch_by_node"].items()))
            if r["planned_fetch_by_node"] else "-",
            " ".join(f"{node}:{c}" for node, c in sorted(r["from_chain_by_node"].items())),
        ])
    table = h.markdown_table(
        ["N", "mode", "time s", "MiB/s delivered", "S3 bytes / file size", "MiB fetched from storage per node",
         "MiB planned per node", "chunks from chain per node"],
        rows,
    )
    table += f"\n{args.size_mib} MiB file, pools dropped before every run; medians over {args.repeat} run(s):\n"
    for mode, n in RUNS:
        mine = [r for r in results if r["mode"] == mode and r["readers"] == n]
        table += (f"- {mode} N={n}: {h.median([r['wall_s'] for r in mine]):.2f} s, "
                  f"S3 {h.median([r['s3_sent_bytes'] / size for r in mine]):.2f}x the file\n")
    print(table)
    md, js = h.save_results("read", table, {"args": vars(args), "runs": results})
    print(f"results: {md} {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
