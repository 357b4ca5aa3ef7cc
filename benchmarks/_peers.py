"""External systems the testbed measures next to aiturbofs, on the same emulated links in the same run.

Modes (each an extra write mode of the dp, rank0 and sharded scenarios;
``rclone`` and ``s3fs-fuse``, mounted read-only, are also read modes of
the load scenario, ``_load.py``):

- ``rclone``: ``rclone mount --vfs-cache-mode writes`` per writing node.
  close() returns once the file is in rclone's local disk cache; the upload
  starts ``--vfs-write-back`` (rclone's default, 5 s, unless
  ``--rclone-write-back`` says otherwise) after the last close.
- ``s3fs-fuse``: Debian's ``s3fs`` (s3fs-fuse) mount per writing node; it
  uploads inside flush/close, so close() returns at durable.
- ``s3fs-direct``: no filesystem; each rank's process calls the s3fs Python
  library's ``pipe_file`` with its bytes: close-return is durable there.

Every daemon and uploader runs with ``nsenter --net`` in its node's namespace,
so its traffic crosses that node's shaped storage link to moto.  Durable is
judged by the S3 server, not by the peer: a watcher in the S3 namespace
(boto3 over that namespace's loopback: neither shaped nor counted) asks for
each pending object's size (GetObjectAttributes) until every object has its
full size, then reads each object back and compares its MD5 with the bytes
written (untimed).  It never asks for an ETag, nor lists: moto computes an
object's ETag lazily from its buffer without a lock, so a listing that
lands while a PUT handler computes the same ETag makes both read
interleaved bytes, and the writer (rclone checks it against its own MD5)
sees a wrong ETag.

This module owns the peers' mounts: each mode mounts before its round and
unmounts after it, also on failure, and ``stop_all()`` (called by the
testbed's teardown) stops whatever is still up.  A peer that does not
mount, write, or become durable within its time limit fails its mode with a
message that names the node and the step; the run goes on with the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import _harness as h
import _netns as nn

MiB = 1 << 20
MODES = ("rclone", "s3fs-fuse", "s3fs-direct")  # the order they run and print in
TOOLS = {"rclone": "rclone", "s3fs-fuse": "s3fs"}  # mode -> binary it needs (apt: rclone, s3fs)
RCLONE_WRITE_BACK_DEFAULT = "5s"  # rclone's own default for --vfs-write-back
MOUNT_TIMEOUT_S = 30.0
UNMOUNT_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 60.0  # an uploader or the watcher importing boto3/s3fs on two busy cores
POLL_S = 0.1  # the durable watcher's period: the resolution of every peer's durable time (each poll costs moto CPU)
# A round may take this many times its ideal time (all bytes through the narrower of the backend cap
# and the writers' storage links) plus the base before the mode fails: moto's CPU, not the links,
# often sets the pace, and rclone waits its write-back delay first.
TIMEOUT_BASE_S = 60.0
TIMEOUT_SLACK = 20.0
REGION = "us-east-1"


class PeerFailed(RuntimeError):
    """A peer mode could not finish its round: what failed, on which node, after how long."""


def mode_list(text: str) -> list[str]:
    """``--peers``: ``all``, ``none`` or a comma list of MODES; the chosen modes in their run order."""
    text = text.strip()
    if text in ("", "none"):
        return []
    chosen = set(MODES) if text == "all" else {m.strip() for m in text.split(",") if m.strip()}
    unknown = chosen - set(MODES)
    if unknown:
        raise ValueError(f"unknown peer {', '.join(sorted(unknown))}: choose from {', '.join(MODES)}, all or none")
    return [m for m in MODES if m in chosen]


def preflight(modes: list[str]) -> None:
    """TestbedError naming the missing tools (and how to install them) before anything is built."""
    missing = sorted({TOOLS[m] for m in modes if m in TOOLS and shutil.which(TOOLS[m]) is None})
    if missing:
        raise nn.TestbedError(f"--peers needs {', '.join(missing)}: bash scripts/setup.sh --bench "
                              f"(apt-get install {' '.join(missing)})")


# ============================================================== mounts

_ACTIVE: list[PeerMounts] = []  # mounted and not yet stopped: stop_all() takes them down
_ACTIVE_LOCK = threading.Lock()


class PeerMounts:
    """One peer's FUSE mounts for one round: a daemon per node, in that node's namespace.

    ``read_only``: mounted read-only (rclone ``--read-only``, s3fs ``-o ro``),
    for the load scenario's readers (``_load.py``).
    """

    def __init__(self, tb, mode: str, nodes: list[int], endpoint: str, bucket: str, write_back: str, *,
                 read_only: bool = False):
        self.tb, self.mode, self.nodes = tb, mode, nodes
        self.endpoint, self.bucket, self.write_back, self.read_only = endpoint, bucket, write_back, read_only
        self.dir = os.path.join(tb.root, f"peer-{mode}")
        self.points = {i: os.path.join(self.dir, f"n{i}-mnt") for i in nodes}

    def _config(self) -> list[str]:
        """Credentials and endpoint in files of the run's temp dir (mode 0600); the daemon's extra args."""
        os.makedirs(self.dir, exist_ok=True)
        key, secret = "testing", "testing"  # moto accepts any; the testbed's CREDENTIALS
        if self.mode == "rclone":
            path = os.path.join(self.dir, "rclone.conf")
            _write_private(path, f"[moto]\ntype = s3\nprovider = Other\naccess_key_id = {key}\n"
                                 f"secret_access_key = {secret}\nendpoint = {self.endpoint}\nregion = {REGION}\n"
                                 "force_path_style = true\nno_check_bucket = true\n")
            return [path]
        path = os.path.join(self.dir, "passwd")
        _write_private(path, f"{key}:{secret}\n")
        return [path]

    def _command(self, i: int, conf: str) -> list[str]:
        mnt = self.points[i]
        if self.mode == "rclone":
            return ["rclone", "--config", conf, "mount", f"moto:{self.bucket}", mnt, "--vfs-cache-mode", "writes",
                    "--vfs-write-back", self.write_back, "--cache-dir", os.path.join(self.dir, f"n{i}-cache"),
                    "--dir-cache-time", "1s", "--contimeout", "10s", "--timeout", "60s", "--low-level-retries", "3",
                    "--log-level", "INFO", *(["--read-only"] if self.read_only else [])]
        return ["s3fs", self.bucket, mnt, "-f", "-o", f"url={self.endpoint}", "-o", "use_path_request_style",
                "-o", f"passwd_file={conf}", "-o", f"endpoint={REGION}", "-o", "connect_timeout=10",
                "-o", "readwrite_timeout=60", "-o", "retries=3", "-o", "stat_cache_expire=1",
                "-o", f"tmpdir={self.dir}", "-o", "dbglevel=warn", *(["-o", "ro"] if self.read_only else [])]

    def name(self, i: int) -> str:
        return f"{self.mode}-n{i}"

    def start(self) -> None:
        conf = self._config()[0]
        with _ACTIVE_LOCK:
            _ACTIVE.append(self)
        for i in self.nodes:
            os.makedirs(self.points[i], exist_ok=True)
            # the endpoint is plain http: a CA bundle from the environment only makes rclone's S3 client refuse to start
            self.tb._spawn(self.name(i), ["nsenter", f"--net=/run/netns/{self.tb.node_ns[i]}", *self._command(i, conf)],
                           env={"AWS_CA_BUNDLE": ""})
        for i in self.nodes:
            try:
                self.tb._wait(f"{self.mode} mount on n{i}", lambda m=self.points[i]: h.is_mounted(m),
                              self.tb.procs[self.name(i)], MOUNT_TIMEOUT_S)
            except nn.TestbedError as exc:
                raise PeerFailed(f"{exc}:\n{self.tb.log_tail(self.name(i), 1500)}") from None

    def stop(self) -> None:
        """Unmount every node's mount and stop its daemon (killed after UNMOUNT_TIMEOUT_S); never raises."""
        with _ACTIVE_LOCK:
            if self not in _ACTIVE:
                return
            _ACTIVE.remove(self)
        for mnt in self.points.values():
            if h.is_mounted(mnt):
                r = subprocess.run(["fusermount3", "-u", mnt], capture_output=True, text=True, check=False)
                if r.returncode != 0:  # busy (a writer still inside) or the daemon is gone: detach it
                    subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True, check=False)
        for i in self.nodes:
            p = self.tb.procs.pop(self.name(i), None)
            if p is None:
                continue
            try:
                p.wait(UNMOUNT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"warning: {self.mode} on n{i} did not exit {UNMOUNT_TIMEOUT_S:.0f} s after unmount; killed",
                      file=sys.stderr)
                _kill_group(p)
        for mnt in self.points.values():
            if h.is_mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True, check=False)

    def kill(self) -> None:
        """A stuck daemon: kill it, so writers blocked in its mount return (ENOTCONN) instead of hanging."""
        for i in self.nodes:
            p = self.tb.procs.get(self.name(i))
            if p is not None and p.poll() is None:
                _kill_group(p)


def stop_all() -> None:
    """Unmount and stop every peer mount still up (the testbed's teardown calls this first)."""
    with _ACTIVE_LOCK:
        active = list(_ACTIVE)
    for m in active:
        m.stop()


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# ============================================================== durable, as S3 sees it

_WATCHER = r"""
import hashlib, json, sys, time
import boto3
from botocore.config import Config
endpoint, bucket, prefix, limit_s, poll_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
want = json.loads(sys.argv[6])  # key -> size
c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, connect_timeout=5,
                                                        read_timeout=60, retries={"max_attempts": 3}))
c.head_bucket(Bucket=bucket)
print("ready", flush=True)
seen, end = {}, time.monotonic() + limit_s
while len(seen) < len(want) and time.monotonic() < end:
    for key in [k for k in want if k not in seen]:
        try:  # the size only: anything that makes moto compute an ETag races its PUT handler's (see below)
            size = c.get_object_attributes(Bucket=bucket, Key=key, ObjectAttributes=["ObjectSize"])["ObjectSize"]
        except c.exceptions.NoSuchKey:
            continue
        if size == want[key]:
            seen[key] = time.monotonic()  # complete no later than this answer
    time.sleep(poll_s)
md5, gone = {}, []
for key in seen:  # untimed: are these the bytes that were written?
    try:
        body = c.get_object(Bucket=bucket, Key=key)["Body"]
    except c.exceptions.NoSuchKey:
        gone.append(key)  # was complete, then deleted or replaced by its writer
        continue
    digest = hashlib.md5()
    for block in iter(lambda: body.read(1 << 20), b""):
        digest.update(block)
    md5[key] = digest.hexdigest()
print(json.dumps({"seen": seen, "md5": md5, "gone": gone}), flush=True)
"""


class DurableWatcher:
    """Polls, from inside the S3 namespace, the size of every expected key until each is complete."""

    def __init__(self, tb, endpoint: str, bucket: str, prefix: str, sizes: dict[str, int], limit_s: float):
        self.limit_s = limit_s
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", tb.s3_ns, sys.executable, "-c", _WATCHER, endpoint, bucket, prefix,
             str(limit_s), str(POLL_S), json.dumps(sizes)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = _readline(self.proc, READY_TIMEOUT_S)
        if line.strip() != "ready":
            self.kill()
            raise PeerFailed(f"durable watcher did not start: {line.strip()} {self.proc.stderr.read()[-800:]}")

    def result(self) -> dict:
        """{"seen": key -> monotonic time complete, "md5": key -> hex}; waits up to the limit + read-back."""
        try:
            out, err = self.proc.communicate(timeout=self.limit_s + READY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise PeerFailed("durable watcher did not answer (moto stuck?)") from None
        if self.proc.returncode != 0 or not out.strip():
            raise PeerFailed(f"durable watcher failed ({self.proc.returncode}): {err[-800:]}")
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            _kill_group(self.proc)


def _readline(p: subprocess.Popen, timeout_s: float) -> str:
    """One line of ``p``'s stdout, or "" after ``timeout_s`` (the reader thread is left to the pipe's close)."""
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(p.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    return got[0] if got else ""


# ============================================================== the writers

_DIRECT = r"""
import json, sys, time
endpoint, bucket, key, data_path = sys.argv[1:5]
with open(data_path, "rb") as f:
    data = f.read()
import s3fs
fs = s3fs.S3FileSystem(key="testing", secret="testing", skip_instance_cache=True,
                       client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
                       config_kwargs={"s3": {"addressing_style": "path"}, "connect_timeout": 10, "read_timeout": 60,
                                      "retries": {"max_attempts": 3}})
fs.exists(bucket)  # the connection is up before the clock starts, as a mounted peer's is
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
fs.pipe_file(f"{bucket}/{key}", data)
print(json.dumps({"s": time.monotonic() - t0}), flush=True)
"""


def _mount_writes(mounts: PeerMounts, files: dict[int, tuple[str, list[bytes]]], write_file, limit_s: float) -> dict[str, float]:
    """Every node writes its file into its own mount at once; path -> open+write+close seconds.

    Everything that touches a mount (the untimed mkdir too) runs in the
    writer threads, so a hung daemon costs ``limit_s``, not the run.
    """
    closes: dict[str, float] = {}
    errors: dict[int, OSError] = {}

    def writer(i: int, path: str, parts: list[bytes]) -> None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)  # untimed, like the aiturbofs modes' mkdir
            write_file(path, parts, closes)
        except OSError as exc:
            errors[i] = exc

    threads = [(i, threading.Thread(target=writer, args=(i, os.path.join(mounts.points[i], rel), parts), daemon=True))
               for i, (rel, parts) in files.items()]
    for _i, t in threads:
        t.start()
    deadline = time.monotonic() + limit_s
    for _i, t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [f"n{i}" for i, t in threads if t.is_alive()]
    if stuck:
        mounts.kill()  # the blocked calls return once their daemon is gone
        raise PeerFailed(f"{mounts.mode}: writer(s) on {', '.join(stuck)} still in mkdir/open/write/close "
                         f"after {limit_s:.0f} s")
    if errors or len(closes) != len(files):
        raise PeerFailed(f"{mounts.mode}: writer(s) failed: "
                         + "; ".join(f"n{i}: {exc}" for i, exc in sorted(errors.items())))
    return closes


def _direct_writes(tb, endpoint: str, bucket: str, files: dict[int, tuple[str, list[bytes]]],
                   limit_s: float) -> tuple[float, dict[str, float]]:
    """Every rank's process, in its node's namespace, uploads its bytes with s3fs at once.

    Returns the monotonic time of the start signal (the processes are up,
    their data read and their connection made before it) and key -> upload
    seconds.
    """
    stage = os.path.join(tb.root, "peer-s3fs-direct")
    os.makedirs(stage, exist_ok=True)
    procs = {}
    try:
        for i, (key, parts) in files.items():
            data_path = os.path.join(stage, f"n{i}.bin")
            with open(data_path, "wb") as f:
                f.writelines(parts)
            procs[i] = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{tb.node_ns[i]}", sys.executable, "-c", _DIRECT, endpoint, bucket, key,
                 data_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
        for i, p in procs.items():
            if _readline(p, READY_TIMEOUT_S).strip() != "ready":
                _kill_group(p)
                raise PeerFailed(f"s3fs-direct: uploader on n{i} did not start: {p.stderr.read()[-800:]}")
        t0 = time.monotonic()
        for p in procs.values():
            p.stdin.write("go\n")
            p.stdin.flush()
        uploads, deadline = {}, time.monotonic() + limit_s
        for i, p in procs.items():
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise PeerFailed(f"s3fs-direct: upload on n{i} not finished after {limit_s:.0f} s") from None
            if p.returncode != 0 or not out.strip():
                raise PeerFailed(f"s3fs-direct: upload on n{i} failed ({p.returncode}): {err[-800:]}")
            uploads[files[i][0]] = json.loads(out.strip().splitlines()[-1])["s"]
        return t0, uploads
    finally:
        for p in procs.values():
            if p.poll() is None:
                _kill_group(p)
        shutil.rmtree(stage, ignore_errors=True)


# ============================================================== one round

def _limit_s(tb, written_bytes: int, writers: int) -> float:
    a = tb.args
    ideal_s = written_bytes * 8 / 1e6 / min(a.backend_mbit, writers * a.storage_mbit)
    return TIMEOUT_BASE_S + TIMEOUT_SLACK * ideal_s


def run_write(tb, scenario: str, mode: str, step: int, layout: list[tuple[int, list[bytes]]], unique: int, *,
              endpoint: str, bucket: str, write_file) -> dict:
    """One round of ``mode``: mount, every writer at once, durable in S3, verify, unmount.

    Returns a row with the keys of the aiturbofs modes' rows (``uploaded_by_node``
    is what each node's storage link sent, HTTP included) or, when the peer
    failed, ``{"scenario", "mode", "step", "error"}``.
    """
    prefix = f"{scenario}-{mode}-{step}"
    files = {i: (f"{prefix}/rank{i}.bin", parts) for i, parts in layout}
    sizes = {key: sum(map(len, parts)) for key, parts in files.values()}
    written = sum(sizes.values())
    limit_s = _limit_s(tb, written, len(files))
    if mode == "rclone":  # its uploads wait for the write-back delay first
        limit_s += _seconds(tb.args.rclone_write_back)
    mounts = None if mode == "s3fs-direct" else PeerMounts(tb, mode, list(files), endpoint, bucket, tb.args.rclone_write_back)
    watcher = None
    try:
        if mounts is not None:
            mounts.start()
        watcher = DurableWatcher(tb, endpoint, bucket, prefix + "/", sizes, limit_s)
        tx0 = {i: nn.tx_bytes(tb.node_ns[i], "sto") for i in files}
        rx0, cpu0 = tb.s3_rx_bytes(), tb.moto_cpu_s()
        if mounts is None:
            t0, closes = _direct_writes(tb, endpoint, bucket, files, limit_s)
        else:
            t0 = time.monotonic()
            closes = _mount_writes(mounts, files, write_file, limit_s)
        seen = watcher.result()
        missing = sorted(set(sizes) - set(seen["seen"]))
        if missing:
            raise PeerFailed(f"{mode}: not complete in S3 after {limit_s:.0f} s: {', '.join(missing)}")
        # durable: every object complete in S3 and every writer back from close (an uploader's own
        # exit, e.g. s3fs closing its event loop, is not part of it)
        durable_s = max(max(closes.values()), max(seen["seen"].values()) - t0)
        s3_rx, moto_cpu_s = tb.s3_rx_bytes() - rx0, tb.moto_cpu_s() - cpu0
        uploaded = {f"n{i}": nn.tx_bytes(tb.node_ns[i], "sto") - tx0[i] for i in files}
        want = {key: hashlib.md5(b"".join(parts)).hexdigest() for key, parts in files.values()}
        if seen["gone"]:
            raise PeerFailed(f"{mode}: complete in S3, then gone when read back: {', '.join(seen['gone'])}")
        wrong = sorted(k for k in want if seen["md5"].get(k) != want[k])
        if wrong:
            raise PeerFailed(f"{mode}: S3 holds other bytes than were written for {', '.join(wrong)}")
    except PeerFailed as exc:
        print(f"  {scenario} {mode:10} FAILED: {exc}", flush=True)
        for i in (mounts.nodes if mounts is not None else []):  # the daemons' own words, for the reader of the run
            print(f"  ===== {mounts.name(i)} log\n{tb.log_tail(mounts.name(i), 1500)}", file=sys.stderr, flush=True)
        return {"scenario": scenario, "mode": mode, "step": step, "error": str(exc)}
    finally:
        if watcher is not None:
            watcher.kill()
        if mounts is not None:
            mounts.stop()
    return {"scenario": scenario, "mode": mode, "step": step, "close_s": max(closes.values()), "durable_s": durable_s,
            "s3_rx_bytes": s3_rx, "uploaded_by_node": uploaded, "moto_cpu_s": moto_cpu_s, "unique_bytes": unique,
            "written_bytes": written, "lp_bound_s": None, "makespan_s": None, "plan": None,
            "rclone_write_back": tb.args.rclone_write_back if mode == "rclone" else None}


def _seconds(duration: str) -> float:
    """rclone's duration syntax as far as --rclone-write-back takes it: ``5s``, ``500ms``, ``1m``, ``0``."""
    for suffix, scale in (("ms", 1e-3), ("s", 1.0), ("m", 60.0)):
        if duration.endswith(suffix):
            return float(duration[: -len(suffix)]) * scale
    return float(duration)


def run_modes(tb, scenario: str, modes: list[str], step: int, layout_fn, **kw) -> list[dict]:
    """Every peer mode once for ``scenario`` (fresh bytes each, like the aiturbofs modes); their rows."""
    rows = []
    for mode in modes:
        layout, _group_size, unique = layout_fn(tb, scenario)
        r = run_write(tb, scenario, mode, step, layout, unique, **kw)
        rows.append(r)
        if "error" not in r:
            print(f"  {scenario} {mode:10} close {r['close_s']:.2f} s, durable {r['durable_s']:.2f} s, "
                  f"S3 rx {r['s3_rx_bytes'] / MiB:.1f} MiB for {r['unique_bytes'] / MiB:.0f} MiB unique", flush=True)
    return rows


# ============================================================== report

def comparison(results: list[dict]) -> str:
    """How many times longer each peer took than aiturbofs grouped (medians), and the peers that failed."""
    done = [r for r in results if "error" not in r]
    peers = [m for m in MODES if any(r["mode"] == m for r in done)]
    text = ""
    if peers and any(r["mode"] == "grouped" for r in done):
        def med(mode: str, key: str) -> float:
            return h.median([r[key] for r in done if r["mode"] == mode])

        g_close, g_durable = med("grouped", "close_s"), med("grouped", "durable_s")
        text += ("\nvs peers (peer time / aiturbofs grouped time): close-return "
                 + ", ".join(f"{m} {med(m, 'close_s') / g_close:.1f}x" for m in peers)
                 + "; durable " + ", ".join(f"{m} {med(m, 'durable_s') / g_durable:.2f}x" for m in peers) + "\n")
        wb = {r["rclone_write_back"] for r in done if r["mode"] == "rclone"}
        if wb:
            text += f"(rclone with --vfs-write-back {', '.join(sorted(wb))}: its uploads start that long after close)\n"
    for r in results:
        if "error" in r:
            text += f"\n{r['mode']} step {r['step']} FAILED: {r['error']}\n"
    return text


def completed(results: list[dict]) -> list[dict]:
    """The rows the tables show as measurements (failed peer rounds are listed under the table)."""
    return [r for r in results if "error" not in r]
