#!/usr/bin/env python3
"""Trees: extract, read back and compare, and delete a tree of many small files.

    python benchmarks/trees_bench.py                          # ~15,000 files of the venv's site-packages
    python benchmarks/trees_bench.py --max-files 2000 --repeat 1   # smoke run (~1 min)

The source is a real tree of small files: the Python library directory of the
interpreter that runs the benchmark (its ``site-packages``, or ``--source``),
cut to the first ``--max-files`` regular files in sorted order and packed
into one tar in the temp dir (read from the page cache in every run).  Per
config and repetition, each phase timed with the tool a user would run:

* *extract*: ``tar -xf tree.tar -C DIR`` (files/s);
* *durable* (aiturbofs only): from the end of the extract until
  ``aiturbo wait DIR`` returns;
* *read back*: ``diff -r SOURCE DIR`` right after (the source is the tar's
  own tree, extracted once on the plain directory's filesystem and read from
  the page cache);
* *cold read* (aiturbofs only): the mount stopped, and mounted again on the
  same backend with a fresh state dir, then ``diff -r`` again: every byte
  comes from the backend, as a dataset or a checkpoint read on a new node;
* *delete*: ``rm -rf DIR`` (files/s).

Configs: ``plain`` (a directory in the temp dir, on the filesystem that
holds the state dirs and the file:// backends), ``file`` (aiturbofs over
``file://``, the default data path) and ``pyfuse3`` (the same with
``-o datapath=pyfuse3``).  Ratios are against ``plain`` in the same run;
configs rotate order per repetition; medians are reported.  A ``diff`` that
finds a difference fails the run.
Results: benchmarks/results/trees-<time>.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tarfile
import time
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

CONFIGS = ("plain", "file", "pyfuse3")
AITURBOFS_OPTIONS = {"file": {}, "pyfuse3": {"datapath": "pyfuse3"}}
GOALS = {"extract": 0.25, "read": 0.5, "delete": 0.25}  # x plain (issue: trees)
PHASE_TIMEOUT_S = 3600.0


def pick_files(source: str, limit: int) -> list[str]:
    """The first ``limit`` regular files under ``source`` (paths relative to it), sorted."""
    found = []
    for root, dirs, files in os.walk(source):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                found.append(os.path.relpath(path, source))
                if len(found) >= limit:
                    return found
    return found


def make_tar(source: str, files: list[str], tar_path: str) -> int:
    """Pack ``files`` (relative to ``source``) under ``tree/``; their total bytes."""
    total = 0
    with tarfile.open(tar_path, "w") as tar:
        for rel in files:
            full = os.path.join(source, rel)
            total += os.path.getsize(full)
            tar.add(full, arcname=os.path.join("tree", rel), recursive=False)
    return total


def run(argv: list[str], what: str) -> float:
    """Seconds ``argv`` took; a failure (a diff that found a difference) raises."""
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=PHASE_TIMEOUT_S)
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{what}: {' '.join(argv)} exited {r.returncode}: {(r.stdout + r.stderr)[-2000:]}")
    return took


def wait_durable(path: str) -> float:
    """Seconds until every file under ``path`` is durable (``aiturbo wait``)."""
    from aiturbofs._wait import wait

    t0 = time.monotonic()
    wait([path], timeout=PHASE_TIMEOUT_S)
    return time.monotonic() - t0


def one_run(name: str, root: str, tar_path: str, reference: str, n: int, remount) -> dict:
    """Extract into ``root``/tree, then durable, read back, cold read (via ``remount``), delete."""
    tree = os.path.join(root, "tree")
    r: dict = {"config": name, "files": n}
    r["extract_s"] = run(["tar", "-xf", tar_path, "-C", root], "extract")
    if remount is not None:
        r["durable_s"] = wait_durable(tree)
    r["read_s"] = run(["diff", "-r", reference, tree], "read back")
    if remount is not None:
        root = remount()
        tree = os.path.join(root, "tree")
        r["cold_read_s"] = run(["diff", "-r", reference, tree], "cold read")
    r["delete_s"] = run(["rm", "-rf", tree], "delete")
    if os.path.exists(tree):
        raise RuntimeError(f"{tree} still exists after rm -rf")
    return r


class AiturbofsConfig:
    """One aiturbofs config: a backend of its own, remounted with a fresh state dir for the cold read."""

    def __init__(self, name: str, tmp: str, stack: ExitStack):
        self.name, self.tmp, self.stack = name, tmp, stack
        self.backend = os.path.join(tmp, f"backend-{name}")
        os.makedirs(self.backend)
        self.mounts = 0
        self.m = None
        self.start()

    def start(self) -> str:
        self.mounts += 1
        self.m = h.start_aiturbofs(f"file://{self.backend}", os.path.join(self.tmp, f"mnt-{self.name}"),
                                   os.path.join(self.tmp, f"state-{self.name}-{self.mounts}"),
                                   {"import_ttl": "5", **AITURBOFS_OPTIONS[self.name]})
        self.stack.callback(h.stop_aiturbofs, self.m)
        return self.m.mountpoint

    def remount(self) -> str:
        h.stop_aiturbofs(self.m)
        return self.start()

    @property
    def pid(self) -> int:
        return self.m.proc.pid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--source", default=sysconfig.get_paths()["purelib"],
                   help="the tree to copy (default: this interpreter's site-packages)")
    p.add_argument("--max-files", type=int, default=15000, help="at most this many files of it (default 15000)")
    p.add_argument("--repeat", type=int, default=3, help="runs per config; medians (default 3)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)} (default: all)")
    a = p.parse_args(argv)
    configs = [c for c in a.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}")

    h.sigterm_as_interrupt()
    runs: list[dict] = []
    with ExitStack() as stack:
        tmp = h.temp_dir("aiturbo-trees-")
        stack.callback(h.remove_tree, tmp)
        files = pick_files(a.source, a.max_files)
        tar_path = os.path.join(tmp, "tree.tar")
        size = make_tar(a.source, files, tar_path)
        os.makedirs(os.path.join(tmp, "reference"))
        run(["tar", "-xf", tar_path, "-C", os.path.join(tmp, "reference")], "reference")
        reference = os.path.join(tmp, "reference", "tree")
        print(f"tree: {len(files)} files, {size / 1e6:.0f} MB from {a.source}", file=sys.stderr, flush=True)
        mounts = {name: AiturbofsConfig(name, tmp, stack) for name in configs if name != "plain"}
        for rep in range(a.repeat):
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
            for name in order:
                if name == "plain":
                    root = os.path.join(tmp, f"plain-{rep}")
                    os.makedirs(root)
                    r = one_run(name, root, tar_path, reference, len(files), None)
                else:
                    m = mounts[name]
                    cpu0 = h.cpu_seconds(m.pid)
                    r = one_run(name, m.m.mountpoint, tar_path, reference, len(files), m.remount)
                    r["daemon_cpu_s"] = h.cpu_seconds(m.pid) - cpu0  # the cold mount's share: read and delete
                r["rep"] = rep
                runs.append(r)
                print(f"rep {rep} {name:8s}: " + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in r.items() if k.endswith("_s")),
                      file=sys.stderr, flush=True)

    table = summarize(runs, configs, len(files), size, a)
    md, js = h.save_results("trees", table, {"args": vars(a), "files": len(files), "bytes": size, "runs": runs})
    print(table)
    print(f"\nresults: {md} {js}", file=sys.stderr)
    return 0


def summarize(runs: list[dict], configs: list[str], n: int, size: int, a) -> str:
    def med(name: str, key: str) -> float | None:
        vals = [r[key] for r in runs if r["config"] == name and key in r]
        return h.median(vals) if vals else None

    def rate(name: str, key: str) -> str:
        s = med(name, key)
        return f"{n / s:.0f}" if s else "-"

    def ratio(name: str, key: str, plain_key: str | None = None) -> str:
        s, base = med(name, key), med("plain", plain_key or key)
        return f"{base / s:.3f}" if s and base else "-"

    rows = []
    for name in configs:
        durable = med(name, "durable_s")
        rows.append([name, rate(name, "extract_s"), ratio(name, "extract_s"),
                     f"{durable:.1f}" if durable is not None else "-",
                     rate(name, "read_s"), ratio(name, "read_s"),
                     rate(name, "cold_read_s"), ratio(name, "cold_read_s", "read_s"),
                     rate(name, "delete_s"), ratio(name, "delete_s")])
    goals = ", ".join(f"{k} >= {v}x plain" for k, v in GOALS.items())
    return (f"{n} files, {size / 1e6:.0f} MB ({a.source}), median of {a.repeat}; files/s and x plain; goals: {goals}\n\n"
            + h.markdown_table(["config", "extract files/s", "x plain", "durable after extract (s)",
                                "read back (diff -r) files/s", "x plain", "cold read files/s", "x plain (warm)",
                                "delete files/s", "x plain"], rows))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: mounts and temp dirs cleaned up", file=sys.stderr)
        sys.exit(130)
