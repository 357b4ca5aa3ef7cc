#!/usr/bin/env python3
"""Grouped write on a 3-node cluster over loopback: dedup + plan vs plain replicated write-back.

    python benchmarks/cluster_bench.py [--size-mib 64] [--repeat 1]

Starts PostgreSQL, moto S3 (behind a byte-counting proxy), ``aiturbo
controller`` and three node daemons (tests/cluster.py) and runs two scenarios
of the paper, each in two modes side by side in one cluster:

* **DP replicas** — three ranks (one per node) write byte-identical files at
  once;
* **rank-0 writer** — one node writes one file.

Modes: ``plain`` (an untagged directory: each file is replicated and
persisted by its writer, every byte uploaded) and ``grouped`` (a directory
tagged ``user.aiturbo.group`` with ``group.size`` set: the controller dedups
the round and the LP plan spreads the uploads).  For each run: close() time
of the slowest writer, time from the first close to every file durable,
bytes the S3 server received (proxy count, requests included) against the
unique bytes, which node uploaded what, and for grouped runs the plan's LP
lower bound and makespan (computed with the nodes' ``snic_gbps``, set here
to ``--snic-gbps``, and ``--backend-gbps``: compare the bound with the
measured persist time only as far as moto's ~180 MiB/s allows).
Results: benchmarks/results/cluster-<time>.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402
from cluster import Cluster  # noqa: E402  (tests/ is on sys.path via _harness)
from pgserver import PgServer  # noqa: E402
from s3server import S3Server  # noqa: E402

MiB = 1 << 20
DURABLE_TIMEOUT_S = 600.0


def write_file(path: str, data: bytes, out: dict) -> None:
    t0 = time.monotonic()
    with open(path, "wb", buffering=0) as f:
        view = memoryview(data)
        for off in range(0, len(data), MiB):
            f.write(view[off : off + MiB])
    out[path] = time.monotonic() - t0  # open + writes + close()


def run(cluster: Cluster, scenario: str, mode: str, size: int, step: int) -> dict:
    writers = [0, 1, 2] if scenario == "dp" else [0]
    d = f"{scenario}-{mode}-{step}"
    os.mkdir(cluster.path(0, d))
    if mode == "grouped":
        os.setxattr(cluster.path(0, d), "user.aiturbo.group", f"{scenario}{step}".encode())
        os.setxattr(cluster.path(0, d), "user.aiturbo.group.size", str(len(writers)).encode())
    time.sleep(1.1)  # the other nodes' kernels see the new directory (attribute timeout)
    data = os.urandom(size)
    before_up = cluster.bytes_uploaded()
    before_s3 = cluster.s3_received_bytes()
    closes: dict = {}
    paths = [cluster.path(i, d, f"rank{i}.bin") for i in writers]
    threads = [threading.Thread(target=write_file, args=(p, data, closes)) for p in paths]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrote_s = time.monotonic() - t0
    durable_s = h.wait_durable(paths, DURABLE_TIMEOUT_S) + wrote_s
    after_up = cluster.bytes_uploaded()
    plan = cluster.status(writers[0])["cluster"]["last_plan"] if mode == "grouped" else None
    for i, p in zip(writers, paths):
        with open(cluster.path((i + 1) % 3, d, f"rank{i}.bin"), "rb") as f:
            assert f.read() == data, f"{p} read back wrong from another node"
    return {
        "scenario": scenario, "mode": mode, "files": len(writers), "file_bytes": size,
        "unique_bytes": size, "written_bytes": size * len(writers),
        "close_s": max(closes.values()), "durable_s": durable_s,
        "s3_received_bytes": cluster.s3_received_bytes() - before_s3,
        "uploaded_by_node": {n: after_up[n] - before_up.get(n, 0) for n in after_up},
        "lp_bound_s": plan and plan["lp_bound_s"], "makespan_s": plan and plan["makespan_s"],
        "plan_s": plan and plan["plan_s"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=64, help="bytes per file (default 64 MiB)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--snic-gbps", type=float, default=1.0, help="nodes' snic_gbps for the planner (default 1)")
    ap.add_argument("--backend-gbps", type=float, default=1.5, help="controller's backend cap (default 1.5 ~ moto)")
    args = ap.parse_args()
    h.sigterm_as_interrupt()
    root = h.temp_dir("aiturbo-cluster-bench-")
    results = []
    with PgServer() as pg, S3Server() as s3, Cluster(
        root, pg=pg, s3=s3, node_options={"snic_gbps": str(args.snic_gbps)}, backend_gbps=args.backend_gbps,
    ) as cluster:
        for step in range(args.repeat):
            for scenario in ("dp", "rank0"):
                for mode in ("plain", "grouped"):
                    r = run(cluster, scenario, mode, args.size_mib * MiB, step)
                    results.append(r)
                    print(f"{scenario:6} {mode:8} close {r['close_s']:.2f} s, durable {r['durable_s']:.2f} s, "
                          f"S3 got {r['s3_received_bytes'] / MiB:.1f} MiB for {r['unique_bytes'] / MiB:.0f} MiB unique, "
                          f"uploads {({n: round(b / MiB, 1) for n, b in r['uploaded_by_node'].items()})}", flush=True)
    h.remove_tree(root)
    rows = []
    for r in results:
        rows.append([
            r["scenario"], r["mode"], f"{r['close_s']:.2f}", f"{r['durable_s']:.2f}",
            f"{r['s3_received_bytes'] / r['unique_bytes']:.2f}",
            " ".join(f"{n}:{b / MiB:.0f}" for n, b in sorted(r["uploaded_by_node"].items())),
            f"{r['lp_bound_s']:.3f}" if r["lp_bound_s"] is not None else "-",
            f"{r['makespan_s']:.3f}" if r["makespan_s"] is not None else "-",
            f"{r['plan_s'] * 1000:.0f}" if r["plan_s"] is not None else "-",
        ])
    table = h.markdown_table(
        ["scenario", "mode", "close s", "durable s", "S3 bytes / unique", "MiB uploaded per node", "LP bound s", "plan makespan s", "plan ms"],
        rows,
    )
    for scenario in ("dp", "rank0"):
        med = {
            mode: {k: h.median([r[k] for r in results if r["scenario"] == scenario and r["mode"] == mode])
                   for k in ("durable_s", "s3_received_bytes")}
            for mode in ("plain", "grouped")
        }
        table += (f"\n{scenario} (medians): plain/grouped durable time {med['plain']['durable_s'] / med['grouped']['durable_s']:.2f}x, "
                  f"bytes at S3 {med['plain']['s3_received_bytes'] / max(1, med['grouped']['s3_received_bytes']):.2f}x\n")
    print(table)
    md, js = h.save_results("cluster", table, {"args": vars(args), "machine": h.machine_info(), "runs": results})
    print(f"results: {md} {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
