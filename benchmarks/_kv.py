"""Testbed scenario ``kv``: KV-cache files with a shared prefix, written on one node, read on the others.

An inference server keeps the KV cache of each prompt in a file; prompts that
start with the same system prompt have byte-identical caches for that prefix.
Here node 0 writes K = 2 x (nodes - 1) such files at once (at least 2): a
shared prefix of --size-mib rounded down to whole chunks (8 MiB,
``CHUNK_BYTES``; at least one chunk), then a unique --shard-mib suffix each.
The prefix is chunk-aligned because the controller deduplicates whole chunks
by their BLAKE3 hash: a prefix ending mid-chunk would make its last chunk
differ in every file, and a misaligned one every chunk.

Modes: ``plain`` (an untagged directory: each file uploaded whole by node 0)
and ``grouped`` (``user.aiturbo.group``, ``group.size`` = K: the round
dedups the prefix and the plan spreads the upload).  Once every file is
durable, two read passes, each reader node opening all of its files at once
and checking each file's sha256:

* ``warm``: the readers' pools are emptied (``aiturbo drop-cache`` once they
  hold no replica any more) while node 0 keeps the files in DRAM, as the
  writer of a KV cache would; file f is read by node 1 + f mod (nodes - 1).
* ``cold``: every pool is emptied, node 0's too; file f is read by the next
  reader (1 + (f + 1) mod (nodes - 1)): a node joins a file's grouped read
  round once per version, so a second read on the same node would not be
  grouped.  With two nodes there is one reader, and its cold pass is the
  plain path in both modes.

With one node, node 0 reads everything itself (warm: from its own pool).  The read rounds
of the grouped directory need ``group.size`` = the (reader, file) pairs of
a pass, K: it is set on the directory and the files after they are durable.

Reported per mode: close() of the slowest writer and time until all files
are durable; bytes the S3 namespace received against the logical bytes
written and the unique bytes; per read pass and reader node: time until its
last file was read, bytes it fetched from S3 (``persist.bytes_fetched``),
chunks it took from peers' DRAM or its read chain
(``cluster.chunks_fetched`` + ``chunks_from_chain``) against the distinct
chunks its files have (the prefix counts once); and the bytes S3 sent.

This module owns the scenario only; ``testbed.py`` builds the cluster and
calls ``scenario_kv`` on the cluster without -o sync_close.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import _harness as h

from aiturbofs._limits import CHUNK_BYTES

MiB = 1 << 20
MODES = ("plain", "grouped")
GROUP, GROUP_SIZE = "user.aiturbo.group", "user.aiturbo.group.size"
DURABLE_TIMEOUT_S = 900.0
READ_TIMEOUT_S = 600.0
ATTR_TIMEOUT_S = 1.1  # the other nodes' kernels see a new directory or xattr after this
SETTLE_TIMEOUT_S = 60.0  # replicas are released by a 1 s housekeeping pass once a file is durable


def layout(nodes: int, size_mib: int, shard_mib: int) -> tuple[int, int, int, list[int]]:
    """(files K, prefix bytes, suffix bytes, reader node of each file)."""
    readers = list(range(1, nodes)) or [0]
    k = max(2, 2 * len(readers))
    prefix = max(CHUNK_BYTES, size_mib * MiB // CHUNK_BYTES * CHUNK_BYTES)
    return k, prefix, max(1, shard_mib) * MiB, [readers[f % len(readers)] for f in range(k)]


def header(a) -> str:
    k, prefix, suffix, _ = layout(a.nodes, a.size_mib, a.shard_mib)
    return (f"kv: node 0 writes {k} KV-cache files ({prefix // MiB} MiB shared prefix, chunk-aligned to "
            f"{CHUNK_BYTES // MiB} MiB, + {suffix // MiB} MiB unique suffix each), then the other "
            f"{max(1, a.nodes - 1)} node(s) read them, each its share; fabric {a.fabric_mbit:g}, "
            f"storage {a.storage_mbit:g}, backend {a.backend_mbit:g} Mbit/s (tbf)")


def _write(path: str, parts: list[bytes], out: dict) -> None:
    t0 = time.monotonic()
    with open(path, "wb", buffering=0) as f:
        for data in parts:
            view = memoryview(data)
            f.writelines(view[off : off + MiB] for off in range(0, len(data), MiB))
    out[path] = time.monotonic() - t0  # open + writes + close()


def _settle(tb, nodes: list[int]) -> None:
    """Wait until ``nodes`` hold no dirty byte and no replica: only then can drop-cache empty them."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while busy := {f"n{i}": (s["pool"]["dirty_bytes"], s["cluster"]["replica_files_held"]) for i in nodes
                   if (s := tb.status(i))["pool"]["dirty_bytes"] or s["cluster"]["replica_files_held"]}:
        if time.monotonic() > deadline:
            raise RuntimeError(f"kv: (dirty bytes, replica files) still held after {SETTLE_TIMEOUT_S:.0f} s: {busy}")
        time.sleep(0.2)


def _empty(tb, nodes: list[int]) -> None:
    """``aiturbo drop-cache`` on ``nodes``, and check their pools are empty."""
    _settle(tb, nodes)
    for i in nodes:
        reply = json.loads(tb.aiturbo("drop-cache", tb.mounts[i]))
        if not reply.get("ok"):
            raise RuntimeError(f"aiturbo drop-cache {tb.mounts[i]}: {reply}")
    left = {f"n{i}": b for i in nodes if (b := tb.status(i)["pool"]["clean_bytes"])}
    if left:
        raise RuntimeError(f"kv: bytes left in the pools after drop-cache: {left}")


def _counters(tb) -> dict[str, tuple[int, int]]:
    """node -> (bytes fetched from the backend, chunks taken from peers)."""
    out = {}
    for i in tb.mounts:
        s = tb.status(i)
        out[f"n{i}"] = (s["persist"]["bytes_fetched"], s["cluster"]["chunks_fetched"] + s["cluster"]["chunks_from_chain"])
    return out


def run_kv(tb, mode: str, step: int) -> dict:
    """Write the K files on node 0 in ``mode``, wait until durable, then the warm and the cold read pass."""
    a = tb.args
    k, prefix_bytes, suffix_bytes, reader_of = layout(tb.n, a.size_mib, a.shard_mib)
    prefix = os.urandom(prefix_bytes)  # fresh bytes: nothing earlier to dedup against
    suffixes = [os.urandom(suffix_bytes) for _ in range(k)]
    want = [hashlib.sha256(prefix + s).hexdigest() for s in suffixes]
    d = f"kv-{mode}-{step}"
    top = os.path.join(tb.mounts[0], d)
    os.mkdir(top)
    if mode == "grouped":
        os.setxattr(top, GROUP, f"kv{step}".encode())
        os.setxattr(top, GROUP_SIZE, str(k).encode())
    names = [os.path.join(d, f"prompt{f}.kv") for f in range(k)]
    paths = [os.path.join(tb.mounts[0], n) for n in names]
    rx0, up0 = tb.s3_rx_bytes(), tb.uploaded_bytes()
    closes: dict = {}
    threads = [threading.Thread(target=_write, args=(p, [prefix, s], closes)) for p, s in zip(paths, suffixes)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(closes) != k:
        raise RuntimeError(f"kv {mode}: {k - len(closes)} writer(s) failed")
    wrote_s = time.monotonic() - t0
    durable_s = h.wait_durable(paths, DURABLE_TIMEOUT_S) + wrote_s
    s3_rx = tb.s3_rx_bytes() - rx0
    uploaded = {n: b - up0.get(n, 0) for n, b in tb.uploaded_bytes().items()}
    plan = tb.status(0)["cluster"]["last_plan"] if mode == "grouped" else None
    if mode == "grouped":  # the read rounds of the group: one report per (reader, file) of a pass
        for p in (*paths, top):
            os.setxattr(p, GROUP_SIZE, str(k).encode())
    time.sleep(ATTR_TIMEOUT_S)
    readers = sorted(set(reader_of))
    _empty(tb, [r for r in readers if r != 0])
    reads = {"warm": _read_pass(tb, names, want, reader_of, f"kv {mode} warm", prefix_bytes, suffix_bytes)}
    cold_of = [readers[(readers.index(r) + 1) % len(readers)] for r in reader_of]
    _empty(tb, sorted(tb.mounts))
    reads["cold"] = _read_pass(tb, names, want, cold_of, f"kv {mode} cold", prefix_bytes, suffix_bytes)
    return {"scenario": "kv", "mode": mode, "step": step, "files": k, "prefix_bytes": prefix_bytes,
            "suffix_bytes": suffix_bytes, "close_s": max(closes.values()), "durable_s": durable_s,
            "written_bytes": k * (prefix_bytes + suffix_bytes), "unique_bytes": prefix_bytes + k * suffix_bytes,
            "s3_rx_bytes": s3_rx, "uploaded_by_node": uploaded, "plan": plan, "reads": reads}


def chunks_needed(files: int, prefix_bytes: int, suffix_bytes: int) -> int:
    """Distinct chunks in ``files`` KV files: the shared prefix once, every suffix (fresh bytes) apart."""
    return prefix_bytes // CHUNK_BYTES + files * -(-suffix_bytes // CHUNK_BYTES) if files else 0


def _read_pass(tb, names: list[str], want: list[str], reader_of: list[int], what: str, prefix_bytes: int,
               suffix_bytes: int) -> dict:
    """Every reader node opens all of its files at once; per-node time, S3 bytes and chunks from peers."""
    readers = sorted(set(reader_of))
    before, tx0 = _counters(tb), tb.s3_tx_bytes()
    paths = [os.path.join(tb.mounts[reader_of[f]], names[f]) for f in range(len(names))]
    ends = h.read_together(paths, want, READ_TIMEOUT_S, what)
    after = _counters(tb)
    read_s = {f"n{r}": max(ends[f] for f in range(len(names)) if reader_of[f] == r) for r in readers}
    return {"read_s_by_node": read_s, "s3_tx_bytes": tb.s3_tx_bytes() - tx0,
            "files_by_node": {f"n{r}": reader_of.count(r) for r in readers},
            "chunks_needed_by_node": {f"n{r}": chunks_needed(reader_of.count(r), prefix_bytes, suffix_bytes)
                                      for r in readers},
            "s3_fetched_by_node": {n: after[n][0] - before[n][0] for n in read_s},
            "peer_chunks_by_node": {n: after[n][1] - before[n][1] for n in read_s}}


def scenario_kv(tb, step: int) -> list[dict]:
    results = []
    for mode in MODES:
        r = run_kv(tb, mode, step)
        results.append(r)
        print(f"  kv {mode:8} close {r['close_s']:.2f} s, durable {r['durable_s']:.2f} s, S3 rx "
              f"{r['s3_rx_bytes'] / MiB:.1f} MiB for {r['written_bytes'] / MiB:.0f} MiB written "
              f"({r['unique_bytes'] / MiB:.0f} unique)", flush=True)
        for name, p in r["reads"].items():
            print(f"    {name} reads: " + " ".join(
                f"{n} {s:.2f} s, {p['s3_fetched_by_node'][n] / MiB:.0f} MiB from S3, "
                f"{p['peer_chunks_by_node'][n]}/{p['chunks_needed_by_node'][n]} chunks from peers;"
                for n, s in sorted(p["read_s_by_node"].items())) + f" S3 sent {p['s3_tx_bytes'] / MiB:.0f} MiB",
                flush=True)
    return results


def table(results: list[dict]) -> str:
    def per_node(d: dict, fmt) -> str:
        return " ".join(f"{n}:{fmt(v)}" for n, v in sorted(d.items()))

    rows = [[r["mode"], f"{r['close_s']:.2f}", f"{r['durable_s']:.2f}", f"{r['written_bytes'] / MiB:.0f}",
             f"{r['unique_bytes'] / MiB:.0f}", f"{r['s3_rx_bytes'] / MiB:.0f}", f"{r['s3_rx_bytes'] / r['written_bytes']:.2f}",
             f"{r['s3_rx_bytes'] / r['unique_bytes']:.2f}", per_node(r["uploaded_by_node"], lambda v: f"{v / MiB:.0f}")]
            for r in results]
    out = h.markdown_table(["mode", "close s (slowest)", "durable s", "written MiB", "unique MiB", "S3 rx MiB",
                            "S3 rx / written", "S3 rx / unique", "MiB uploaded per node"], rows)
    rows = [[r["mode"], name, per_node(p["read_s_by_node"], lambda v: f"{v:.2f}"),
             per_node(p["s3_fetched_by_node"], lambda v: f"{v / MiB:.0f}"),
             per_node({n: f"{c}/{p['chunks_needed_by_node'][n]}" for n, c in p["peer_chunks_by_node"].items()}, str),
             f"{p['s3_tx_bytes'] / MiB:.0f}"]
            for r in results for name, p in r["reads"].items()]
    out += "\n\n" + h.markdown_table(["mode", "read pass", "read s per reader", "MiB from S3 per reader",
                                        "chunks from peers / needed per reader", "S3 tx MiB"], rows)
    med = {m: {k: h.median([r[k] for r in results if r["mode"] == m]) for k in ("close_s", "durable_s", "s3_rx_bytes")}
           for m in MODES if any(r["mode"] == m for r in results)}
    if len(med) == 2:
        p, g = med["plain"], med["grouped"]
        out += (f"\n\nplain/grouped close {p['close_s'] / g['close_s']:.2f}x, durable {p['durable_s'] / g['durable_s']:.2f}x, "
                f"S3 bytes received {p['s3_rx_bytes'] / g['s3_rx_bytes']:.2f}x\n")
    return out
