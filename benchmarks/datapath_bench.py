#!/usr/bin/env python3
"""The FUSE data paths side by side in one run: close(), daemon CPU, torch.save, safetensors load.

    python benchmarks/datapath_bench.py [--size-mib 1024] [--repeat 3] [--configs passthrough,pyfuse3,tmpfs]

Mounts every config for the whole run (aiturbofs with ``-o datapath=``
passthrough / kernel / pyfuse3 over a file:// backend in a temp dir, and a
private tmpfs as the kernel-only reference) and, each repetition in a
rotating order, measures:

* ``py O_WRONLY`` — 1 MiB ``pwrite`` calls from a Python process that opened
  the file O_WRONLY (torch.save and safetensors write this way): MiB/s, the
  seconds close() takes after the last write (the daemon hashes and commits
  then), and the daemon's CPU seconds per GiB from open() until close()
  returned (user + system);
* ``torch.save`` — a state dict of float32 tensors totalling ``--size-mib``,
  seconds from the call to its return (it closes the file);
* ``safetensors load`` — ``safetensors.torch.load_file`` (mmap) of a file
  of that size written just before (warm: its bytes are local), seconds,
  every tensor touched (summed).

Each file is durable (not timed) before the next step.  The table shows
medians and each aiturbofs config's ratio to tmpfs.  Results:
benchmarks/results/datapath-<time>.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
DURABLE_TIMEOUT_S = 600.0
TENSOR_MIB = 64


def py_wronly(path: str, size: int, pid: int | None) -> dict:
    r = h.py_wronly(path, size, pid)
    r["cpu_s_per_gib"] = (r["user_s"] + r["sys_s"]) / (size / GiB) if pid else None
    return r


def state_dict(size: int):
    import torch

    n = max(1, size // (TENSOR_MIB * MiB))
    return {f"layer{i}.weight": torch.rand(TENSOR_MIB * MiB // 4) for i in range(n)}


def torch_save(path: str, sd) -> dict:
    import torch

    t0 = time.monotonic()
    torch.save(sd, path)
    return {"s": time.monotonic() - t0}


def safetensors_load(path: str) -> dict:
    from safetensors.torch import load_file

    t0 = time.monotonic()
    loaded = load_file(path)
    total = sum(float(t.sum()) for t in loaded.values())  # every page read
    return {"s": time.monotonic() - t0, "check": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--size-mib", type=int, default=1024, help="file / state dict size (default 1024)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; the table shows medians (default 3)")
    p.add_argument("--configs", default="passthrough,pyfuse3,tmpfs",
                   help="aiturbofs data paths (passthrough, kernel, pyfuse3; passthrough-dram: with -o kernel_writes=dram) "
                        "and tmpfs (default passthrough,pyfuse3,tmpfs)")
    p.add_argument("--dram", default="6G", help="aiturbofs -o dram= (default 6G)")
    a = p.parse_args(argv)
    configs = [c for c in a.configs.split(",") if c]
    size = a.size_mib * MiB
    if os.geteuid() != 0:
        raise SystemExit("run as root: tmpfs and FUSE mounts")
    h.sigterm_as_interrupt()
    results: list[dict] = []
    with ExitStack() as stack:
        tmp = h.temp_dir("aiturbo-datapath-")
        stack.callback(h.remove_tree, tmp)
        dirs: dict[str, str] = {}
        pids: dict[str, int | None] = {}
        for c in configs:
            mnt = os.path.join(tmp, f"mnt-{c}")
            if c == "tmpfs":
                m = h.TmpfsMount(mnt, 3 * size + 256 * MiB).start()
                stack.callback(m.stop)
                pids[c] = None
            else:
                backend = os.path.join(tmp, f"backend-{c}")
                os.makedirs(backend)
                opts = {"dram": a.dram, "datapath": c.removesuffix("-dram")}
                if c.endswith("-dram"):
                    opts["kernel_writes"] = "dram"  # the files the kernel writes on the staging tmpfs
                am = h.start_aiturbofs(f"file://{backend}", mnt, os.path.join(tmp, f"state-{c}"), opts)
                stack.callback(h.stop_aiturbofs, am)
                pids[c] = am.proc.pid
            dirs[c] = mnt
        sd = state_dict(size)
        from safetensors.torch import save_file

        for rep in range(a.repeat):
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]
            for c in order:
                d = dirs[c]

                def settle(*paths: str, config: str = c) -> None:
                    if config != "tmpfs":
                        h.wait_durable(list(paths), DURABLE_TIMEOUT_S)

                r = py_wronly(os.path.join(d, "wo.bin"), size, pids[c])
                settle(os.path.join(d, "wo.bin"))
                r.update({f"save_{k}": v for k, v in torch_save(os.path.join(d, "sd.pt"), sd).items()})
                settle(os.path.join(d, "sd.pt"))
                save_file(sd, os.path.join(d, "m.safetensors"))
                settle(os.path.join(d, "m.safetensors"))
                r.update({f"load_{k}": v for k, v in safetensors_load(os.path.join(d, "m.safetensors")).items()})
                for name in ("wo.bin", "sd.pt", "m.safetensors"):
                    os.unlink(os.path.join(d, name))
                results.append({"rep": rep, "config": c, **r})
                print(f"rep {rep} {c:12s} O_WRONLY {r['mib_s']:6.0f} MiB/s close {r['close_s']:.3f} s"
                      + (f" cpu {r['cpu_s_per_gib']:.2f} s/GiB" if r["cpu_s_per_gib"] is not None else "")
                      + f"  torch.save {r['save_s']:.2f} s  safetensors load {r['load_s']:.2f} s",
                      file=sys.stderr, flush=True)
    med = {c: {k: h.median([r[k] for r in results if r["config"] == c])
               for k in ("mib_s", "close_s", "save_s", "load_s")} for c in configs}
    for c in configs:
        cpus = [r["cpu_s_per_gib"] for r in results if r["config"] == c and r["cpu_s_per_gib"] is not None]
        med[c]["cpu_s_per_gib"] = h.median(cpus) if cpus else None
    ref = med.get("tmpfs")
    rows = []
    for c in configs:
        m = med[c]
        cells = [c if c == "tmpfs" else f"aiturbofs {c}", f"{m['mib_s']:.0f}", f"{m['close_s']:.3f}",
                 f"{m['cpu_s_per_gib']:.2f}" if m["cpu_s_per_gib"] is not None else "-",
                 f"{m['save_s']:.2f}", f"{m['load_s']:.2f}"]
        if ref:
            cells += [f"{m['mib_s'] / ref['mib_s']:.2f}x", f"{m['save_s'] / ref['save_s']:.2f}x",
                      f"{ref['load_s'] / m['load_s']:.2f}x"]
        rows.append(cells)
    header = ["config", "O_WRONLY MiB/s", "close() s", "daemon CPU s/GiB to close", "torch.save s",
              "safetensors load s"]
    if ref:
        header += ["write / tmpfs", "torch.save time / tmpfs", "load speed / tmpfs"]
    table = (f"{a.size_mib} MiB per file, median of {a.repeat}, configs interleaved in one run\n\n"
             + h.markdown_table(header, rows))
    md, js = h.save_results("datapath", table, {"args": vars(a), "results": results, "machine": h.machine_info()})
    print(table)
    print(f"\nresults: {md} {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: mounts and temp dirs cleaned up", file=sys.stderr)
        sys.exit(130)
