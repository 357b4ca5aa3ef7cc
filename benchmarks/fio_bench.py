#!/usr/bin/env python3
"""Sequential write/read throughput and p99 latency: aiturbofs vs the Python-FUSE ceiling vs tmpfs.

    python benchmarks/fio_bench.py [--size-mib 512] [--repeat 3] [--profile]

Mounts, side by side, for the whole run:

* ``aiturbofs``   — mount.aiturbo on a file:// backend in a temp dir, ``-o dram=`` large;
* ``minimal``     — benchmarks/minimal_fs.py under aiturbofs' conditions
                    (read_ahead_kb=1024, getxattr implemented, direct_io for O_WRONLY handles);
* ``minimal-nodio`` — the same without direct_io on any handle;
* ``minimal-dio`` — the same with direct_io for every writable handle (O_RDWR too);
  so every row has the ceiling with direct_io off (nodio) and on (dio) for its
  write handles, and ``minimal`` equals one of them (aiturbofs' rule);
* ``minimal-warm`` — ``minimal`` whose new files reuse the memory of deleted ones
                    (no first-touch page faults; aiturbofs recycles up to 512 MiB of buffers);
* ``tmpfs``       — a private tmpfs (the kernel-only reference).

Workloads (``--workloads``, default ``256k:1,1m:1,1m:4`` = bs:numjobs), each
run as:

* ``fio write`` / ``fio read`` — fio psync sequential, ``--output-format=json``,
  bandwidth and p99 completion latency (clat).  fio opens its write files
  **O_RDWR**, so on aiturbofs and ``minimal`` these writes go through the page
  cache (no direct_io) and pay the kernel's per-write getxattr;
* ``py write O_WRONLY`` — the same sequential pwrite loop from Python
  processes that open the file O_WRONLY (as ``open(path, "wb")``, torch.save,
  safetensors do) from a page-aligned buffer: the direct_io path of
  aiturbofs.  Latency is timed around each pwrite(2).

Every (repetition, workload) runs all configs back to back, in an order that
rotates, so the figures of one row share the machine's conditions; the table
shows medians over ``--repeat``.  After each aiturbofs write the script waits
until the files are durable (not timed) so persisting never overlaps another
config's run.  Results: benchmarks/results/fio-<time>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

# aiturbofs-<datapath>: mount.aiturbo -o datapath=<datapath> (passthrough, kernel, pyfuse3; plain "aiturbofs" is auto)
CONFIGS = ("aiturbofs-passthrough", "aiturbofs-kernel", "aiturbofs-pyfuse3", "minimal", "minimal-nodio", "minimal-dio",
           "minimal-warm", "tmpfs")
MiB = 1 << 20
FILE_PREFIX = "bench."
DURABLE_TIMEOUT_S = 900.0
TARGET_TMPFS_RATIO = 0.8  # aiturbofs 1 MiB writes and reads >= 0.8x tmpfs
TARGET_P99_MS = 2.0  # p99 < 2 ms at 256 KiB


def parse_bs(text: str) -> int:
    text = text.lower()
    mult = {"k": 1024, "m": MiB}.get(text[-1], 1)
    return int(text.rstrip("km")) * mult


def bs_label(bs: int) -> str:
    return f"{bs // MiB}m" if bs % MiB == 0 else f"{bs // 1024}k"


# ------------------------------------------------------------------------ fio
def run_fio(directory: str, rw: str, bs: int, numjobs: int, size: int) -> dict:
    cmd = [
        "fio", "--name=bench", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}", f"--size={size}",
        f"--numjobs={numjobs}", "--ioengine=psync", "--fallocate=none", "--invalidate=1",
        "--group_reporting", "--output-format=json", "--percentile_list=50:99:99.9",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"fio failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    out = r.stdout[r.stdout.index("{"):]  # fio may print warnings before the JSON
    job = json.loads(out)["jobs"][0][rw]
    pct = job["clat_ns"]["percentile"]
    return {"mib_s": job["bw_bytes"] / MiB, "p99_ms": pct["99.000000"] / 1e6, "p50_ms": pct["50.000000"] / 1e6,
            "p999_ms": pct["99.900000"] / 1e6, "bytes": job["io_bytes"]}


# ------------------------------------------------------- Python O_WRONLY writer
def _wo_worker(path: str, bs: int, size: int, barrier, conn) -> None:
    try:
        buf = mmap.mmap(-1, bs, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned, like fio's
        buf[:] = os.urandom(bs)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        lat = []
        barrier.wait()
        t0 = time.monotonic_ns()
        for off in range(0, size, bs):
            a = time.monotonic_ns()
            n = os.pwrite(fd, buf, off)
            lat.append(time.monotonic_ns() - a)
            if n != bs:
                raise OSError(f"short write {n} of {bs}")
        t1 = time.monotonic_ns()
        os.close(fd)
        conn.send(("ok", t0, t1, lat))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        barrier.abort()
        conn.send(("err", repr(exc)))


def run_py_wronly(directory: str, bs: int, numjobs: int, size: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(numjobs)
    procs, conns = [], []
    try:
        for j in range(numjobs):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_wo_worker, args=(os.path.join(directory, f"{FILE_PREFIX}{j}.0"), bs, size, barrier, send))
            p.start()
            procs.append(p)
            conns.append(recv)
        results = [c.recv() for c in conns]
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [r[1] for r in results if r[0] != "ok"]
    if errors:
        raise RuntimeError(f"python writer failed: {errors}")
    start = min(r[1] for r in results)
    end = max(r[2] for r in results)
    lat = sorted(x for r in results for x in r[3])
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] / 1e6  # noqa: E731
    total = numjobs * size
    return {"mib_s": total / MiB / ((end - start) / 1e9), "p99_ms": p(0.99), "p50_ms": p(0.50), "p999_ms": p(0.999),
            "bytes": total}


# ------------------------------------------------------------------- runner
class Bench:
    def __init__(self, args, stack: ExitStack):
        self.args = args
        self.tmp = h.temp_dir("aiturbo-fio-")
        stack.callback(h.remove_tree, self.tmp)
        self.mounts: dict[str, object] = {}
        self.dirs: dict[str, str] = {}
        self.stack = stack

    def mount_all(self) -> None:
        a = self.args
        for name in a.configs:
            mnt = os.path.join(self.tmp, f"mnt-{name}")
            if name.startswith("aiturbofs"):
                backend = os.path.join(self.tmp, f"backend-{name}")
                os.makedirs(backend)
                env = dict(kv.split("=", 1) for kv in a.aiturbofs_env)
                opts = {"dram": a.dram, "datapath": name.partition("-")[2] or "auto"}
                m = h.start_aiturbofs(f"file://{backend}", mnt, os.path.join(self.tmp, f"state-{name}"), opts,
                                      env=env or None)
                self.stack.callback(h.stop_aiturbofs, m)
                time.sleep(0.5)  # read_ahead_kb is raised 0.3 s after INIT
            elif name.startswith("minimal"):
                flags = {"minimal": ["--direct-io", "wronly"], "minimal-dio": ["--direct-io", "writable"],
                         "minimal-nodio": ["--direct-io", "none"],
                         "minimal-warm": ["--direct-io", "wronly", "--recycle-mib", str(a.max_total_mib + 64)]}[name]
                m = h.MinimalMount(mnt, flags, os.path.join(self.tmp, f"{name}.log")).start()
                self.stack.callback(m.stop)
            elif name == "tmpfs":
                m = h.TmpfsMount(mnt, a.max_total_mib * MiB * 2).start()
                self.stack.callback(m.stop)
            else:
                raise SystemExit(f"unknown config {name}")
            self.mounts[name], self.dirs[name] = m, mnt
        for name, mnt in self.dirs.items():
            print(f"# {name}: {mnt} read_ahead_kb={read_ahead_kb(mnt)}", file=sys.stderr)

    def files(self, name: str) -> list[str]:
        d = self.dirs[name]
        return [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.startswith(FILE_PREFIX)]

    def clean(self, name: str) -> None:
        for p in self.files(name):
            os.unlink(p)

    def after_write(self, name: str) -> float | None:
        if not name.startswith("aiturbofs"):
            return None
        return h.wait_durable(self.files(name), DURABLE_TIMEOUT_S)

    def per_job_size(self, numjobs: int, bs: int) -> int:
        size = min(self.args.size_mib, self.args.max_total_mib // numjobs) * MiB
        return max(bs, size // bs * bs)

    def run_one(self, name: str, bs: int, numjobs: int, ops: list[str]) -> dict:
        d = self.dirs[name]
        size = self.per_job_size(numjobs, bs)
        pid = getattr(self.mounts[name], "pid", None) or getattr(getattr(self.mounts[name], "proc", None), "pid", None)
        out = {}

        def timed(op: str, fn, *fargs, write: bool) -> None:
            c0 = cpu_s(pid)
            r = fn(*fargs)
            c1 = cpu_s(pid)
            r["durable_s"] = self.after_write(name) if write else None
            c2 = cpu_s(pid)
            gib = r["bytes"] / (1 << 30)
            if pid is not None:
                r["cpu_s_per_gib"] = (c1[0] - c0[0]) / gib  # daemon, all threads, during the I/O
                r["main_cpu_s_per_gib"] = (c1[1] - c0[1]) / gib  # daemon main (trio/FUSE) thread
                r["cpu_to_durable_s_per_gib"] = (c2[0] - c0[0]) / gib  # all threads until durable
                r["minflt_per_gib"] = (c1[2] - c0[2]) / gib  # first-touch page faults, all threads
                r["main_minflt_per_gib"] = (c1[3] - c0[3]) / gib
            out[op] = r

        self.clean(name)
        if "write" in ops or "read" in ops:
            timed("fio write", run_fio, d, "write", bs, numjobs, size, write=True)
            if "read" in ops:
                timed("fio read", run_fio, d, "read", bs, numjobs, size, write=False)
            self.clean(name)
        if "wo" in ops:
            timed("py write O_WRONLY", run_py_wronly, d, bs, numjobs, size, write=True)
            self.clean(name)
        time.sleep(self.args.settle_s)
        return out


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int | None) -> tuple[float, float, int, int]:
    """user+system CPU seconds and minor page faults of (whole process, main thread).

    The process figures include threads that have exited.
    """
    if pid is None:
        return (0.0, 0.0, 0, 0)
    cpu, faults = [], []
    for path in (f"/proc/{pid}/stat", f"/proc/{pid}/task/{pid}/stat"):
        with open(path) as f:
            fields = f.read().rpartition(")")[2].split()
        cpu.append((int(fields[11]) + int(fields[12])) / CLK_TCK)  # utime, stime
        faults.append(int(fields[7]))  # minflt
    return cpu[0], cpu[1], faults[0], faults[1]


def read_ahead_kb(mountpoint: str) -> str:
    with open("/proc/self/mountinfo") as f:
        devs = [line.split()[2] for line in f if line.split()[4] == mountpoint]
    try:
        with open(f"/sys/class/bdi/{devs[-1]}/read_ahead_kb") as f:
            return f.read().strip()
    except (OSError, IndexError):
        return "?"


def fmt(r: dict | None) -> str:
    if not r:
        return "-"
    return f"{r['mib_s']:.0f} ({r['p99_ms']:.2f})"


def build_table(configs: list[str], rows: list[tuple[str, int, int]], med: dict) -> str:
    """MiB/s (p99) per config; each aiturbofs config's ratio to tmpfs (the goal) and to the Python ceiling."""
    header = ["op", "bs", "jobs"] + [f"{c} MiB/s (p99 ms)" for c in configs]
    ours = [c for c in configs if c.startswith("aiturbofs")]
    refs = [r for r in ("tmpfs", "minimal") if r in configs]
    header += [f"{c}/{r}" for c in ours for r in refs]
    lead = "aiturbofs-passthrough" if "aiturbofs-passthrough" in ours else (ours[0] if ours else None)
    if lead and "tmpfs" in refs:
        header.append(f"target ({lead})")
    out = []
    for op, bs, nj in rows:
        cells = [op, bs_label(bs), str(nj)] + [fmt(med.get((c, op, bs, nj))) for c in configs]
        for c in ours:
            for r in refs:
                a, b = med.get((c, op, bs, nj)), med.get((r, op, bs, nj))
                cells.append(f"{a['mib_s'] / b['mib_s']:.2f}x" if a and b else "-")
        if lead and "tmpfs" in refs:
            a, t = med.get((lead, op, bs, nj)), med.get(("tmpfs", op, bs, nj))
            cells.append(target_cell(op, bs, a, a["mib_s"] / t["mib_s"] if a and t else None))
        out.append(cells)
    return h.markdown_table(header, out)


def build_cpu_table(configs: list[str], rows: list[tuple[str, int, int]], med: dict) -> str:
    daemons = [c for c in configs if c != "tmpfs"]
    out = []
    for op, bs, nj in rows:
        cells = [op, bs_label(bs), str(nj)]
        for c in daemons:
            r = med.get((c, op, bs, nj)) or {}
            if "cpu_s_per_gib" not in r:
                cells.append("-")
                continue
            cell = f"{r['main_cpu_s_per_gib']:.2f} / {r['cpu_s_per_gib']:.2f}"
            if c.startswith("aiturbofs") and "write" in op:
                cell += f" [{r['cpu_to_durable_s_per_gib']:.2f}]"
            cells.append(cell)
        out.append(cells)
    return h.markdown_table(["op", "bs", "jobs"] + [f"{c} CPU s/GiB" for c in daemons], out)


def target_cell(op: str, bs: int, a: dict | None, ratio: float | None) -> str:
    """Issue goals: 1 MiB writes and reads >= 0.8x tmpfs; 256 KiB writes p99 < 2 ms."""
    if not a:
        return ""
    if bs == MiB and ratio is not None:
        return f">= {TARGET_TMPFS_RATIO}x tmpfs: {'PASS' if ratio >= TARGET_TMPFS_RATIO else 'FAIL'}"
    if bs == 256 * 1024 and "write" in op:
        return f"p99 < {TARGET_P99_MS:g} ms: {'PASS' if a['p99_ms'] < TARGET_P99_MS else 'FAIL'} ({a['p99_ms']:.2f})"
    return ""


# ------------------------------------------------------------------ profile
def profile_aiturbofs(bench: Bench, bs: int, numjobs: int, op: str) -> dict:
    """One extra (unmeasured) aiturbofs write with py-spy sampling the daemon."""
    import shutil

    pyspy = shutil.which("py-spy")
    if pyspy is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    name = next(c for c in bench.dirs if c.startswith("aiturbofs"))
    pid = bench.mounts[name].proc.pid  # type: ignore[attr-defined]
    d = bench.dirs[name]
    tag = f"{op.replace(' ', '-')}-{bs_label(bs)}x{numjobs}"
    raw = os.path.join(h.RESULTS_DIR, f"profile-aiturbofs-{tag}-{time.strftime('%Y%m%d-%H%M%S')}.txt")
    os.makedirs(h.RESULTS_DIR, exist_ok=True)
    bench.clean(name)
    spy = subprocess.Popen([pyspy, "record", "--pid", str(pid), "--rate", "250", "--nonblocking", "--threads", "--idle",
                            "--format", "raw", "-o", raw], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           start_new_session=True)
    try:
        time.sleep(1.0)  # let py-spy attach
        size = bench.per_job_size(numjobs, bs)
        r = run_fio(d, "write", bs, numjobs, size) if op == "fio write" else run_py_wronly(d, bs, numjobs, size)
    finally:
        spy.send_signal(signal.SIGINT)
        try:
            _, err = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
    bench.after_write(name)
    bench.clean(name)
    if not os.path.exists(raw):
        raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-2000:]}")
    return {"run": r, "raw": raw, "summary": summarize_profile(raw)}


def summarize_profile(raw: str, top: int = 15) -> str:
    """Self and inclusive shares of the frames of the main (trio/FUSE) thread, idle included."""
    threads: dict[str, dict[str, int]] = {}
    for line in open(raw):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        threads.setdefault(frames[0], {})
        threads[frames[0]][";".join(frames[1:])] = threads[frames[0]].get(";".join(frames[1:]), 0) + int(count)

    # trio.run (and with it every FUSE handler) runs on the daemon's main thread
    main = next((t for t in threads if "MainThread" in t), max(threads, key=lambda t: sum(threads[t].values())))
    stacks = threads[main]
    total = sum(stacks.values())
    self_t: dict[str, int] = {}
    incl: dict[str, int] = {}
    for s, n in stacks.items():
        frames = s.split(";")
        self_t[frames[-1]] = self_t.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    lines = [f"thread {main}: {total} samples",
             "self:"] + [f"  {100 * n / total:5.1f}%  {f}" for f, n in sorted(self_t.items(), key=lambda x: -x[1])[:top]]
    lines += ["inclusive:"] + [f"  {100 * n / total:5.1f}%  {f}" for f, n in sorted(incl.items(), key=lambda x: -x[1])[:top + 10]]
    others = {t: sum(s.values()) for t, s in threads.items() if t != main}
    lines += ["other threads (samples, idle included): " + ", ".join(f"{t}={n}" for t, n in others.items())]
    return "\n".join(lines)


# --------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--size-mib", type=int, default=512, help="file size per fio job (default 512)")
    p.add_argument("--max-total-mib", type=int, default=2048, help="bound on numjobs x size; per-job size shrinks to fit (default 2048)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of every config; the table shows medians (default 3)")
    p.add_argument("--workloads", default="256k:1,1m:1,1m:4", help="bs:numjobs list (default 256k:1,1m:1,1m:4)")
    p.add_argument("--ops", default="write,read,wo", help="write,read (fio) and wo (Python O_WRONLY writer); default all")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    p.add_argument("--dram", default="6G", help="aiturbofs -o dram= (default 6G)")
    p.add_argument("--aiturbofs-env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment of the aiturbofs daemon (repeatable), e.g. GLIBC_TUNABLES=glibc.malloc.trim_threshold=...")
    p.add_argument("--settle-s", type=float, default=0.5, help="pause between runs (default 0.5)")
    p.add_argument("--profile", action="store_true",
                   help="after the measured runs, profile the aiturbofs daemon with py-spy during a 1m x1 fio write and O_WRONLY write")
    a = p.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    ops = [o for o in a.ops.split(",") if o]
    workloads = [(parse_bs(w.split(":")[0]), int(w.split(":")[1])) for w in a.workloads.split(",")]
    if os.geteuid() != 0 and "tmpfs" in a.configs:
        raise SystemExit("tmpfs needs root: run as root or pass --configs without tmpfs")

    h.sigterm_as_interrupt()
    results: list[dict] = []
    profiles = []
    with ExitStack() as stack:
        bench = Bench(a, stack)
        bench.mount_all()
        for rep in range(a.repeat):
            for wi, (bs, nj) in enumerate(workloads):
                k = (rep + wi) % len(a.configs)
                order = a.configs[k:] + a.configs[:k]
                for name in order:
                    out = bench.run_one(name, bs, nj, ops)
                    for op, r in out.items():
                        results.append({"rep": rep, "config": name, "op": op, "bs": bs, "numjobs": nj, **r})
                        print(f"rep {rep} {name:12s} {op:18s} {bs_label(bs):>4s} x{nj}: {r['mib_s']:7.0f} MiB/s  "
                              f"p99 {r['p99_ms']:6.2f} ms" + (f"  durable after {r['durable_s']:.1f} s" if r.get("durable_s") else ""),
                              file=sys.stderr, flush=True)
        if a.profile and any(c.startswith("aiturbofs") for c in a.configs):
            for op in ("fio write", "py write O_WRONLY"):
                prof = profile_aiturbofs(bench, MiB, 1, op)
                profiles.append({"op": op, **prof})
                print(f"\n## py-spy of the aiturbofs daemon, {op} 1m x1 ({prof['run']['mib_s']:.0f} MiB/s while sampled)\n"
                      f"```\n{prof['summary']}\n```\n(raw stacks: {prof['raw']})", file=sys.stderr)

    op_names = [o for o in ("fio write", "fio read", "py write O_WRONLY")
                if {"fio write": "write", "fio read": "read", "py write O_WRONLY": "wo"}[o] in ops]
    med = {}
    for c in a.configs:
        for op in op_names:
            for bs, nj in workloads:
                rs = [r for r in results if (r["config"], r["op"], r["bs"], r["numjobs"]) == (c, op, bs, nj)]
                if rs:
                    med[(c, op, bs, nj)] = {k: h.median([r[k] for r in rs]) for k in
                                            ("mib_s", "p99_ms", "cpu_s_per_gib", "main_cpu_s_per_gib", "cpu_to_durable_s_per_gib")
                                            if all(r.get(k) is not None for r in rs)}
    rows = [(op, bs, nj) for op in op_names for bs, nj in workloads]
    sizes = ", ".join(f"{bs_label(bs)}x{nj}: {bench.per_job_size(nj, bs) // MiB} MiB/job" for bs, nj in workloads)
    table = (f"fio psync sequential, median of {a.repeat}; {sizes}; MiB/s (p99 ms)\n\n"
             + build_table(a.configs, rows, med)
             + "\n\nFUSE daemon CPU seconds per GiB moved, main (trio/FUSE) thread / whole process during the I/O"
             + " [aiturbofs: whole process until durable], median:\n\n"
             + build_cpu_table(a.configs, rows, med))
    if profiles:
        table += "\n\n" + "\n\n".join(f"py-spy, aiturbofs daemon, {pr['op']} 1m x1:\n```\n{pr['summary']}\n```" for pr in profiles)
    md, js = h.save_results("fio", table, {"args": vars(a), "results": results,
                                           "profiles": [{k: v for k, v in pr.items()} for pr in profiles]})
    print(table)
    print(f"\nresults: {md} {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: mounts and temp dirs cleaned up", file=sys.stderr)
        sys.exit(130)
