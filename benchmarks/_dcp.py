"""Scenario ``dcp`` of the testbed: PyTorch DCP save and load, one gloo rank per node namespace.

For each aiturbofs mode (``sync_close``, ``plain``, ``grouped``) N rank
processes (``_dcp_rank.py``) start inside the node namespaces with
``nsenter --net=``, join one gloo process group over the fabric network and
build the same DP-replicated model + Adam state (plus a --shard-mib tensor
of their own).  Then, with DCP's own dedup on and off, every rank saves
through its own node's mount into one checkpoint directory; once every file
is durable and every pool emptied, every rank loads it back through its
mount into a fresh state and compares it tensor by tensor.

DCP's dedup: ``DefaultSavePlanner`` keeps each replicated item in one rank's
plan (``dedup_save_plans``, spread by size; ``dedup_save_to_lowest_rank``
would put all on rank 0; ``dedup_replicated_tensors`` is deprecated and has
no effect in torch 2.13).  Without it (``NoDedupSavePlanner``) every rank
writes all replicated items, byte-identical and at the same file offsets,
which is what aiturbofs' grouped mode deduplicates.

What DCP writes per save: ``__<rank>_0.distcp`` from every rank (one file a
rank: ``FileSystemWriter`` defaults to one thread, one file per rank), then,
after a gather, ``.metadata`` from rank 0 (written as ``.metadata.tmp`` and
renamed).  The grouped directory gets ``group.size`` = N, the data files.
``.metadata`` must not count: it is written only after every data file's
close() returned, so with N + 1 the data round would wait its full wait
bound for it; and inheriting ``group.size`` = N it would open a round of
its own that waits for N - 1 files that never come (on 2 nodes rank 0's
dcp.save took 11.3 s instead of ~1 s: the round's 10 s bound).  So ``.metadata.tmp``
is created beforehand with ``group.size`` = 1 (DCP opens it with O_TRUNC,
which keeps the tag): its round closes at once.

The load reuses the directory's tags.  With DCP's dedup every rank reads
every data file: rounds of N readers fill.  Without it the metadata names
the last rank's copy of every replicated item (``FileSystemWriter.finish``
merges the ranks' results in rank order), so every rank reads that file and
all others their own as well, 2N - 1 file opens: the last read round waits
its 10 s bound short of N, which the load time shows.

This module owns the rank processes: each one's stderr goes to
``<run root>/dcp-r<i>.log``, all are killed (their process group, by pid)
when a command fails, times out or a rank dies, and the error names the
rank and shows its stderr tail.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import subprocess
import sys
import time
import zlib

import _harness as h  # benchmarks/ is on sys.path (the testbed's own directory)

MiB = 1 << 20
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dcp_rank.py")
MODES = ("sync_close", "plain", "grouped")
GROUP, GROUP_SIZE = "user.aiturbo.group", "user.aiturbo.group.size"
METADATA_TMP = ".metadata.tmp"  # torch.distributed.checkpoint.filesystem: _metadata_fn + ".tmp"
RANK_START_TIMEOUT_S = 300.0  # N processes importing torch and building the state on two cores
RANK_STEP_TIMEOUT_S = 900.0  # one save or load (write-through at the slowest shaped rate)
RANK_EXIT_TIMEOUT_S = 30.0
DURABLE_TIMEOUT_S = 900.0
ATTR_TIMEOUT_S = 1.1  # the other nodes' kernels see a new directory after this
STDERR_TAIL_CHARS = 3000


class RankError(RuntimeError):
    """A rank process died, failed a command or did not answer in time."""


class RankPool:
    """N rank processes, one per node namespace, driven by one-line JSON commands."""

    def __init__(self, tb, master_ip: str, port: int):
        self.tb = tb
        self.procs: list[subprocess.Popen] = []
        self.logs = [os.path.join(tb.root, f"dcp-r{i}.log") for i in range(tb.n)]
        a = tb.args
        self.argv = [master_ip, str(port), str(a.size_mib * MiB), str(a.shard_mib * MiB)]

    def start(self) -> None:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="fab", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for i, ns in enumerate(self.tb.node_ns):
            with open(self.logs[i], "ab") as log:
                p = subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", sys.executable, RANK_SCRIPT, str(i),
                                      str(self.tb.n), *self.argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, env=env, text=True, start_new_session=True)
            self.procs.append(p)
            self.tb.procs[f"dcp-r{i}"] = p  # the testbed's teardown kills it too, should we never get to stop()
        self._replies("start", RANK_START_TIMEOUT_S)

    def call(self, cmds: list[dict], timeout_s: float = RANK_STEP_TIMEOUT_S) -> list[dict]:
        """Send rank i ``cmds[i]``; every rank's answer, in rank order."""
        for i, (p, cmd) in enumerate(zip(self.procs, cmds)):
            try:
                p.stdin.write(json.dumps(cmd) + "\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                raise self._died(i, cmd["op"]) from None
        return self._replies(cmds[0]["op"], timeout_s)

    def _replies(self, what: str, timeout_s: float) -> list[dict]:
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            for i, p in enumerate(self.procs):
                sel.register(p.stdout, selectors.EVENT_READ, i)
            while len(got) < len(self.procs):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [i for i in range(len(self.procs)) if i not in got]
                    raise RankError(f"DCP {what}: rank(s) {missing} did not answer in {timeout_s:.0f} s; "
                                    f"rank {missing[0]} stderr:\n{self.stderr_tail(missing[0])}")
                for key, _ in sel.select(min(left, 1.0)):
                    i = key.data
                    line = self.procs[i].stdout.readline()
                    if not line:
                        sel.unregister(key.fileobj)
                        raise self._died(i, what)
                    got[i] = json.loads(line)
                    sel.unregister(key.fileobj)
                for i, p in enumerate(self.procs):  # a dead rank leaves the others hanging in a collective
                    if i not in got and p.poll() is not None:
                        raise self._died(i, what)
        return [got[i] for i in range(len(self.procs))]

    def _died(self, i: int, what: str) -> RankError:
        return RankError(f"DCP rank {i} (node n{i}) died during {what} (exit {h.reap(self.procs[i])}); stderr:\n"
                         f"{self.stderr_tail(i)}")

    def stderr_tail(self, i: int) -> str:
        return h.log_tail(self.logs[i], STDERR_TAIL_CHARS)

    def stop(self) -> None:
        """Ask every rank to exit; kill, by process group, any that does not (or any after a failure)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write('{"op": "exit"}\n')
                    p.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + RANK_EXIT_TIMEOUT_S
        for i, p in enumerate(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self.kill(i)

    def kill(self, i: int) -> None:
        h.kill_group(self.procs[i])
        self.tb.procs.pop(f"dcp-r{i}", None)

    def kill_all(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)


def free_port(ns: str, ip: str) -> int:
    """A TCP port nothing listens on at ``ip`` inside namespace ``ns`` (bound, read, released)."""
    code = f"import socket; s = socket.socket(); s.bind(({ip!r}, 0)); print(s.getsockname()[1])"
    out = subprocess.run(["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return int(out.strip())


def checkpoint_files(d: str) -> list[str]:
    return sorted(os.path.join(d, n) for n in os.listdir(d))


def prepare_dir(tb, name: str, mode: str, step: int) -> None:
    """The checkpoint directory (on node 0's mount); grouped: tagged, and the metadata kept out of the data round."""
    d = os.path.join(tb.mounts[0], name)
    os.mkdir(d)
    if mode == "grouped":
        os.setxattr(d, GROUP, f"dcp{step}-{name}".encode())
        os.setxattr(d, GROUP_SIZE, str(tb.n).encode())
        meta = os.path.join(d, METADATA_TMP)
        with open(meta, "wb"):
            pass
        os.setxattr(meta, GROUP_SIZE, b"1")
    time.sleep(ATTR_TIMEOUT_S)


def save_and_load(tb, pool: RankPool, mode: str, dedup: bool, step: int, drop_caches) -> dict:
    name = f"dcp-{mode}-{'dedup' if dedup else 'nodedup'}-{step}"
    prepare_dir(tb, name, mode, step)
    seed = zlib.crc32(f"{tb.run_id}/{name}".encode())  # fresh bytes per save (see _dcp_rank)
    rx0, up0 = tb.s3_rx_bytes(), tb.uploaded_bytes()
    saves = pool.call([{"op": "save", "dir": os.path.join(tb.mounts[i], name), "seed": seed, "dedup": dedup}
                       for i in range(tb.n)])
    t0 = min(r["start"] for r in saves)
    save_s = max(r["end"] for r in saves) - t0
    files = checkpoint_files(os.path.join(tb.mounts[0], name))
    h.wait_durable(files, DURABLE_TIMEOUT_S)
    durable_s = time.monotonic() - t0
    s3_rx = tb.s3_rx_bytes() - rx0
    uploaded = {n: b - up0.get(n, 0) for n, b in tb.uploaded_bytes().items()}
    sizes = {os.path.basename(f): os.stat(f).st_size for f in files}
    drop_caches(tb)
    time.sleep(ATTR_TIMEOUT_S)
    tx0 = tb.s3_tx_bytes()
    loads = pool.call([{"op": "load", "dir": os.path.join(tb.mounts[i], name), "seed": seed} for i in range(tb.n)])
    load_s = max(r["end"] for r in loads) - min(r["start"] for r in loads)
    return {"scenario": "dcp", "mode": mode, "dcp_dedup": dedup, "step": step, "files": len(files),
            "file_bytes": sizes, "dcp_bytes": sum(sizes.values()), "save_s": save_s,
            "save_s_by_rank": [r["end"] - r["start"] for r in saves], "durable_s": durable_s,
            "s3_rx_bytes": s3_rx, "uploaded_by_node": uploaded, "load_s": load_s,
            "load_s3_tx_bytes": tb.s3_tx_bytes() - tx0, "tensors_verified": loads[0]["tensors"]}


def run_mode(tb, mode: str, step: int, *, master_ip: str, drop_caches) -> list[dict]:
    """DCP dedup on, then off, in one aiturbofs mode.

    ``master_ip`` is node 0's fabric address (rank 0 serves the gloo
    rendezvous there); ``drop_caches(tb)`` empties every pool before a load.
    """
    pool = RankPool(tb, master_ip, free_port(tb.node_ns[0], master_ip))
    try:
        pool.start()
        out = []
        for dedup in (True, False):
            r = save_and_load(tb, pool, mode, dedup, step, drop_caches)
            out.append(r)
            print(f"  dcp {mode:10} DCP dedup {'on ' if dedup else 'off'}: save {r['save_s']:.2f} s, durable "
                  f"{r['durable_s']:.2f} s, S3 rx {r['s3_rx_bytes'] / MiB:.1f} MiB for {r['dcp_bytes'] / MiB:.1f} MiB "
                  f"written in {r['files']} files, load {r['load_s']:.2f} s ({r['tensors_verified']} tensors equal)",
                  flush=True)
        pool.stop()
        return out
    finally:
        pool.kill_all()


def table(results: list[dict]) -> str:
    """One row per mode x DCP dedup, then the ratios."""
    rows = [[r["mode"], "on" if r["dcp_dedup"] else "off", str(r["files"]), f"{r['dcp_bytes'] / MiB:.1f}",
             f"{r['save_s']:.2f}", f"{r['durable_s']:.2f}", f"{r['s3_rx_bytes'] / MiB:.1f}",
             f"{r['s3_rx_bytes'] / r['dcp_bytes']:.2f}", f"{r['load_s']:.2f}", f"{r['load_s3_tx_bytes'] / MiB:.1f}"]
            for r in results]
    out = h.markdown_table(["mode", "DCP dedup", "files", "DCP wrote MiB", "save s (slowest rank)", "durable s",
                          "S3 rx MiB", "S3 rx / DCP wrote", "load s", "load S3 tx MiB"], rows)

    def med(mode, dedup, key):
        return h.median([r[key] for r in results if r["mode"] == mode and r["dcp_dedup"] == dedup])

    lines = []
    for dedup in (True, False):
        g = {k: med("grouped", dedup, k) for k in ("save_s", "durable_s", "load_s")}
        if math.isnan(g["save_s"]):  # grouped did not run
            continue
        lines.append(f"DCP dedup {'on' if dedup else 'off'}: write-through/grouped save "
                     f"{med('sync_close', dedup, 'save_s') / g['save_s']:.2f}x; plain/grouped save "
                     f"{med('plain', dedup, 'save_s') / g['save_s']:.2f}x, durable "
                     f"{med('plain', dedup, 'durable_s') / g['durable_s']:.2f}x, load "
                     f"{med('plain', dedup, 'load_s') / g['load_s']:.2f}x")
    for mode in MODES:
        on, off = (med(mode, d, "durable_s") for d in (True, False))
        rx_on, rx_off = (med(mode, d, "s3_rx_bytes") for d in (True, False))
        if not math.isnan(on) and not math.isnan(off):
            lines.append(f"{mode}: DCP dedup off/on durable {off / on:.2f}x, S3 rx {rx_off / rx_on:.2f}x")
    return out + "\n\n" + "\n".join(lines) + "\n"
