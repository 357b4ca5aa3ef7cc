#!/usr/bin/env python3
"""What a metadata call costs beside a passthrough writer: fchmod, futimens, close of a second fd.

    python benchmarks/setattr_bench.py [--size-mib 1024] [--repeat 5]

Mounts aiturbofs (file:// backend in a temp dir, the default data path),
opens one file O_RDWR (the kernel serves it: passthrough), writes
``--size-mib`` in 1 MiB writes, then with that descriptor still open times,
``--repeat`` times each: ``os.fchmod``, ``os.utime`` (futimens) on it, and
the open+close of a second O_WRONLY descriptor (a commit).  While a
passthrough writer is open the daemon cannot see writes; a call that must
order with them hashes every chunk of the file first (``absorb``).  Prints
the medians; run it in two checkouts for before/after.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="file size (default 1024)")
    p.add_argument("--repeat", type=int, default=5, help="calls of each kind; medians shown (default 5)")
    a = p.parse_args(argv)
    tmp = h.temp_dir("aiturbo-setattr-")
    try:
        os.makedirs(os.path.join(tmp, "backend"))
        m = h.start_aiturbofs(f"file://{tmp}/backend", os.path.join(tmp, "mnt"), os.path.join(tmp, "state"),
                              {"dram": f"{2 * a.size_mib + 256}M"})
        try:
            path = os.path.join(tmp, "mnt", "big.bin")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                block = os.urandom(MiB)
                for _ in range(a.size_mib):
                    os.write(fd, block)
                times: dict[str, list[float]] = {"fchmod": [], "futimens": [], "second fd close": []}
                for i in range(a.repeat):
                    t = time.perf_counter()
                    os.fchmod(fd, 0o600 if i % 2 else 0o644)
                    times["fchmod"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    os.utime(fd, ns=(10**18, 10**18 + i))
                    times["futimens"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    os.close(os.open(path, os.O_WRONLY))
                    times["second fd close"].append(time.perf_counter() - t)
            finally:
                os.close(fd)
        finally:
            h.stop_aiturbofs(m)
    finally:
        h.remove_tree(tmp)
    rows = [[k, f"{h.median(v) * 1000:.1f}"] for k, v in times.items()]
    print(f"{a.size_mib} MiB file open for writing through the kernel (passthrough), medians of {a.repeat}:")
    print(h.markdown_table(["call", "ms"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
