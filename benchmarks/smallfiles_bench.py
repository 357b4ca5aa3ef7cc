#!/usr/bin/env python3
"""Small files: files/s closed and durable, one writer and eight, against tmpfs.

    python benchmarks/smallfiles_bench.py                       # 2,000 files of 64 KiB per run, 1 and 8 writers
    python benchmarks/smallfiles_bench.py --files 500 --repeat 1 --configs tmpfs,file   # smoke run (~1 min)

Each run makes ``--files`` files of ``--size-kib`` (``open(path, "wb")``,
one write, close; every file other bytes) split over ``--writers`` processes, each in a directory
of its own, all released at once.  Configs, mounted side by side for the
whole run:

* ``tmpfs``: a private tmpfs, the kernel-only reference;
* ``minimal``: ``minimal_fs.py``, a pyfuse3 filesystem that only copies
  bytes into memory (no metadata engine, no persistence): the ceiling of a
  pyfuse3 filesystem on this machine;
* ``file``: aiturbofs over a ``file://`` backend in a temp dir (SQLite);
* ``file-dram``: the same with ``-o kernel_writes=dram`` (files the kernel
  writes keep their backing files on the staging tmpfs, not on disk);
* ``file-noyield``: ``file`` with ``-o persist_yield=0`` (uploads start at
  once instead of waiting for the writers to pause): the before/after of
  that option in one run;
* ``s3``: aiturbofs over a moto S3 server on loopback (SQLite);
* ``pg``: three aiturbofs nodes of one cluster (PostgreSQL metadata, moto
  S3, a controller), one writer each, all writing at once (``--writers``
  does not apply; the row gives files/s per node).

Figures: *closed* = files / seconds from the release to the last close();
*durable* = seconds from the release until every file reads
``user.aiturbo.state`` = durable (polled file by file, in order, every
50 ms), and files / those seconds.  The moto row measures the S3 server's
own ceiling in the same run: ``--files`` PUTs of the same size from 4 client
threads (the daemon uploads 4 files at once), so the ``s3`` durable rate can
be read as a fraction of what the server takes.  Runs rotate the config
order per repetition; medians are reported.
Results: benchmarks/results/smallfiles-<time>.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402
from s3server import S3Server  # noqa: E402  (tests/ is on sys.path via _harness)

KiB = 1024
BUCKET = "smallfiles"
DURABLE_TIMEOUT_S = 1800.0
DURABLE_POLL_S = 0.05
START_DELAY_S = 1.0  # writers start this long after they are launched (python startup is not timed)
MOTO_CLIENT_THREADS = 4
CONFIGS = ("tmpfs", "minimal", "file", "file-dram", "file-noyield", "s3", "pg")
AITURBOFS_CONFIGS = ("file", "file-dram", "file-noyield", "s3")
GOALS = {1: 2000.0, 8: 5000.0}  # files/s closed (issue: one writer, eight writers)

WRITER = r"""
import os, sys, time
prefix, n, size, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
buf = bytearray(os.urandom(size))
if prefix.endswith("/"):
    os.makedirs(prefix, exist_ok=True)
time.sleep(max(0.0, start - time.time()))
t0 = time.time()
for i in range(n):
    buf[:8] = i.to_bytes(8, "little")  # every file other bytes: nothing to deduplicate
    with open(prefix + "f%06d" % i, "wb") as f:
        f.write(buf)
print(t0, time.time())
"""


def write_files(dirs: list[str], per_writer: int, size: int) -> tuple[float, float, float]:
    """Run one writer process per name prefix (a directory if it ends in /);
    (release time, first start, last close) in time.time()."""
    release = time.time() + START_DELAY_S
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, d, str(per_writer), str(size), repr(release)],
                              stdout=subprocess.PIPE, text=True) for d in dirs]
    ends = []
    for p in procs:
        out, _ = p.communicate(timeout=DURABLE_TIMEOUT_S)
        if p.returncode:
            raise RuntimeError(f"writer exited with {p.returncode}")
        ends.append(tuple(map(float, out.split())))
    return release, min(t0 for t0, _ in ends), max(t1 for _, t1 in ends)


def wait_all_durable(paths: list[str]) -> float:
    """time.time() at which the last of ``paths`` read durable."""
    deadline = time.monotonic() + DURABLE_TIMEOUT_S
    i = 0
    while i < len(paths):
        st = h.aiturbo_state(paths[i])
        if st == "durable":
            i += 1
            continue
        if st == "broken":
            raise RuntimeError(f"{paths[i]} became broken")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(paths) - i} files not durable after {DURABLE_TIMEOUT_S:.0f} s")
        time.sleep(DURABLE_POLL_S)
    return time.time()


def moto_ceiling(server: S3Server, n: int, size: int) -> float:
    """PUTs/s the S3 server takes for ``n`` objects of ``size`` from 4 client threads."""
    client = server.client()
    body = os.urandom(size)
    t0 = time.monotonic()
    with ThreadPoolExecutor(MOTO_CLIENT_THREADS) as pool:
        list(pool.map(lambda i: client.put_object(Bucket=BUCKET, Key=f"ceiling/o{i:06d}", Body=body), range(n)))
    return n / (time.monotonic() - t0)


def one_run(name: str, roots: list[str], files: int, writers: int, size: int, tag: str, durable: bool,
            durable_by: str = "xattr") -> dict:
    per = max(1, files // writers)
    # minimal_fs has one flat directory: its writers put a prefix on the names instead
    sep = "-" if name == "minimal" else "/"
    dirs = [os.path.join(roots[i % len(roots)], f"{tag}-w{i}{sep}") for i in range(writers)]
    release, _, last_close = write_files(dirs, per, size)
    total = per * writers
    r = {"config": name, "writers": writers, "files": total, "closed_s": last_close - release,
         "closed_per_s": total / (last_close - release)}
    if durable and durable_by == "wait":
        # as a user waits: one call for every file
        subprocess.run([sys.executable, "-m", "aiturbofs.cli.main", "wait", "--quiet", *dirs], check=True,
                       timeout=DURABLE_TIMEOUT_S, env=dict(os.environ, PYTHONPATH=h.REPO))
        done = time.time()
    elif durable:
        done = wait_all_durable([f"{d}f{i:06d}" for d in dirs for i in range(per)])
    if durable:
        r.update(durable_s=done - release, durable_per_s=total / (done - release))
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--files", type=int, default=2000, help="files per run, over all writers (default 2000)")
    p.add_argument("--size-kib", type=int, default=64, help="file size (default 64)")
    p.add_argument("--writers", default="1,8", help="writer processes per run, comma-separated (default 1,8)")
    p.add_argument("--repeat", type=int, default=3, help="runs per config and writer count; medians (default 3)")
    p.add_argument("--configs", default=",".join(c for c in CONFIGS if c not in ("file-dram", "file-noyield")),
                   help=f"subset of {','.join(CONFIGS)} (default: all but file-dram and file-noyield)")
    p.add_argument("--durable-by", choices=("xattr", "wait"), default="xattr",
                   help="how durable is seen: each file's user.aiturbo.state polled in order (default), or one "
                        "`aiturbo wait` of the writers' directories, as a user waits")
    a = p.parse_args(argv)
    size = a.size_kib * KiB
    writer_counts = [int(w) for w in a.writers.split(",")]
    configs = [c for c in a.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}")

    h.sigterm_as_interrupt()
    runs: list[dict] = []
    ceiling = None
    with ExitStack() as stack:
        tmp = h.temp_dir("aiturbo-smallfiles-")
        stack.callback(h.remove_tree, tmp)
        roots: dict[str, list[str]] = {}
        pids: dict[str, list[int]] = {}
        server = None
        if "s3" in configs or "pg" in configs:
            server = S3Server()
            stack.callback(server.close)
            server.start()
            server.make_bucket(BUCKET)
        if "tmpfs" in configs:
            t = h.TmpfsMount(os.path.join(tmp, "tmpfs"), 4 << 30).start()
            stack.callback(t.stop)
            roots["tmpfs"] = [t.mountpoint]
        if "minimal" in configs:
            mm = h.MinimalMount(os.path.join(tmp, "minimal"), [], os.path.join(tmp, "minimal.log")).start()
            stack.callback(mm.stop)
            roots["minimal"] = [mm.mountpoint]
        for name in AITURBOFS_CONFIGS:
            if name not in configs:
                continue
            if name.startswith("file"):
                os.makedirs(os.path.join(tmp, f"backend-{name}"))
                url, opts = f"file://{tmp}/backend-{name}", {}
                if name == "file-dram":
                    opts["kernel_writes"] = "dram"  # files the kernel writes on the staging tmpfs, not on disk
                if name == "file-noyield":
                    opts["persist_yield"] = "0"  # uploads start at once, between the writers' requests
            else:
                assert server is not None
                url, opts = f"s3://{BUCKET}/fs", {"s3_endpoint": server.endpoint}
            m = h.start_aiturbofs(url, os.path.join(tmp, f"mnt-{name}"), os.path.join(tmp, f"state-{name}"),
                                  {"import_ttl": "5", **opts})
            stack.callback(h.stop_aiturbofs, m)
            roots[name] = [m.mountpoint]
            pids[name] = [m.proc.pid]
        if "pg" in configs:
            from cluster import Cluster
            from pgserver import PgServer

            pg = PgServer()
            stack.callback(pg.stop)
            pg.start()
            assert server is not None
            # Straight to moto: the tests' counting proxy (one thread per
            # connection) is not built for thousands of requests.
            cluster = Cluster(os.path.join(tmp, "cluster"), pg=pg, s3=server, n=3,
                              node_options={"import_ttl": "5", "s3_endpoint": server.endpoint})
            cluster.start()
            stack.callback(cluster.close)
            roots["pg"] = [m.mountpoint for m in cluster.nodes]
            pids["pg"] = [m.proc.pid for m in cluster.nodes]

        for rep in range(a.repeat):
            for writers in writer_counts:
                order = configs[rep % len(configs):] + configs[:rep % len(configs)]
                for name in order:
                    if name == "pg" and writers != writer_counts[0]:
                        continue  # one writer per node, once per repetition
                    n_writers = 3 if name == "pg" else writers
                    cpu0 = {pid: h.cpu_seconds(pid) for pid in pids.get(name, [])}
                    r = one_run(name, roots[name], a.files, n_writers, size, f"r{rep}w{writers}",
                                durable=name in AITURBOFS_CONFIGS or name == "pg", durable_by=a.durable_by)
                    cpu = sum(h.cpu_seconds(pid) - c for pid, c in cpu0.items())
                    r.update(rep=rep, daemon_cpu_ms_per_file=1000 * cpu / r["files"] if cpu0 else None)
                    runs.append(r)
                    print(f"rep {rep} {name:8s} writers {n_writers}: {r['closed_per_s']:8.0f} files/s closed"
                          + (f", durable after {r['durable_s']:6.2f} s ({r['durable_per_s']:.0f}/s)" if "durable_s" in r else "")
                          + (f", daemon CPU {r['daemon_cpu_ms_per_file']:.2f} ms/file" if r["daemon_cpu_ms_per_file"] else ""),
                          file=sys.stderr, flush=True)
        if server is not None and "s3" in configs:
            ceiling = moto_ceiling(server, min(a.files, 2000), size)
            print(f"moto ceiling: {ceiling:.0f} PUTs/s", file=sys.stderr, flush=True)

    table = summarize(runs, configs, writer_counts, ceiling, a)
    md, js = h.save_results("smallfiles", table, {"args": vars(a), "runs": runs, "moto_puts_per_s": ceiling})
    print(table)
    print(f"\nresults: {md} {js}", file=sys.stderr)
    return 0


def summarize(runs: list[dict], configs: list[str], writer_counts: list[int], ceiling: float | None, a) -> str:
    def med(name: str, writers: int, key: str) -> float | None:
        vals = [r[key] for r in runs if r["config"] == name and (r["writers"] == writers or name == "pg")
                and r.get(key) is not None]
        return h.median(vals) if vals else None

    rows = []
    for writers in writer_counts:
        tmpfs = med("tmpfs", writers, "closed_per_s")
        for name in configs:
            if name == "pg" and writers != writer_counts[0]:
                continue
            closed = med(name, writers, "closed_per_s")
            if closed is None:
                continue
            durable_s, durable_rate = med(name, writers, "durable_s"), med(name, writers, "durable_per_s")
            closed_s = med(name, writers, "closed_s")
            cpu = med(name, writers, "daemon_cpu_ms_per_file")
            label = "3 nodes x 1 (per node)" if name == "pg" else str(writers)
            rate = closed / 3 if name == "pg" else closed
            rows.append([
                name, label, f"{rate:.0f}", f"{closed / tmpfs:.3f}" if tmpfs else "-",
                f"{durable_rate / 3 if name == 'pg' else durable_rate:.0f}" if durable_rate else "-",
                f"{durable_s / closed_s:.2f}" if durable_s and closed_s else "-",
                f"{durable_rate / ceiling:.2f}" if name == "s3" and ceiling and durable_rate else "-",
                f"{cpu:.2f}" if cpu else "-",
            ])
    goals = ", ".join(f"{w} writer(s) >= {g:.0f}/s" for w, g in GOALS.items())
    return (f"{a.files} files of {a.size_kib} KiB per run (open 'wb', one write, close), median of {a.repeat}; "
            f"goals closed: {goals}; durable within 2x the writing time on file://"
            + (f"; moto's own ceiling: {ceiling:.0f} PUTs/s from {MOTO_CLIENT_THREADS} threads" if ceiling else "")
            + "\n\n"
            + h.markdown_table(["config", "writers", "closed files/s", "vs tmpfs", "durable files/s",
                                "durable time / writing time", "durable rate / moto PUT rate", "daemon CPU ms/file"],
                               rows))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: mounts, moto and temp dirs cleaned up", file=sys.stderr)
        sys.exit(130)
