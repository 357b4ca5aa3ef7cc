"""Testbed scenario ``load``: N nodes load one Hugging Face-style model from the bucket at once (inference autoscaling).

The model is already in the bucket, put there by another client, not
through aiturbofs: ``config.json``, ``tokenizer.json``,
``tokenizer_config.json``, ``model-0000k-of-0000M.safetensors`` shards
(real safetensors files of float16 numpy tensors with Llama-style names,
about --size-mib in all, M shards of about --shard-mib, at least 2) and
``model.safetensors.index.json`` (its ``weight_map``).  boto3 uploads it
from inside the S3 namespace to that namespace's own address, i.e. over its
loopback: neither shaped nor counted (checked: the counted link must not
carry it).  Every run gets its own directory of fresh bytes, so no file,
page or pool entry of an earlier run can serve it.

Before the clock starts, every reading node lists the directory and stats
every file until all are there at full size (the mount imports bucket
listings; the testbed's ``import_ttl`` is 0.5 s): what is measured is the
load, not the discovery.  Then N nodes load at once, one process per node
(``_load_reader.py``, started and its imports done beforehand) reading
through that node's mountpoint as transformers does: the json files, then
every shard with ``safetensors.safe_open(framework="np")``, every tensor
into a checksum that is compared with what was uploaded.

Modes (``MOUNT_OPTIONS`` is the one place that says how a mode mounts):

* ``plain``: ``-o autogroup=off``, no tags.
* ``tagged``: ``-o autogroup=off``; before the load the directory and each
  file get ``user.aiturbo.group`` = a job id and ``group.size`` = N (files
  too: the importer creates them before the directory is tagged, and tags
  are copied only at creation).
* ``autogroup``: ``-o autogroup=on``, no tags.

Each mode runs cold (every pool emptied with ``aiturbo drop-cache``) with
N = 1 and N = nodes; ``tagged`` and ``autogroup`` then load the same
directory again right after the N = nodes run (``warm``: the pools as the
first load left them; each loader first drops the kernel's cached pages of
the files, so the reads reach the daemons).  The modes that mount alike
share one cluster (``Testbed.start_cluster(options=...)``).  A daemon that
does not know ``-o autogroup`` yet (``aiturbofs.node.parse_options``
refuses it) has no automatic grouping, which is what ``off`` asks for:
``plain`` and ``tagged`` then mount without the option and ``autogroup`` is
skipped with a note.

External peers (``--peers``, ``_peers.PeerMounts`` with ``read_only``):
``rclone`` and ``s3fs-fuse`` are modes of ``load`` too, cold only: each
reading node mounts the bucket read-only in its namespace (so its reads
cross its shaped storage link) and loads the same way.  ``s3fs-direct`` has
no filesystem to load from and is left out.

Reported per run: time until the slowest node finished, each node's time,
node 0's first-byte latency (from the call that opens the first shard until
it returned: safe_open maps the file and reads its header), the bytes the S3
namespace sent during the load (its only interface's counter: data, HTTP and
listings) and that over the model's bytes, and for aiturbofs each daemon's
``persist.bytes_fetched``.  Then the goals: storage/model <= 1.05 for tagged
and autogroup; time(N = nodes)/time(N = 1) <= 1.2; tagged and autogroup at
least 2.5x faster than plain with N = nodes; the warm load fetches nothing
from storage; autogroup's lone reader (N = 1) gets its first byte within 5%
of plain's.

This module owns the scenario, the uploads and the loader processes (killed,
by process group, when a load fails or times out); ``testbed.py`` builds the
namespaces and calls ``scenario_load`` (which starts and stops its own
clusters) and, once no aiturbofs daemon runs, ``run_peers``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import selectors
import shutil
import subprocess
import sys
import threading
import time
import zlib

import _harness as h
import _peers as peers

from aiturbofs._errors import ConfigError
from aiturbofs._limits import CHUNK_BYTES
from aiturbofs.node import parse_options

KiB, MiB = 1 << 10, 1 << 20
MODES = ("plain", "tagged", "autogroup")
# mode -> the daemons' extra -o options (the only place that says how a mode mounts)
MOUNT_OPTIONS = {"plain": {"autogroup": "off"}, "tagged": {"autogroup": "off"}, "autogroup": {"autogroup": "on"}}
TAGGED_MODES = ("tagged",)  # the model directory and its files carry user.aiturbo.group
WARM_MODES = ("tagged", "autogroup")  # a second load right after the N = nodes one
PEER_MODES = ("rclone", "s3fs-fuse")  # the external peers that can be mounted and read
GROUP, GROUP_SIZE = "user.aiturbo.group", "user.aiturbo.group.size"
LOADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_load_reader.py")
JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")

# the model: Llama-style layers of 4 h x h attention and 3 h x 3h MLP float16 matrices, two norms
LAYER_WEIGHTS_PER_H2 = 13
DTYPE_BYTES = 2
HIDDEN_MIN = 64
LAYERS_MIN = 8  # the hidden size doubles while the model still has this many layers
VOCAB_PER_HIDDEN = 4
FP16_FINITE_MASK = 0xBFFF  # clears the top exponent bit of random float16 bits: no inf, no NaN, |x| < 2

# goals
STORAGE_PER_MODEL_MAX = 1.05
SCALING_MAX = 1.2  # time(N = nodes) / time(N = 1)
SPEEDUP_MIN = 2.5  # plain / grouped time at N = nodes
FIRST_BYTE_SLACK = 0.05  # autogroup's lone reader vs plain

ATTR_TIMEOUT_S = 1.1  # the other nodes' kernels see a new xattr after this
UPLOAD_TIMEOUT_S = 600.0
UPLOAD_COUNTED_MAX = 0.05  # share of the model the counted link may carry during an upload (other traffic)
VISIBLE_TIMEOUT_S = 60.0  # until every reading node lists every file of a fresh upload
READY_TIMEOUT_S = 120.0  # N loaders importing numpy and safetensors on two busy cores
LOAD_TIMEOUT_S = 600.0
STDERR_TAIL_CHARS = 2000


class LoadError(RuntimeError):
    """A load could not be measured: upload, import, a loader, or wrong bytes; names the run and the node."""


# ============================================================== the model

def model_plan(size_bytes: int, shard_bytes: int) -> dict:
    """Hidden size, vocabulary, layers and the shards' tensors [(name, shape)] of a model of about ``size_bytes``."""
    hidden = HIDDEN_MIN
    while LAYER_WEIGHTS_PER_H2 * (2 * hidden) ** 2 * DTYPE_BYTES * LAYERS_MIN <= size_bytes:
        hidden *= 2
    vocab = VOCAB_PER_HIDDEN * hidden
    layer_bytes = (LAYER_WEIGHTS_PER_H2 * hidden + 2) * hidden * DTYPE_BYTES
    layers = max(1, (size_bytes - 2 * vocab * hidden * DTYPE_BYTES) // layer_bytes)
    specs = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + f"self_attn.{m}_proj.weight", (hidden, hidden)) for m in "qkvo"]
        specs += [(p + "mlp.gate_proj.weight", (3 * hidden, hidden)), (p + "mlp.up_proj.weight", (3 * hidden, hidden)),
                  (p + "mlp.down_proj.weight", (hidden, 3 * hidden)),
                  (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    specs += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return {"hidden": hidden, "vocab": vocab, "layers": layers, "shards": split_shards(specs, shard_bytes)}


def split_shards(specs: list[tuple[str, tuple]], shard_bytes: int) -> list[list[tuple[str, tuple]]]:
    """Consecutive tensors into M = round(total / shard_bytes) shards of about equal size (at least 2)."""
    sizes = [math.prod(shape) * DTYPE_BYTES for _name, shape in specs]
    total = sum(sizes)
    m = min(len(specs), max(2, round(total / max(1, shard_bytes))))
    shards: list[list] = [[] for _ in range(m)]
    offset = 0
    for spec, size in zip(specs, sizes):
        shards[min(m - 1, offset * m // total)].append(spec)
        offset += size
    return [s for s in shards if s]


def _weights(rng, shape: tuple):
    import numpy as np

    bits = np.frombuffer(rng.bytes(math.prod(shape) * DTYPE_BYTES), dtype=np.uint16) & FP16_FINITE_MASK
    return bits.view(np.float16).reshape(shape)


def build_model(dst: str, size_bytes: int, shard_bytes: int, seed: int) -> dict:
    """Write the model directory into ``dst``; what a loader must find: tensor checksums, json sha256, file sizes."""
    import numpy as np
    from _load_reader import checksum
    from safetensors.numpy import save_file

    plan = model_plan(size_bytes, shard_bytes)
    rng = np.random.default_rng(seed)
    m, weight_map, sums, tensor_bytes = len(plan["shards"]), {}, {}, 0
    for k, shard in enumerate(plan["shards"], 1):
        fname = f"model-{k:05d}-of-{m:05d}.safetensors"
        tensors = {name: _weights(rng, shape) for name, shape in shard}
        save_file(tensors, os.path.join(dst, fname), metadata={"format": "pt"})
        for name, arr in tensors.items():
            sums[name], weight_map[name] = checksum(arr), fname
            tensor_bytes += arr.nbytes
    hidden, vocab = plan["hidden"], plan["vocab"]
    docs = {
        "config.json": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
                        "intermediate_size": 3 * hidden, "num_hidden_layers": plan["layers"],
                        "num_attention_heads": max(1, hidden // 64), "vocab_size": vocab, "torch_dtype": "float16",
                        "tie_word_embeddings": False},
        "tokenizer.json": {"version": "1.0", "added_tokens": [{"id": 0, "content": "<s>", "special": True}],
                           "model": {"type": "BPE", "vocab": {f"tok{i}": i for i in range(vocab)}, "merges": []}},
        "tokenizer_config.json": {"bos_token": "<s>", "model_max_length": 4096, "tokenizer_class": "LlamaTokenizer"},
        "model.safetensors.index.json": {"metadata": {"total_size": tensor_bytes},
                                         "weight_map": dict(sorted(weight_map.items()))},
    }
    digests = {}
    for name, doc in docs.items():
        text = json.dumps(doc, indent=2).encode()
        with open(os.path.join(dst, name), "wb") as f:
            f.write(text)
        digests[name] = hashlib.sha256(text).hexdigest()
    files = {name: os.path.getsize(os.path.join(dst, name)) for name in sorted(os.listdir(dst))}
    return {"tensors": sums, "json_sha256": digests, "files": files, "shards": m}


_UPLOADER = r"""
import os, sys
import boto3
from botocore.config import Config
endpoint, bucket, prefix, src = sys.argv[1:5]
c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}))
for name in sorted(os.listdir(src)):
    c.upload_file(os.path.join(src, name), bucket, prefix + "/" + name)
print("uploaded", flush=True)
"""


def publish(tb, name: str, *, endpoint: str, bucket: str) -> dict:
    """A fresh model under ``name/`` in the bucket, uploaded from inside the S3 namespace; its expectations.

    The expectations (``build_model``'s dict, plus ``path``: the json file
    the loaders compare with) stay in the run's temp dir; the model's own
    files are removed once uploaded.
    """
    a = tb.args
    src = os.path.join(tb.root, f"{name}-src")
    os.makedirs(src)
    try:
        expected = build_model(src, a.size_mib * MiB, a.shard_mib * MiB, zlib.crc32(f"{tb.run_id}/{name}".encode()))
        model_bytes = sum(expected["files"].values())
        rx0 = tb.s3_rx_bytes()
        p = subprocess.run(["ip", "netns", "exec", tb.s3_ns, sys.executable, "-c", _UPLOADER, endpoint, bucket, name, src],
                           capture_output=True, text=True, timeout=UPLOAD_TIMEOUT_S, check=False)
        if p.returncode != 0 or "uploaded" not in p.stdout:
            raise LoadError(f"load {name}: upload failed ({p.returncode}): {p.stderr[-STDERR_TAIL_CHARS:]}")
        counted = tb.s3_rx_bytes() - rx0
        if counted > UPLOAD_COUNTED_MAX * model_bytes:
            raise LoadError(f"load {name}: the upload crossed the counted storage link ({counted} bytes)")
    finally:
        shutil.rmtree(src, ignore_errors=True)
    expected["path"] = os.path.join(tb.root, f"{name}-expected.json")
    with open(expected["path"], "w") as f:
        json.dump(expected, f)
    expected["model_bytes"] = model_bytes
    return expected


def wait_visible(dirs: dict[int, str], sizes: dict[str, int], what: str) -> None:
    """Until every node's view of its directory lists every file at full size (the mounts import the listing)."""
    deadline = time.monotonic() + VISIBLE_TIMEOUT_S

    def complete(d: str) -> bool:
        try:
            return sizes.keys() <= set(os.listdir(d)) and all(
                os.stat(os.path.join(d, n)).st_size == s for n, s in sizes.items())
        except FileNotFoundError:
            return False

    for i, d in dirs.items():
        while not complete(d):
            if time.monotonic() > deadline:
                raise LoadError(f"{what}: n{i} does not list the uploaded model after {VISIBLE_TIMEOUT_S:.0f} s")
            time.sleep(0.2)


def tag(top: str, job: str, readers: int) -> None:
    """``user.aiturbo.group`` and ``group.size`` on the directory and each of its files."""
    for p in (top, *(os.path.join(top, n) for n in sorted(os.listdir(top)))):
        os.setxattr(p, GROUP, job.encode())
        os.setxattr(p, GROUP_SIZE, str(readers).encode())


# ============================================================== loader processes

class Loaders:
    """One ``_load_reader.py`` process per reading node, started (imports done) before the clock, released at once."""

    def __init__(self, tb, dirs: dict[int, str], expected_path: str, what: str, *, evict: bool):
        self.tb, self.dirs, self.what = tb, dirs, what
        self.argv = [expected_path, *(["--evict"] if evict else [])]
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs = {i: os.path.join(tb.root, f"load-n{i}.log") for i in dirs}

    def start(self) -> None:
        for i, d in self.dirs.items():
            with open(self.logs[i], "ab") as log:
                p = subprocess.Popen([sys.executable, LOADER, self.argv[0], d, *self.argv[1:]], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
            self.procs[i] = p
            self.tb.procs[f"load-n{i}"] = p  # the testbed's teardown kills it too, should we never get to close()
        self._replies("start", READY_TIMEOUT_S)

    def run(self, timeout_s: float) -> dict[int, dict]:
        """Release every loader; node -> its answer (``_load_reader``'s JSON line)."""
        for i, p in self.procs.items():
            try:
                p.stdin.write("go\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                raise self._died(i, "load") from None
        return self._replies("load", timeout_s)

    def _replies(self, step: str, timeout_s: float) -> dict[int, dict]:
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            for i, p in self.procs.items():
                sel.register(p.stdout, selectors.EVENT_READ, i)
            while len(got) < len(self.procs):
                left = deadline - time.monotonic()
                if left <= 0:
                    late = [i for i in self.procs if i not in got]
                    raise LoadError(f"{self.what}: loader(s) on {', '.join(f'n{i}' for i in late)} did not answer "
                                    f"the {step} in {timeout_s:.0f} s; n{late[0]} stderr:\n{self.stderr_tail(late[0])}")
                for key, _ in sel.select(min(left, 1.0)):
                    line = key.fileobj.readline()
                    if not line:
                        raise self._died(key.data, step)
                    got[key.data] = json.loads(line)
                    sel.unregister(key.fileobj)
        return got

    def _died(self, i: int, step: str) -> LoadError:
        return LoadError(f"{self.what}: loader on n{i} died during the {step} (exit {h.reap(self.procs[i])}); "
                         f"stderr:\n{self.stderr_tail(i)}")

    def stderr_tail(self, i: int) -> str:
        return h.log_tail(self.logs[i], STDERR_TAIL_CHARS)

    def close(self) -> None:
        """Kill (by process group) any loader still running; never raises."""
        for i, p in self.procs.items():
            h.kill_group(p)
            self.tb.procs.pop(f"load-n{i}", None)


# ============================================================== one load

def measure(tb, mode: str, step: int, phase: str, dirs: dict[int, str], expected: dict, *,
            timeout_s: float = LOAD_TIMEOUT_S, daemons: bool = True) -> dict:
    """Every node in ``dirs`` loads its view of the model at once; the run's row.

    ``phase``: ``cold`` or ``warm`` (the loaders first drop the kernel's
    pages of the files).  ``daemons``: aiturbofs mounts, whose
    ``persist.bytes_fetched`` each node reports.
    """
    n = len(dirs)
    what = f"load {mode} N={n} {phase}"
    loaders = Loaders(tb, dirs, expected["path"], what, evict=phase == "warm")
    try:
        loaders.start()
        fetched0 = _fetched(tb) if daemons else {}
        tx0 = tb.s3_tx_bytes()
        out = loaders.run(timeout_s)
        s3_tx = tb.s3_tx_bytes() - tx0
        fetched = {k: b - fetched0[k] for k, b in _fetched(tb).items()} if daemons else None
    finally:
        loaders.close()
    wrong = {f"n{i}": r["wrong"][:5] for i, r in out.items() if r["wrong"]}
    if wrong:
        raise LoadError(f"{what}: loaded other bytes than were uploaded: {wrong}")
    start = min(r["start"] for r in out.values())
    return {"scenario": "load", "mode": mode, "step": step, "readers": n, "phase": phase,
            "load_s": max(r["end"] for r in out.values()) - start,
            "load_s_by_node": {f"n{i}": r["end"] - r["start"] for i, r in sorted(out.items())},
            "first_byte_s": out[min(out)]["first_byte_s"],
            "first_byte_s_by_node": {f"n{i}": r["first_byte_s"] for i, r in sorted(out.items())},
            "s3_tx_bytes": s3_tx, "model_bytes": expected["model_bytes"], "shards": expected["shards"],
            "tensors": out[min(out)]["tensors"], "fetched_by_node": fetched}


def _fetched(tb) -> dict[str, int]:
    return {f"n{i}": tb.status(i)["persist"]["bytes_fetched"] for i in tb.mounts}


def reader_counts(nodes: int) -> list[int]:
    return sorted({1, nodes})


def _say(r: dict) -> None:
    fetched = r["fetched_by_node"]
    print(f"  load {r['mode']:9} N={r['readers']} {r['phase']}: {r['load_s']:.2f} s (slowest), first byte "
          f"{r['first_byte_s'] * 1000:.0f} ms, S3 sent {r['s3_tx_bytes'] / MiB:.1f} MiB for "
          f"{r['model_bytes'] / MiB:.1f} MiB" + (f", fetched {_per_node_mib(fetched)} MiB" if fetched else ""),
          flush=True)


def run_mode(tb, mode: str, readers: int, step: int, *, drop_caches, endpoint: str, bucket: str) -> list[dict]:
    """A cold load of a fresh upload by nodes 0..readers-1, and in WARM_MODES at N = nodes the warm one after it."""
    name = f"load-{mode}-n{readers}-{step}"
    expected = publish(tb, name, endpoint=endpoint, bucket=bucket)
    dirs = {i: os.path.join(tb.mounts[i], name) for i in range(readers)}
    wait_visible(dirs, expected["files"], f"load {mode} N={readers}")
    if mode in TAGGED_MODES:
        tag(dirs[0], f"load-{mode}-{readers}-{step}", readers)
        time.sleep(ATTR_TIMEOUT_S)
    drop_caches(tb)
    rows = [measure(tb, mode, step, "cold", dirs, expected)]
    _say(rows[-1])
    if mode in WARM_MODES and readers == tb.n:
        rows.append(measure(tb, mode, step, "warm", dirs, expected))
        _say(rows[-1])
    return rows


FIRST_BYTE_OBJECTS = 7  # fresh objects node 0 opens alone, one after another, for the first-byte figure
FIRST_BYTE_OBJECT_BYTES = 2 * CHUNK_BYTES
FIRST_BYTE_READ_BYTES = 4096
FIRST_BYTE_MODES = ("plain", "autogroup")  # the lone reader with autogroup off and on


def probe_first_byte(tb, mode: str, step: int, *, drop_caches, endpoint: str, bucket: str) -> dict:
    """Node 0 alone opens FIRST_BYTE_OBJECTS fresh objects in turn: open() to the first read's return, each.

    One model load gives one first byte; these are several on the same
    cluster, so the median says what a lone reader pays for ``mode``.
    """
    name = f"first-byte-{mode}-{step}"
    src = os.path.join(tb.root, f"{name}-src")
    os.makedirs(src)
    try:
        for k in range(FIRST_BYTE_OBJECTS):
            with open(os.path.join(src, f"object-{k}.bin"), "wb") as f:
                f.write(os.urandom(FIRST_BYTE_OBJECT_BYTES))
        p = subprocess.run(["ip", "netns", "exec", tb.s3_ns, sys.executable, "-c", _UPLOADER, endpoint, bucket, name, src],
                           capture_output=True, text=True, timeout=UPLOAD_TIMEOUT_S, check=False)
        if p.returncode != 0 or "uploaded" not in p.stdout:
            raise LoadError(f"{name}: upload failed ({p.returncode}): {p.stderr[-STDERR_TAIL_CHARS:]}")
        sizes = {f: FIRST_BYTE_OBJECT_BYTES for f in os.listdir(src)}
    finally:
        shutil.rmtree(src, ignore_errors=True)
    top = os.path.join(tb.mounts[0], name)
    wait_visible({0: top}, sizes, name)
    drop_caches(tb)
    times = []
    for f in sorted(sizes):
        start = time.perf_counter()
        with open(os.path.join(top, f), "rb", buffering=0) as fh:
            if len(fh.read(FIRST_BYTE_READ_BYTES)) != FIRST_BYTE_READ_BYTES:
                raise LoadError(f"{name}/{f}: short first read")
            times.append(time.perf_counter() - start)
    row = {"scenario": "load", "mode": mode, "step": step, "phase": "first-byte", "readers": 1,
           "first_byte_samples_s": times, "first_byte_s": h.median(times)}
    print(f"  load {mode:9} lone first byte: median {row['first_byte_s'] * 1000:.0f} ms of {len(times)} fresh objects "
          f"({', '.join(f'{t * 1000:.0f}' for t in times)} ms)", flush=True)
    return row


def autogroup_support() -> str | None:
    """None when the daemons take ``-o autogroup=on|off``, else why not (the option parser's words)."""
    try:
        parse_options("autogroup=on")
        parse_options("autogroup=off")
    except ConfigError as exc:
        return str(exc)
    return None


def daemon_options(mode: str, unsupported: str | None) -> dict | None:
    """The -o options of ``mode``'s cluster; None when the daemons cannot mount it (``unsupported``: why)."""
    opts = dict(MOUNT_OPTIONS[mode])
    if unsupported is not None and "autogroup" in opts:
        if opts["autogroup"] != "off":
            return None
        del opts["autogroup"]  # no automatic grouping exists yet: what off asks for
    return opts


def scenario_load(tb, repeat: int, *, drop_caches, endpoint: str, bucket: str) -> list[dict]:
    """Every aiturbofs mode, ``repeat`` times, on one cluster per distinct set of mount options."""
    unsupported = autogroup_support()
    rows: list[dict] = []
    clusters: dict[tuple, list[str]] = {}
    for mode in MODES:
        opts = daemon_options(mode, unsupported)
        if opts is None:
            print(f"  load {mode}: skipped, the daemons cannot mount it: {unsupported}", flush=True)
            rows += [{"scenario": "load", "mode": mode, "step": s, "skipped": unsupported} for s in range(repeat)]
        else:
            clusters.setdefault(tuple(sorted(opts.items())), []).append(mode)
    for opts, modes in clusters.items():
        shown = ",".join(f"{k}={v}" for k, v in opts)
        print(f"starting {tb.n} daemons{f' with -o {shown}' if shown else ''} for load ({', '.join(modes)}) ...", flush=True)
        tb.start_cluster(sync_close=False, options=dict(opts))
        for step in range(repeat):
            for mode in modes:
                for readers in reader_counts(tb.n):
                    rows += [dict(r, mount_options=dict(opts)) for r in
                             run_mode(tb, mode, readers, step, drop_caches=drop_caches, endpoint=endpoint, bucket=bucket)]
                if mode in FIRST_BYTE_MODES:
                    rows.append(dict(probe_first_byte(tb, mode, step, drop_caches=drop_caches, endpoint=endpoint,
                                                      bucket=bucket), mount_options=dict(opts)))
        tb.stop_cluster()
    return rows


# ============================================================== external peers

def _peer_limit_s(tb, model_bytes: int, readers: int) -> float:
    a = tb.args
    ideal_s = readers * model_bytes * 8 / 1e6 / min(a.backend_mbit, readers * a.storage_mbit)
    return peers.TIMEOUT_BASE_S + peers.TIMEOUT_SLACK * ideal_s


def _bounded(fn, limit_s: float, what: str) -> None:
    """``fn()`` in a thread: a peer mount that hangs costs ``limit_s``, not the run."""
    err: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            err.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        raise LoadError(f"{what}: stuck for {limit_s:.0f} s")
    if err:
        raise err[0]


def run_peer(tb, mode: str, readers: int, step: int, *, endpoint: str, bucket: str) -> dict:
    """A cold load through ``mode``'s read-only mounts on nodes 0..readers-1; a row, or one with ``error``."""
    name = f"load-{mode}-n{readers}-{step}"
    expected = publish(tb, name, endpoint=endpoint, bucket=bucket)
    mounts = peers.PeerMounts(tb, mode, list(range(readers)), endpoint, bucket, tb.args.rclone_write_back,
                              read_only=True)
    try:
        mounts.start()
        dirs = {i: os.path.join(mounts.points[i], name) for i in range(readers)}
        what = f"load {mode} N={readers}"
        _bounded(lambda: wait_visible(dirs, expected["files"], what), VISIBLE_TIMEOUT_S + 10, what)
        row = measure(tb, mode, step, "cold", dirs, expected, daemons=False,
                      timeout_s=_peer_limit_s(tb, expected["model_bytes"], readers))
    except (peers.PeerFailed, LoadError) as exc:
        mounts.kill()
        print(f"  load {mode} N={readers} FAILED: {exc}", flush=True)
        return {"scenario": "load", "mode": mode, "step": step, "readers": readers, "phase": "cold", "error": str(exc)}
    finally:
        mounts.stop()
    _say(row)
    return row


def run_peers(tb, modes: list[str], step: int, *, endpoint: str, bucket: str) -> list[dict]:
    """The chosen external peers that can be mounted and read, N = 1 and N = nodes each."""
    rows = []
    for mode in modes:
        if mode not in PEER_MODES:
            print(f"  load {mode}: not a load mode (no filesystem to load from)", flush=True)
            continue
        for readers in reader_counts(tb.n):
            rows.append(run_peer(tb, mode, readers, step, endpoint=endpoint, bucket=bucket))
    return rows


# ============================================================== report

def header(a) -> str:
    plan = model_plan(a.size_mib * MiB, a.shard_mib * MiB)
    size = sum(math.prod(s) * DTYPE_BYTES for shard in plan["shards"] for _n, s in shard)
    return (f"load: N = 1 and N = {a.nodes} emulated nodes load a Hugging Face-style model already in the bucket "
            f"({size / MiB:.1f} MiB of float16 weights in {len(plan['shards'])} safetensors shards, {plan['layers']} "
            f"layers, hidden {plan['hidden']}) at once, safe_open per shard, from cold pools; fabric "
            f"{a.fabric_mbit:g}, storage {a.storage_mbit:g}, backend {a.backend_mbit:g} Mbit/s (tbf)")


def _per_node_mib(d: dict) -> str:
    return " ".join(f"{n}:{b / MiB:.0f}" for n, b in sorted(d.items()))


def _order(r: dict) -> tuple:
    modes = (*MODES, *PEER_MODES)
    return (modes.index(r["mode"]) if r["mode"] in modes else len(modes), r.get("readers", 0),
            r.get("phase") == "warm", r["step"])


def table(results: list[dict]) -> str:
    done = sorted((r for r in results if "error" not in r and "skipped" not in r), key=_order)
    probes = [r for r in done if r["phase"] == "first-byte"]
    done = [r for r in done if r["phase"] != "first-byte"]
    rows = [[r["mode"], r["phase"], str(r["readers"]), f"{r['load_s']:.2f}",
             " ".join(f"{n}:{s:.2f}" for n, s in r["load_s_by_node"].items()), f"{r['first_byte_s'] * 1000:.0f}",
             f"{r['s3_tx_bytes'] / MiB:.1f}", f"{r['s3_tx_bytes'] / r['model_bytes']:.2f}",
             _per_node_mib(r["fetched_by_node"]) if r["fetched_by_node"] is not None else "-"] for r in done]
    out = h.markdown_table(["mode", "load", "N", "load s (slowest)", "load s per node", "first byte ms (n0)",
                            "S3 sent MiB", "storage / model", "MiB fetched per node (daemon)"], rows)
    nodes = max((r["readers"] for r in done), default=1)
    for r in probes:
        out += (f"\n\n{r['mode']}: node 0 alone, first byte of {len(r['first_byte_samples_s'])} fresh objects: "
                + ", ".join(f"{t * 1000:.0f}" for t in r["first_byte_samples_s"]) + " ms")
    out += "\n\n" + goals(done + probes, nodes)
    noted = set()
    for r in sorted(results, key=_order):
        note = (f"{r['mode']}: not run: {r['skipped']}" if "skipped" in r
                else f"{r['mode']} N={r['readers']} step {r['step']} FAILED: {r['error']}" if "error" in r else None)
        if note and note not in noted:
            noted.add(note)
            out += f"\n{note}\n"
    return out


def goals(rows: list[dict], nodes: int) -> str:
    """One line per goal, from the medians of the runs that completed."""
    def med(mode: str, n: int, key, phase: str = "cold") -> float:
        return h.median([key(r) for r in rows if r["mode"] == mode and r["readers"] == n and r["phase"] == phase])

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    def storage(r: dict) -> float:
        return r["s3_tx_bytes"] / r["model_bytes"]

    ran = [m for m in (*MODES, *PEER_MODES) if any(r["mode"] == m for r in rows)]
    grouped = [m for m in WARM_MODES if m in ran]
    lines = []
    if grouped:
        worst = {m: max(med(m, n, storage) for n in reader_counts(nodes)) for m in grouped}
        lines.append(f"- storage/model <= {STORAGE_PER_MODEL_MAX:g} (cold, worst N): "
                     + ", ".join(f"{m} {v:.2f} {verdict(v <= STORAGE_PER_MODEL_MAX)}" for m, v in worst.items()))
    if nodes > 1:
        scale = {m: med(m, nodes, lambda r: r["load_s"]) / med(m, 1, lambda r: r["load_s"]) for m in ran}
        lines.append(f"- time(N={nodes})/time(N=1) <= {SCALING_MAX:g}: "
                     + ", ".join(f"{m} {v:.2f}" + (f" {verdict(v <= SCALING_MAX)}" if m in grouped else "")
                                 for m, v in scale.items()))
    if "plain" in ran and grouped:
        plain = med("plain", nodes, lambda r: r["load_s"])
        lines.append(f"- plain/mode load time at N={nodes} >= {SPEEDUP_MIN:g}x: "
                     + ", ".join(f"{m} {plain / (v := med(m, nodes, lambda r: r['load_s'])):.2f}x "
                                 f"{verdict(plain / v >= SPEEDUP_MIN)}" for m in grouped))
    warm = [m for m in grouped if any(r["mode"] == m and r["phase"] == "warm" for r in rows)]
    if warm:
        parts = []
        for m in warm:
            fetched = med(m, nodes, lambda r: sum(r["fetched_by_node"].values()), "warm")
            parts.append(f"{m} {fetched / KiB:.0f} KiB fetched by the daemons (S3 sent "
                         f"{med(m, nodes, lambda r: r['s3_tx_bytes'], 'warm') / KiB:.0f} KiB, listings included) "
                         f"{verdict(fetched == 0)}")
        lines.append(f"- warm second load at N={nodes} reads 0 bytes from storage: " + ", ".join(parts))
    if "autogroup" in ran and "plain" in ran:
        probed = all(any(r["mode"] == m and r["phase"] == "first-byte" for r in rows) for m in FIRST_BYTE_MODES)
        phase = "first-byte" if probed else "cold"  # the probe's medians, else the loads' one sample each
        auto, plain = (med(m, 1, lambda r: r["first_byte_s"], phase) for m in ("autogroup", "plain"))
        lines.append(f"- autogroup lone-reader first byte within {FIRST_BYTE_SLACK:.0%} of plain: {auto * 1000:.0f} ms "
                     f"vs {plain * 1000:.0f} ms ({auto / plain - 1:+.0%}; "
                     f"{f'{FIRST_BYTE_OBJECTS} fresh objects per run' if probed else 'one load per run'}) "
                     f"{verdict(auto <= plain * (1 + FIRST_BYTE_SLACK))}")
    return "goals (medians):\n" + "\n".join(lines) + "\n" if lines else ""
