#!/usr/bin/env python3
"""close() time of a large file on aiturbofs over S3: default (close = staged) vs -o sync_close.

    python benchmarks/close_bench.py [--size-mib 1024] [--repeat 1]

Starts a moto S3 server on loopback (tests/s3server.py) and two aiturbofs
mounts of the same bucket (``s3://bench/default`` and ``s3://bench/sync``,
``-o s3_endpoint=``), one with ``-o sync_close`` (write-through: close waits
for the upload, the baseline the DRAM write-back is measured against).  On
each, a Python process writes one file with 1 MiB ``write`` calls
(``open(path, "wb", buffering=0)``, page-aligned buffer) and times:

* write   — all the write() calls;
* close   — ``f.close()`` alone (future 0, or future 1 with sync_close);
* durable — from close() returning until ``user.aiturbo.state`` reads
  ``durable`` (polled every 20 ms), and from open() to durable;
* CPU seconds the aiturbofs daemon and the moto server used from open() to
  durable (/proc/PID/stat): which side the upload is bound by.

The modes alternate within each repetition; after each file the script
deletes it and waits until the daemon's persist queue is empty.  Target:
sync_close close time / default close time >= 10x.
Results: benchmarks/results/close-<time>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402
from mounting import aiturbo  # noqa: E402  (tests/ is on sys.path via _harness)
from s3server import S3Server  # noqa: E402

MiB = 1 << 20
WRITE_BYTES = MiB
BUCKET = "bench"
MODES = {"default": {}, "sync_close": {"sync_close": True}}
PREFIX = {"default": "default", "sync_close": "sync"}
DURABLE_TIMEOUT_S = 1800.0
QUEUE_TIMEOUT_S = 300.0
TARGET_RATIO = 10.0


def write_file(path: str, size: int, buf: mmap.mmap, pids: dict[str, int]) -> dict:
    cpu0 = {k: h.cpu_seconds(p) for k, p in pids.items()}
    t_open = time.monotonic()
    f = open(path, "wb", buffering=0)  # O_WRONLY|O_CREAT|O_TRUNC, every write a syscall
    try:
        t0 = time.monotonic()
        left = size
        while left:
            n = f.write(buf if left >= len(buf) else memoryview(buf)[:left])
            left -= n
        t1 = time.monotonic()
    except BaseException:
        f.close()
        raise
    f.close()
    t2 = time.monotonic()
    state_at_close = h.aiturbo_state(path)
    h.wait_durable([path], DURABLE_TIMEOUT_S)
    t3 = time.monotonic()
    cpu = {f"{k}_cpu_s": h.cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
    return {**cpu, "write_s": t1 - t0, "close_s": t2 - t1, "durable_after_close_s": t3 - t2, "open_to_durable_s": t3 - t_open,
            "state_at_close": state_at_close, "write_mib_s": size / MiB / (t1 - t0)}


def wait_queue_empty(mountpoint: str) -> dict:
    deadline = time.monotonic() + QUEUE_TIMEOUT_S
    while True:
        status = json.loads(aiturbo("status", mountpoint, "--json").stdout)
        s = status[0] if isinstance(status, list) else status
        if s["persist"]["queue"] == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--size-mib", type=int, default=1024, help="file size (default 1024)")
    p.add_argument("--repeat", type=int, default=1, help="files per mode; the table shows medians (default 1)")
    p.add_argument("--dram", default=None, help="aiturbofs -o dram= (default: 2x the file size, at least 1G)")
    a = p.parse_args(argv)
    size = a.size_mib * MiB
    dram = a.dram or f"{max(1024, 2 * a.size_mib)}M"

    h.sigterm_as_interrupt()
    runs: list[dict] = []
    with ExitStack() as stack:
        tmp = h.temp_dir("aiturbo-close-")
        stack.callback(h.remove_tree, tmp)
        server = S3Server()
        stack.callback(server.close)
        server.start()
        server.make_bucket(BUCKET)
        mounts = {}
        for mode, extra in MODES.items():
            m = h.start_aiturbofs(f"s3://{BUCKET}/{PREFIX[mode]}", os.path.join(tmp, f"mnt-{mode}"),
                                  os.path.join(tmp, f"state-{mode}"), {"s3_endpoint": server.endpoint, "dram": dram, **extra})
            stack.callback(h.stop_aiturbofs, m)
            mounts[mode] = m
        buf = mmap.mmap(-1, WRITE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf[:] = os.urandom(WRITE_BYTES)
        order = list(MODES)
        for rep in range(a.repeat):
            for mode in order if rep % 2 == 0 else order[::-1]:
                path = mounts[mode].path(f"ckpt-{rep}.bin")
                pids = {"daemon": mounts[mode].proc.pid, "moto": server._proc.pid}
                r = write_file(path, size, buf, pids)
                os.unlink(path)
                status = wait_queue_empty(mounts[mode].mountpoint)
                runs.append({"rep": rep, "mode": mode, **r, "pool_after": status.get("pool")})
                print(f"rep {rep} {mode:10s} write {r['write_s']:6.2f} s ({r['write_mib_s']:.0f} MiB/s)  close {r['close_s']:7.3f} s  "
                      f"state at close {r['state_at_close']:10s} durable +{r['durable_after_close_s']:6.2f} s  "
                      f"open->durable {r['open_to_durable_s']:6.2f} s  CPU daemon {r['daemon_cpu_s']:.1f} s moto {r['moto_cpu_s']:.1f} s",
                      file=sys.stderr, flush=True)

    med = {mode: {k: h.median([r[k] for r in runs if r["mode"] == mode])
                  for k in ("write_s", "close_s", "durable_after_close_s", "open_to_durable_s", "write_mib_s",
                            "daemon_cpu_s", "moto_cpu_s")} for mode in MODES}
    rows = []
    for mode in MODES:
        m = med[mode]
        states = ",".join(sorted({r["state_at_close"] for r in runs if r["mode"] == mode}))
        rows.append([mode, f"{m['write_s']:.2f}", f"{m['write_mib_s']:.0f}", f"{m['close_s']:.3f}", states,
                     f"{m['durable_after_close_s']:.2f}", f"{m['open_to_durable_s']:.2f}",
                     f"{m['daemon_cpu_s']:.1f} / {m['moto_cpu_s']:.1f}"])
    ratio = med["sync_close"]["close_s"] / med["default"]["close_s"] if med["default"]["close_s"] > 0 else float("inf")
    table = (f"close() of a {a.size_mib} MiB file written with 1 MiB writes, aiturbofs over moto S3 on loopback, "
             f"median of {a.repeat}\n\n"
             + h.markdown_table(["mode", "write s", "write MiB/s", "close s", "state at close", "durable after close s",
                                 "open -> durable s", "CPU s daemon / moto"], rows)
             + f"\n\nsync_close / default close time: {ratio:.0f}x (target >= {TARGET_RATIO:.0f}x: "
             + f"{'PASS' if ratio >= TARGET_RATIO else 'FAIL'})")
    md, js = h.save_results("close", table, {"args": vars(a), "runs": runs, "ratio": ratio})
    print(table)
    print(f"\nresults: {md} {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: mounts, moto and temp dirs cleaned up", file=sys.stderr)
        sys.exit(130)
