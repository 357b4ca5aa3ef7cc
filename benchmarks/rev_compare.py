#!/usr/bin/env python3
"""This checkout against another git revision, side by side in one run: write speed, close(), daemon CPU.

    python benchmarks/rev_compare.py REV [--size-mib 1024] [--repeat 5] [--dram 6G]

Makes a git worktree of ``REV`` (removed afterwards) and, for each
repetition, mounts each tree in turn (``mount.aiturbo -f`` from that tree,
file:// backend in a temp dir, the same options) and writes one file of
``--size-mib`` with:

* ``py O_WRONLY`` — 1 MiB ``pwrite`` calls from a Python process that opened
  the file O_WRONLY, as torch.save and safetensors do (the direct_io path);
  ``close()`` is timed on its own;
* ``fio write``  — fio psync sequential 1 MiB writes (O_RDWR: the page cache
  path).

It reports MiB/s, close() seconds and the daemon's CPU seconds per GiB from
open() until close() returned (user and system), the median over
``--repeat``, and the ratio this checkout / REV.  The trees alternate in an
order that rotates each repetition, and each file is durable (not timed)
before the next mount starts.  Results: benchmarks/results/rev-<time>.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402
import fio_bench as fb  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
DURABLE_TIMEOUT_S = 600.0


def _fio(directory: str, size: int, pid: int) -> dict:
    u0, s0 = h.cpu_times(pid)
    r = fb.run_fio(directory, "write", MiB, 1, size)
    u1, s1 = h.cpu_times(pid)
    return {"mib_s": r["mib_s"], "close_s": float("nan"), "user_s": u1 - u0, "sys_s": s1 - s0}


WORKLOADS = {"py O_WRONLY": h.py_wronly, "fio write": _fio}


def run_one(tree: str, workload: str, size: int, dram: str) -> dict:
    tmp = h.temp_dir("aiturbo-rev-")
    try:
        backend, mnt = os.path.join(tmp, "backend"), os.path.join(tmp, "mnt")
        os.makedirs(backend)
        os.makedirs(mnt)
        m = h.start_aiturbofs(f"file://{backend}", mnt, os.path.join(tmp, "state"), {"dram": dram},
                              env={"PYTHONPATH": tree})
        try:
            target = os.path.join(mnt, "bench.0.0") if workload == "py O_WRONLY" else mnt
            r = WORKLOADS[workload](target, size, m.proc.pid)
            h.wait_durable([os.path.join(mnt, n) for n in os.listdir(mnt)], DURABLE_TIMEOUT_S)
            return r
        finally:
            h.stop_aiturbofs(m)
    finally:
        h.remove_tree(tmp)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the git revision to compare this checkout with (e.g. origin/main, HEAD~3)")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dram", default="6G", help="-o dram= of both mounts (default 6G)")
    a = p.parse_args(argv)
    h.sigterm_as_interrupt()
    size = a.size_mib * MiB
    with ExitStack() as stack:
        other = h.temp_dir("aiturbo-rev-tree-")
        os.rmdir(other)
        subprocess.run(["git", "-C", h.REPO, "worktree", "add", "-q", "--detach", other, a.rev], check=True)
        stack.callback(subprocess.run, ["git", "-C", h.REPO, "worktree", "remove", "--force", other], check=False)
        trees = {"this": h.REPO, a.rev: other}
        names = list(trees)
        results: dict[tuple[str, str], list[dict]] = {}
        for rep in range(a.repeat):
            for workload in WORKLOADS:
                for name in names[rep % 2:] + names[: rep % 2]:
                    r = run_one(trees[name], workload, size, a.dram)
                    results.setdefault((workload, name), []).append(r)
                    print(f"rep {rep} {workload:12} {name:12} {r['mib_s']:7.0f} MiB/s close {r['close_s']:.3f} s "
                          f"daemon user {r['user_s']:.2f} s sys {r['sys_s']:.2f} s", flush=True)
        gib = size / GiB
        rows, data = [], {}
        for workload in WORKLOADS:
            med = {n: {k: h.median([r[k] for r in results[(workload, n)]]) for k in ("mib_s", "close_s", "user_s", "sys_s")}
                   for n in names}
            for n in names:
                m = med[n]
                rows.append([workload, n, f"{m['mib_s']:.0f}", "-" if m["close_s"] != m["close_s"] else f"{m['close_s']:.3f}",
                             f"{(m['user_s'] + m['sys_s']) / gib:.2f} ({m['user_s'] / gib:.2f} + {m['sys_s'] / gib:.2f})"])
            ratio = med["this"]["mib_s"] / med[a.rev]["mib_s"]
            rows.append([workload, f"this / {a.rev}", f"{ratio:.2f}x", "", ""])
            data[workload] = {"median": med, "runs": {n: results[(workload, n)] for n in names}}
        table = h.markdown_table(["workload", "tree", "MiB/s", "close s", "daemon CPU s/GiB (user + sys)"], rows)
        print(f"\n{a.size_mib} MiB, median of {a.repeat}, dram={a.dram}\n\n{table}")
        md, js = h.save_results("rev", table, {"rev": a.rev, "size_mib": a.size_mib, "repeat": a.repeat, **data})
        print(f"\nsaved {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
