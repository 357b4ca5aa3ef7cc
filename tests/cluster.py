"""A test cluster on one host: PostgreSQL, moto S3, ``aiturbo controller`` and N node daemons.

``Cluster`` starts, in this order, one controller process and N
``mount.aiturbo`` daemons (``tests.mounting.Mount``), each with its own mount
point, state dir, log and loopback fabric port, all sharing one PostgreSQL
database (``meta=``), one bucket and one cluster secret; it waits until every
node has joined the controller and sees every other node.  ``close()`` always
tears everything down (unmount with a bounded drain, then kill -9 whatever is
left, then the controller), also when a test failed or a start failed half
way.  The PostgreSQL server and the S3 server are the caller's (the
fixture ``make_cluster`` passes the session's): a cluster gets a fresh
database and bucket.

The nodes reach S3 through a ``CountingProxy``: a byte-counting TCP relay in
front of moto.  It is the S3 side's own count of what the nodes sent and of
what S3 sent back (moto keeps no request log), independent of the daemons'
``persist`` metrics.

``FrameTamperer`` is a fabric-aware relay that flips one byte in the payload
of the first chunk-bearing frame of a kind (``route_peers_through`` points a
node's peers at it).

At the end, what the cluster test modules share: the group tags, a thread
that times a call, full reads, the nodes' read counters, pools emptied
between rounds, and ``assert_clean`` (no BUG logged, no corrupt frame).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Self

from loopback import HOST, free_port
from mounting import REPO, Mount, aiturbo, is_mounted

from aiturbofs.node import control_socket
from aiturbofs.node._control import call as control_call

MiB = 1 << 20
CHUNK = 8 * MiB
CONTROLLER_START_TIMEOUT_S = 30.0
NODE_START_TIMEOUT_S = 60.0  # two cores, four processes importing trio, s3fs, psycopg at once
FABRIC_PORT_TRIES = 3  # a node whose fabric port another process took between free_port() and its bind
JOIN_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 30.0  # teardown: unmount + drain per node, then kill -9
CONTROLLER_STOP_TIMEOUT_S = 10.0
LOG_TAIL_CHARS = 6000

# The controller CLI as the brief specifies it.
CONTROLLER_CMD = [sys.executable, "-m", "aiturbofs.cli.main", "controller"]


def write_secret(path: str, secret: bytes | None = None) -> str:
    """A cluster secret file, mode 0600 (the daemons refuse anything looser)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret or secrets.token_hex(32).encode())
    os.chmod(path, 0o600)
    return path


# ============================================================== S3 byte counter


class _Relay:
    """A TCP relay ``127.0.0.1:port -> target`` on threads; subclasses say how bytes cross (``_pump``).

    Each accepted connection gets a connection upstream and one ``_pump``
    thread per direction (``upstream``: towards the target).  ``close()``
    stops accepting and closes every relayed socket.
    """

    def __init__(self, target: tuple[str, int], name: str, backlog: int):
        self.target = target
        self.connections = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, 0))
        self._listener.listen(backlog)
        self.port = self._listener.getsockname()[1]
        self.address = f"{HOST}:{self.port}"
        threading.Thread(target=self._accept, daemon=True, name=name).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.target)
            except OSError:
                down.close()
                continue
            with self._lock:
                self.connections += 1
                self._socks += [down, up]
            threading.Thread(target=self._relay, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._relay, args=(up, down, False), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            self._pump(src, dst, upstream)
        except OSError:
            pass
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.close()
            except OSError:
                pass


class CountingProxy(_Relay):
    """A relay in front of the S3 server; counts the bytes that cross it each way.

    ``upstream_bytes`` is every byte the S3 server received through it
    (requests, headers included); ``downstream_bytes`` every byte it sent
    back (responses: GET bodies, headers, listings, errors).  ``reset()``
    zeroes both.
    """

    def __init__(self, target_port: int):
        self.upstream_bytes = 0
        self.downstream_bytes = 0
        super().__init__((HOST, target_port), "s3-proxy", 128)
        self.endpoint = f"http://{self.address}"

    def reset(self) -> None:
        with self._lock:
            self.upstream_bytes = 0
            self.downstream_bytes = 0

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        while True:
            data = src.recv(1 << 20)
            if not data:
                break
            with self._lock:  # counted before it is relayed: a reader never sees bytes not yet counted
                if upstream:
                    self.upstream_bytes += len(data)
                else:
                    self.downstream_bytes += len(data)
            dst.sendall(data)


# ============================================================== fabric tamperer

_FRAME_HEADER = struct.Struct(">4sBBHQI")  # aiturbofs.fabric._wire: magic, version, type, flags, request id, length
_KEY_BYTES = 32
FRAME_CHUNK = 0x11  # a GET_CHUNK reply
FRAME_PUT_CHUNK = 0x13


class FrameTamperer(_Relay):
    """A relay in front of a node's fabric port that corrupts ONE chunk payload per frame type.

    It parses the fabric's frame headers (the handshake and control frames
    pass untouched) and flips one byte in the middle of the chunk bytes of
    the first frame of each type in ``flip_types`` (after the 32-byte key,
    so the frame still names the right chunk).  ``flipped`` lists
    ``(frame type, payload length)`` of what it corrupted.
    """

    def __init__(self, target: str, flip_types: tuple[int, ...] = (FRAME_CHUNK, FRAME_PUT_CHUNK)):
        host, _, port = target.rpartition(":")
        self.pending = set(flip_types)
        self.flipped: list[tuple[int, int]] = []
        super().__init__((host, int(port)), "fabric-tamper", 64)

    @staticmethod
    def _read_exact(sock: socket.socket, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            part = sock.recv(min(n - len(buf), 1 << 20))
            if not part:
                return None
            buf += part
        return bytes(buf)

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        while True:
            header = self._read_exact(src, _FRAME_HEADER.size)
            if header is None:
                break
            magic, _version, ftype, _flags, _rid, length = _FRAME_HEADER.unpack(header)
            if magic != b"ATFB":  # not a fabric stream: relay the rest as it comes
                dst.sendall(header)
                while data := src.recv(1 << 20):
                    dst.sendall(data)
                break
            payload = self._read_exact(src, length) if length else b""
            if payload is None:
                break
            if length > _KEY_BYTES:
                with self._lock:
                    flip = ftype in self.pending
                    if flip:
                        self.pending.discard(ftype)
                        self.flipped.append((ftype, length))
                if flip:
                    body = bytearray(payload)
                    body[_KEY_BYTES + (length - _KEY_BYTES) // 2] ^= 0x01
                    payload = bytes(body)
            dst.sendall(header + payload)


# ============================================================== the controller


class Controller:
    """One ``aiturbo controller`` process in its own process group, on a fixed port."""

    def __init__(self, port: int, meta_url: str, secret_path: str, log_path: str, backend_gbps: float | None = None):
        self.port = port
        self.address = f"{HOST}:{port}"
        self.meta_url = meta_url
        self.secret_path = secret_path
        self.log_path = log_path
        self.backend_gbps = backend_gbps
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = CONTROLLER_START_TIMEOUT_S) -> Controller:
        cmd = [*CONTROLLER_CMD, "--listen", self.address, "--meta", self.meta_url, "--secret-file", self.secret_path]
        if self.backend_gbps is not None:
            cmd += ["--backend-gbps", str(self.backend_gbps)]
        start_offset = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=REPO), start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if f"controller listening on {self.address}" in self._log_since(start_offset):
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"aiturbo controller exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"aiturbo controller not listening after {timeout_s} s:\n{self.log()}")
            time.sleep(0.05)

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log(self) -> str:
        return self._log_since(0)[-LOG_TAIL_CHARS:]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            _killpg(self.proc, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = CONTROLLER_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit code (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        _killpg(self.proc, signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


# ============================================================== the cluster


class Cluster:
    """See the module doc.  ``nodes[i]`` is a ``Mount``; node names are ``n0``..``n{N-1}``."""

    def __init__(self, root: str, *, pg, s3, n: int = 3, bucket: str | None = None,
                 node_options: dict | None = None, backend_gbps: float | None = None):
        self.root = root
        self.pg, self.s3, self.n = pg, s3, n
        self.node_options = dict(node_options or {})
        self.backend_gbps = backend_gbps
        self.bucket = bucket or f"c-{secrets.token_hex(6)}"
        self.url = f"s3://{self.bucket}"
        self.meta_url: str | None = None
        self.secret_path = os.path.join(root, "secret")
        self.proxy: CountingProxy | None = None
        self.controller: Controller | None = None
        self.nodes: list[Mount] = []
        self.killed: set[int] = set()
        self.extra: list[Mount] = []  # started by tests (add_node), torn down with the rest
        self.teardown_notes: list[str] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Cluster:
        try:
            os.makedirs(self.root, exist_ok=True)
            self.meta_url = self.pg.new_database()
            self.s3.make_bucket(self.bucket)
            self.proxy = CountingProxy(self.s3.port)
            write_secret(self.secret_path)
            self.controller = Controller(free_port(), self.meta_url, self.secret_path,
                                         os.path.join(self.root, "controller.log"), self.backend_gbps)
            self.controller.start()
            self.nodes = [self.make_node(f"n{i}", self.node_options) for i in range(self.n)]
            with ThreadPoolExecutor(self.n) as pool:
                list(pool.map(self._start_node, self.nodes))
            self.wait_joined()
        except BaseException:
            self.close()
            raise
        return self

    def make_node(self, name: str, options: dict | None = None, *, secret_path: str | None = None) -> Mount:
        """A ``Mount`` for node ``name`` of this cluster (not started)."""
        opts = {
            "s3_endpoint": self.proxy.endpoint,
            "fabric": f"{HOST}:{free_port()}",
            "controller": self.controller.address,
            "meta": self.meta_url,
            "secret_file": secret_path or self.secret_path,
            "node": name,
            "dram": "2G",
            "drain_timeout": str(DRAIN_TIMEOUT_S),
            **(options or {}),
        }
        return Mount(self.url, os.path.join(self.root, f"{name}-mnt"), os.path.join(self.root, f"{name}-state"), opts)

    def add_node(self, name: str, *, secret_path: str | None = None, **options) -> Mount:
        """Start one more daemon (e.g. with another secret); torn down with the cluster."""
        m = self.make_node(name, {**self.node_options, **options}, secret_path=secret_path)
        self.extra.append(m)
        return self._start_node(m)

    @staticmethod
    def _start_node(m: Mount) -> Mount:
        """Start ``m``; a fabric port taken meanwhile (``free_port`` only says it was free) gets a fresh one."""
        for attempt in range(FABRIC_PORT_TRIES):
            try:
                return m.start(NODE_START_TIMEOUT_S)
            except RuntimeError as exc:
                if attempt == FABRIC_PORT_TRIES - 1 or "Address already in use" not in str(exc).splitlines()[-1]:
                    raise
                m.options["fabric"] = f"{HOST}:{free_port()}"
        raise AssertionError("unreachable")

    def live(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if i not in self.killed]

    def wait_joined(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Every live node is connected to the controller and lists every live node as a member."""
        names = {self.name(i) for i in self.live()}
        deadline = time.monotonic() + timeout_s
        while True:
            pending = []
            for i in self.live():
                try:
                    c = self.status(i)["cluster"]
                except Exception as exc:  # noqa: BLE001 - not answering yet
                    pending.append(f"{self.name(i)}: {exc}")
                    continue
                if not c["controller_connected"] or not names <= set(c["members"]):
                    pending.append(f"{self.name(i)}: connected={c['controller_connected']} members={c['members']}")
            if not pending:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"nodes did not join within {timeout_s} s: {pending}\n{self.logs()}")
            time.sleep(0.1)

    def close(self) -> None:
        """Tear everything down; never raises (problems go to ``teardown_notes``)."""
        mounts = [m for i, m in enumerate(self.nodes) if i not in self.killed] + self.extra

        def stop(m: Mount) -> None:
            try:
                code = m.stop(DRAIN_TIMEOUT_S + 15)
                if code:
                    self.teardown_notes.append(f"{m.options.get('node')}: exited {code} at unmount")
            except Exception as exc:  # noqa: BLE001 - kill it and go on
                self.teardown_notes.append(f"{m.options.get('node')}: stop failed: {exc!r}")
            finally:
                m.kill()

        if mounts:
            with ThreadPoolExecutor(len(mounts)) as pool:
                list(pool.map(stop, mounts))
        for m in self.nodes + self.extra:  # kill -9'd ones too: never leave a mount behind
            m.kill()
            if is_mounted(m.mountpoint):
                self.teardown_notes.append(f"{m.mountpoint} still mounted after teardown")
        if self.controller is not None:
            self.controller.stop()
        if self.proxy is not None:
            self.proxy.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ per node
    def name(self, i: int) -> str:
        return self.nodes[i].options["node"]

    def path(self, i: int, *parts: str) -> str:
        return self.nodes[i].path(*parts)

    def status(self, i: int) -> dict:
        """``aiturbo status MNT --json`` of node ``i``, parsed."""
        return self.status_of(self.nodes[i])

    @staticmethod
    def status_of(m: Mount, *, cli: bool = False) -> dict:
        """What ``aiturbo status MNT --json`` prints, read from the daemon's control socket.

        The CLI prints exactly this answer; asking the socket directly spares
        a Python start (~0.4 s on two busy cores) per call.  ``cli=True`` runs
        the real command.
        """
        if cli:
            return json.loads(aiturbo("status", m.mountpoint, "--json", timeout=30).stdout)
        return control_call(control_socket(m.mountpoint), {"cmd": "status"})

    def statuses(self) -> dict[int, dict]:
        return {i: self.status(i) for i in self.live()}

    def kill_node(self, i: int) -> None:
        """kill -9 node ``i`` (its DRAM is gone) and clear its dead mount."""
        self.killed.add(i)
        self.nodes[i].kill()

    def restart_node(self, i: int) -> None:
        """Start node ``i`` again after ``kill_node`` (same state dir, staging dir and fabric address)."""
        self.nodes[i].start(NODE_START_TIMEOUT_S)
        self.killed.discard(i)
        self.wait_joined()

    def kill_controller(self) -> None:
        self.controller.kill()

    def restart_controller(self) -> None:
        """Stop the controller if it runs, then start it again on the same address."""
        self.controller.stop()
        self.controller.start()

    # ------------------------------------------------------------------ S3 side
    def bytes_uploaded(self, nodes=None) -> dict[str, int]:
        """persist.bytes_uploaded per live node (bytes it sent to the backend)."""
        return {self.name(i): self.status(i)["persist"]["bytes_uploaded"] for i in (nodes or self.live())}

    def s3_received_bytes(self) -> int:
        """What the S3 server received through the proxy (requests, headers included)."""
        return self.proxy.upstream_bytes

    def s3_sent_bytes(self) -> int:
        """What the S3 server sent back through the proxy (GET bodies, headers, listings)."""
        return self.proxy.downstream_bytes

    def drop_cache(self, nodes=None, *, cli: bool = False) -> dict[str, int]:
        """``aiturbo drop-cache MNT`` on each of ``nodes`` (default: the live ones); bytes freed per node.

        As for ``status_of``, the daemon's control socket is asked directly
        (the CLI prints its answer); ``cli=True`` runs the real command.
        """
        out = {}
        for i in (self.live() if nodes is None else nodes):
            m = self.nodes[i]
            if cli:
                reply = json.loads(aiturbo("drop-cache", m.mountpoint, timeout=30).stdout)
            else:
                reply = control_call(control_socket(m.mountpoint), {"cmd": "drop-cache"})
            assert reply.get("ok"), f"drop-cache on {self.name(i)}: {reply}"
            out[self.name(i)] = reply["freed_bytes"]
        return out

    def objects(self, prefix: str = "") -> dict[str, int]:
        """Object key -> size, from the bucket itself."""
        c = self.s3.client()
        out = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for o in page.get("Contents", ()):
                out[o["Key"]] = o["Size"]
        return out

    def get_object(self, key: str) -> bytes:
        return self.s3.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()

    # ------------------------------------------------------------------ diagnostics
    def logs(self, chars: int = LOG_TAIL_CHARS) -> str:
        parts = []
        if self.controller is not None:
            parts.append(f"===== controller ({self.controller.log_path})\n{self.controller.log()[-chars:]}")
        for m in self.nodes + self.extra:
            parts.append(f"===== {m.options.get('node')} ({m.log_path})\n{m.log()[-chars:]}")
        return "\n".join(parts)


# ------------------------------------------------------------------ what the cluster test modules share

GROUP = "user.aiturbo.group"
GROUP_SIZE = "user.aiturbo.group.size"
READERS_TIMEOUT_S = 60.0
POOLS_SETTLE_S = 20.0  # replicas are released by a 1 s housekeeping pass once the file is durable


class Timed(threading.Thread):
    """Run ``fn(*args)`` in a thread; ``.result``/``.error`` and ``.elapsed_s`` when done."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.result = self.error = None
        self.started_at = self.ended_at = None

    def run(self):
        self.started_at = time.monotonic()
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return (self.ended_at or time.monotonic()) - self.started_at

    def outcome(self, timeout_s: float):
        """Join; the result, or raise what the thread raised / AssertionError on timeout."""
        self.join(timeout_s)
        if self.is_alive():
            raise AssertionError(f"{self.fn.__name__}{self.args[:1]} still running after {timeout_s} s")
        if self.error is not None:
            raise self.error
        return self.result


def route_peers_through(c: Cluster, pg_server, node: str, address: str) -> None:
    """Make the other nodes reach ``node`` at ``address`` (a relay in front of it).

    Peers find a node at the fabric address the shared metadata records for
    it; this points that row elsewhere (the node itself still listens where
    it did, and nothing re-writes the row until it joins again).
    """
    with pg_server.connect(c.meta_url.rpartition("/")[2]) as conn:
        changed = conn.execute("UPDATE nodes SET address = %s WHERE name = %s", (address, node)).rowcount
    assert changed == 1
    time.sleep(2.5)  # members are re-read from the metadata every second


def read_sha(path: str) -> tuple[int, str]:
    """A full sequential read in 1 MiB requests: (bytes read, sha256)."""
    digest, n = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(MiB):
            digest.update(block)
            n += len(block)
    return n, digest.hexdigest()


def cold_pools(c: Cluster) -> dict[str, int]:
    """Every live node's DRAM pool emptied of the data: replicas released (dirty 0), then drop-cache."""
    deadline = time.monotonic() + POOLS_SETTLE_S
    while True:
        st = c.statuses()
        busy = {c.name(i): (dirty, s["cluster"]["replica_files_held"])
                for i, s in st.items()
                if (dirty := s["pool"]["dirty_bytes"] + s["pool"]["disk_dirty_bytes"]) or s["cluster"]["replica_files_held"]}
        if not busy:
            break
        assert time.monotonic() < deadline, f"(dirty bytes, replica files held) after {POOLS_SETTLE_S} s: {busy}"
        time.sleep(0.2)
    freed = c.drop_cache()
    left = {c.name(i): sum(s["pool"][k] for k in ("clean_bytes", "dirty_bytes", "disk_clean_bytes", "disk_dirty_bytes"))
            for i, s in c.statuses().items()}
    assert not any(left.values()), f"bytes still in the pools after drop-cache: {left}"
    return freed


def read_counters(c: Cluster) -> dict[int, dict]:
    out = {}
    for i, s in c.statuses().items():
        cl = s["cluster"]
        out[i] = {"fetched": s["persist"]["bytes_fetched"], **{k: cl[k] for k in (
            "read_rounds", "chunks_from_chain", "chunks_prefetched", "chunks_served", "chunks_fetched")}}
    return out


def delta(after: dict[int, dict], before: dict[int, dict]) -> dict[int, dict]:
    return {i: {k: v - before[i][k] for k, v in a.items()} for i, a in after.items() if i in before}


def assert_clean(c: Cluster) -> None:
    """No daemon logged a BUG, and no fabric frame arrived corrupt (normal runs)."""
    for i in c.live():
        log = c.nodes[i].log()
        assert "BUG" not in log, f"{c.name(i)} logged a BUG:\n{log[-4000:]}"
        counters = c.status(i)["cluster"]["fabric_counters"]
        corrupt = {peer: v["corrupt_frames"] for peer, v in counters.items() if v["corrupt_frames"]}
        assert not corrupt, f"{c.name(i)}: corrupt frames from {corrupt}"
    assert "BUG" not in c.controller.log(), c.controller.log()
