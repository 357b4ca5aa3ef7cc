"""A mount's worst days: S3 down, failing, slow, and DRAM far too small.

Every test runs a real FUSE mount whose S3 endpoint is a ``FaultyS3Proxy``
(tests/faults.py) in front of one moto server, so the faults come from the
wire (connection resets, 5xx XML errors, slow answers) while moto keeps its
data.  What is checked is what a user relies on: close() returns at once
whatever the backend does; every file becomes durable with exactly its
bytes (read back through the mount after the pool was dropped, and straight
from moto); the bucket holds nothing else (no extra keys, no multipart
upload left open); retries back off; and the daemon's memory stays within
its DRAM budget plus a measured overhead (see docs/memory.md).
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import threading
import time

import pytest
from faults import FaultyS3Proxy
from fileio import pread_direct, sha
from mounting import aiturbo, state, wait_state
from pgserver import SKIP_REASON, PgServer, installed
from s3server import S3Server

from aiturbofs._limits import PERSIST_FILES_IN_FLIGHT, PERSIST_PARTS_IN_FLIGHT

MiB = 1 << 20
CHUNK = 8 * MiB
DURABLE_WAIT_S = 90.0
UNMOUNT_NOTICE_S = 10.0  # an unmounted daemon drains (nothing, here) and exits well within this


@pytest.fixture(scope="module")
def s3_server():
    server = S3Server()
    try:
        yield server.start()
    finally:
        server.close()


class FaultyS3:
    """One fresh bucket behind a fresh proxy; mounts of ``s3://bucket/pre`` through it."""

    def __init__(self, server: S3Server, make_mount):
        self.server = server
        self.make_mount = make_mount
        self.proxy = FaultyS3Proxy(server.port, seed=int.from_bytes(secrets.token_bytes(4), "big"))
        self.bucket = server.make_bucket(f"f-{secrets.token_hex(6)}")
        self.client = server.client()  # straight to moto: what the bucket really holds
        self.mounts = []

    def mount(self, name: str = "m", **options):
        m = self.make_mount(f"s3://{self.bucket}/pre", name=name, s3_endpoint=self.proxy.endpoint,
                            s3_connect_timeout="2", **options)
        self.mounts.append(m)
        return m

    def keys(self) -> list[str]:
        listing = self.client.list_objects_v2(Bucket=self.bucket)
        return sorted(o["Key"] for o in listing.get("Contents", ()))

    def object(self, name: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"pre/{name}")["Body"].read()

    def open_uploads(self) -> list[dict]:
        return self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])


@pytest.fixture
def faulty(s3_server, make_mount):
    """A bucket behind a proxy; its mounts are unmounted (drained through a
    healthy proxy) before the proxy closes, even when the test failed."""
    f = FaultyS3(s3_server, make_mount)
    try:
        yield f
    finally:
        f.proxy.set(down=False, error_rate=0.0, delay_s=0.0)
        try:
            for m in f.mounts:
                unmount(m)  # make_mount's teardown kills whatever this left
        finally:
            f.proxy.close()


def unmount(m, timeout_s: float = 120.0) -> int:
    """Unmount, then SIGTERM if the daemon does not notice within UNMOUNT_NOTICE_S.

    A process that entered a new mount namespace while the mount was up (any
    ``ip netns exec``) holds a copy of it: ``fusermount3 -u`` then detaches
    only our copy, the kernel keeps the FUSE connection open, and the daemon
    waits until that other process exits.  SIGTERM ends its FUSE loop and
    drains, like an unmount.
    """
    subprocess.run(["fusermount3", "-u", m.mountpoint], check=False, capture_output=True)
    try:
        return m.proc.wait(UNMOUNT_NOTICE_S)
    except subprocess.TimeoutExpired:
        m.proc.send_signal(signal.SIGTERM)
    return m.stop(timeout_s)


def write_timed(path: str, data: bytes) -> float:
    """Write ``data`` (1 MiB writes) and return how long close() took."""
    f = open(path, "wb")
    try:
        for off in range(0, len(data), MiB):
            f.write(data[off: off + MiB])
    finally:
        t0 = time.monotonic()
        f.close()
    return time.monotonic() - t0


def assert_all_durable_and_exact(faulty: FaultyS3, m, files: dict[str, bytes]) -> None:
    """Durable, exact through the mount (pool dropped) and in moto; nothing else in the bucket."""
    deadline = time.monotonic() + DURABLE_WAIT_S
    for name in files:
        left = max(1.0, deadline - time.monotonic())
        assert wait_state(m.path(name), "durable", left) == "durable", f"{name}: {state(m.path(name))}\n{m.log()[-3000:]}"
    faulty.proxy.set(down=False, error_rate=0.0, delay_s=0.0)  # read back without faults: what is checked here is the upload
    assert json.loads(aiturbo("drop-cache", m.mountpoint).stdout).get("ok")
    for name, data in files.items():
        with open(m.path(name), "rb") as f:
            assert sha(f.read()) == sha(data), f"{name}: the mount reads other bytes"
        assert sha(faulty.object(name)) == sha(data), f"{name}: the bucket holds other bytes"
    assert faulty.keys() == sorted(f"pre/{n}" for n in files), "extra or missing keys in the bucket"
    assert faulty.open_uploads() == [], "multipart uploads left open"
    assert "BUG" not in m.log()


def mixed_files(prefix: str) -> dict[str, bytes]:
    """Single-part (PutObject) and multipart files, some with a short last part."""
    sizes = [1, 700 * 1024, 3 * MiB, CHUNK, 2 * CHUNK + 12345, 3 * CHUNK - 1]
    return {f"{prefix}{i}.bin": secrets.token_bytes(n) for i, n in enumerate(sizes)}


# ------------------------------------------------------------------------------ the proxy


def test_the_proxy_answers_a_failed_head_without_a_body(s3_server):
    """A HEAD's answer has no body: one sent anyway is read by the client as
    the start of its next answer on that connection (aiohttp: "Bad status
    line"), a fault S3 never makes."""
    bucket = s3_server.make_bucket(f"f-{secrets.token_hex(6)}")
    with FaultyS3Proxy(s3_server.port) as proxy, socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
        proxy.set(error_rate=1.0, error_methods=frozenset({"HEAD"}))
        c.sendall(f"HEAD /{bucket}/missing HTTP/1.1\r\nHost: s3\r\n\r\n".encode())
        got = b""
        while b"\r\n\r\n" not in got:
            got += c.recv(65536)
        assert got.startswith((b"HTTP/1.1 500 ", b"HTTP/1.1 503 ")), got
        proxy.set(error_rate=0.0)
        c.sendall(f"GET /{bucket}/missing HTTP/1.1\r\nHost: s3\r\n\r\n".encode())
        while got.count(b"\r\n\r\n") < 2:
            got += c.recv(65536)
        second = got.split(b"\r\n\r\n", 1)[1]
        assert second.startswith(b"HTTP/1.1 404 "), second[:200]
    assert [r.outcome for r in proxy.log][1:] == ["forwarded"], proxy.log


# ------------------------------------------------------------------------------ outage


def test_outage_close_returns_then_everything_durable_with_bounded_retries(faulty):
    m = faulty.mount()
    outage_s = 12.0
    # The first file is mid-upload when S3 goes away: its multipart upload
    # exists and must be aborted (or completed) once S3 is back.
    first = {"inflight.bin": secrets.token_bytes(3 * CHUNK + 5)}
    # Slow enough that the outage starts before the upload's complete: its
    # parts go out together, and the complete (then the HEAD) comes one
    # delay later.  At 0.1-0.2 s a loaded machine's poll below sometimes
    # missed that window, and the upload was published with no abort to defer.
    faulty.proxy.set(delay_s=(0.5, 0.8))
    write_timed(m.path("inflight.bin"), first["inflight.bin"])
    deadline = time.monotonic() + 10
    while not faulty.proxy.requests(method="PUT", outcome="forwarded") and time.monotonic() < deadline:
        time.sleep(0.02)  # until the first part is on its way
    faulty.proxy.set(down=True, delay_s=0.0)
    t_down = time.monotonic()
    assert state(m.path("inflight.bin")) != "durable", "the upload ended before the outage"
    files = {**first, **mixed_files("down")}
    closes = {name: write_timed(m.path(name), data) for name, data in files.items() if name not in first}
    assert max(closes.values()) < 0.5, f"close() waited for the backend: {closes}"
    assert all(state(m.path(n)) in ("staged", "persisting") for n in files)
    time.sleep(max(0.0, t_down + outage_s - time.monotonic()))
    t_up = time.monotonic()
    faulty.proxy.set(down=False)
    # Backoff bound: each file in flight retries at PERSIST_BACKOFF_FIRST_S,
    # doubling, so after 6 s of outage a file waits >= 3.2 s x (1 - jitter)
    # = 1.6 s between attempts, and one attempt costs at most a create or put
    # per part in flight plus an abort and a connection.  Without backoff (a
    # retry per failed connect) this is hundreds of attempts per second.
    tail_s = 5.0
    attempts = faulty.proxy.requests(t_up - tail_s, t_up)
    per_attempt = PERSIST_PARTS_IN_FLIGHT + 2
    bound = PERSIST_FILES_IN_FLIGHT * per_attempt * tail_s / 1.6
    assert len(attempts) <= bound, f"{len(attempts)} requests in the last {tail_s} s of the outage (bound {bound:.0f})"
    assert faulty.proxy.requests(t_down, t_up), "nothing tried the backend during the outage"
    assert_all_durable_and_exact(faulty, m, files)
    durable_s = time.monotonic() - t_up
    # The nasty case did happen: the in-flight upload's abort failed while S3
    # was down, and it was aborted later (no upload is left open, see above).
    assert "s3_abort_deferred" in open(m.log_path, errors="replace").read()  # (the whole log: m.log() is its last 20,000 characters)
    seconds = faulty.proxy.per_second(t_down, t_up)
    print(f"outage: closes max {max(closes.values()) * 1000:.1f} ms; requests per second while down: "
          f"{[sum(c.values()) for c in seconds]} (last {tail_s:.0f} s: {len(attempts)}, bound {bound:.0f}); "
          f"all durable and checked {durable_s:.1f} s after recovery")


# ------------------------------------------------------------------------- 5xx errors


def test_five_percent_5xx_every_file_durable_once(faulty):
    m = faulty.mount()
    faulty.proxy.set(error_rate=0.05)
    sizes = [1, 700 * 1024, 3 * MiB, CHUNK, CHUNK + 12345, 2 * CHUNK - 1]
    files: dict[str, bytes] = {}
    injected = 0
    # Enough traffic for the faults to happen (~5.5 requests a file, ~1.6
    # faults a batch): more batches until a few were injected, each batch
    # while the last persists.  The count lags a batch behind (its uploads
    # run after its writes), so the cap is far above what it takes: 8 once
    # ended with 3 faults.
    for batch in range(24):
        new = {f"b{batch}-{i}.bin": secrets.token_bytes(n) for i, n in enumerate(sizes)}
        for name, data in new.items():
            write_timed(m.path(name), data)
        files.update(new)
        injected = sum(len(faulty.proxy.requests(outcome=o)) for o in ("error", "error-after"))
        if batch >= 2 and injected >= 4:
            break
    assert_all_durable_and_exact(faulty, m, files)
    errors = faulty.proxy.requests(outcome="error")
    after = faulty.proxy.requests(outcome="error-after")
    assert len(errors) + len(after) >= 4, "too few faults injected to test anything"
    assert "broken" not in m.log()
    print(f"5xx: {len(faulty.proxy.requests())} requests, {len(errors)} failed before and {len(after)} "
          f"after the server acted, {len(files)} files, {m.log().count('s3_abort_deferred')} abort(s) deferred")


# ------------------------------------------------------------------------ slow backend


def test_reads_ride_out_transient_errors(faulty):
    """A reader of durable files whose chunks must come from S3 while 15% of
    requests fail with 5xx gets every byte, not EIO: reads retry transient
    errors (24 chunk reads: without retries one of them fails 98% of the time)."""
    m = faulty.mount()
    files = {f"r{i}.bin": secrets.token_bytes(100 * 1024 + i) for i in range(24)}
    for name, data in files.items():
        write_timed(m.path(name), data)
    for name in files:
        assert wait_state(m.path(name), "durable", DURABLE_WAIT_S) == "durable", m.log()[-3000:]
    faulty.proxy.set(error_rate=0.15)

    def failed_chunk_reads():
        return [r for r in faulty.proxy.requests(method="GET")
                if r.outcome in ("error", "error-after") and "/pre/r" in r.target]

    for _ in range(3):  # until a chunk read was failed (each pass: 24 reads at 15%)
        assert json.loads(aiturbo("drop-cache", m.mountpoint).stdout).get("ok")
        for name, data in files.items():
            # O_DIRECT: past the kernel's page cache, so every pass asks the daemon
            # (and S3) again; cached pages made later passes read nothing.
            got = pread_direct(m.path(name), 0, -(-len(data) // 4096) * 4096)
            assert sha(got) == sha(data), f"{name}: the mount reads other bytes"
        if failed_chunk_reads():
            break
    faulty.proxy.set(error_rate=0.0)
    failed = failed_chunk_reads()
    assert failed, "no chunk read failed: the fault injection did not happen"
    st = json.loads(aiturbo("status", m.mountpoint, "--json").stdout)
    assert st["persist"]["read_retries"] >= len(failed), (len(failed), st["persist"])
    assert "BUG" not in m.log()


def test_slow_backend_does_not_slow_close(faulty):
    m = faulty.mount()
    lo = 0.2
    faulty.proxy.set(delay_s=(lo, 0.5))
    files = mixed_files("slow")
    closes = {name: write_timed(m.path(name), data) for name, data in files.items()}
    # close() makes no backend request at all, so it is faster than one request.
    assert max(closes.values()) < lo, f"close() waited for the backend: {closes}"
    assert_all_durable_and_exact(faulty, m, files)
    print(f"slow: closes max {max(closes.values()) * 1000:.1f} ms")


# ---------------------------------------------------------------------- memory pressure


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


# See docs/memory.md for how these were measured.
BUDGET = 64 * MiB  # big enough that a leak of its size stands out of the overhead
RSS_OVERHEAD_BYTES = 80 * MiB  # above the idle process plus the budget: measured 22-65 MiB (docs/memory.md)


@pytest.mark.parametrize("spill", [False, True], ids=["no-spill", "spill"])
def test_memory_pressure_rss_stays_in_budget(spill, faulty, tmp_path):
    options = {"dram": f"{BUDGET // MiB}M"}
    if spill:
        options["spill"] = str(tmp_path / "spill")
    m = faulty.mount(**options)
    pid = m.proc.pid
    # Baseline: an idle mount that has done one small round trip (imports and
    # the S3 client's first connection are made).
    small = secrets.token_bytes(1000)
    write_timed(m.path("warm.bin"), small)
    assert wait_state(m.path("warm.bin"), "durable", DURABLE_WAIT_S) == "durable"
    # The pool's own buffers (warm ones count against the budget) are not
    # overhead.  A warm buffer is counted before its pages are touched, so
    # the largest of a few samples is the settled value.
    samples = []
    for _ in range(5):
        pool_used = json.loads(aiturbo("status", m.mountpoint, "--json").stdout)["pool"]["used_bytes"]
        samples.append(vm_kib(pid, "VmRSS") * 1024 - pool_used)
        time.sleep(0.2)
    baseline = max(samples)
    faulty.proxy.set(delay_s=(0.05, 0.15))
    files = {"warm.bin": small}
    files.update({f"p{i}.bin": secrets.token_bytes(BUDGET // 2 + i * 4097) for i in range(6)})  # 3x the budget
    errors: list[BaseException] = []

    def writer(names):
        try:
            for n in names:
                write_timed(m.path(n), files[n])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    names = [n for n in files if n != "warm.bin"]
    threads = [threading.Thread(target=writer, args=(names[i::2],)) for i in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    written_s = time.monotonic() - t0
    assert not errors, f"a writer failed (no ENOSPC from the cache is allowed): {errors!r}"
    for name in files:
        assert wait_state(m.path(name), "durable", DURABLE_WAIT_S) == "durable", name
    hwm = vm_kib(pid, "VmHWM") * 1024  # before the read-back below, which is not under test here
    over = hwm - baseline - BUDGET
    print(f"memory[{'spill' if spill else 'no-spill'}]: process without pool {baseline / MiB:.1f} MiB, "
          f"high-water {hwm / MiB:.1f} MiB = that + budget {BUDGET / MiB:.0f} MiB + {over / MiB:.1f} MiB; "
          f"{sum(map(len, files.values())) / MiB:.0f} MiB written in {written_s:.1f} s")
    assert over <= RSS_OVERHEAD_BYTES, (
        f"RSS high-water {hwm / MiB:.1f} MiB is {over / MiB:.1f} MiB above the idle process "
        f"({baseline / MiB:.1f} MiB without its pool) plus the {BUDGET / MiB:.0f} MiB budget: "
        f"more than the documented {RSS_OVERHEAD_BYTES / MiB:.0f} MiB overhead (docs/memory.md)"
    )
    assert_all_durable_and_exact(faulty, m, files)
    assert "broken" not in m.log()


@pytest.mark.skipif(not installed(), reason=SKIP_REASON)
def test_metadata_restart_while_files_persist_loses_none(faulty):
    # A lost PostgreSQL connection in the persister was logged as a bug and
    # left the file 'persisting' with its pins held: `aiturbo wait` hung.
    # Files wait for S3 (down), the metadata server dies, S3 comes back: the
    # uploads land while the metadata cannot record them.  Once it is back,
    # every file must become durable.
    with PgServer() as pg:
        m = faulty.mount(meta=pg.url)
        faulty.proxy.set(down=True)
        data = {f"f{i}.bin": secrets.token_bytes(MiB + i) for i in range(4)}
        for name, body in data.items():
            with open(m.path(name), "wb") as f:
                f.write(body)
        assert {state(m.path(n)) for n in data} <= {"staged", "persisting"}
        pg.kill()
        faulty.proxy.set(down=False)
        time.sleep(4)  # retries reach S3 and then the dead metadata server
        pg.start_again()
        for name in data:
            assert wait_state(m.path(name), "durable", timeout_s=DURABLE_WAIT_S) == "durable", m.log()
            assert faulty.object(name) == data[name]
        assert "BUG" not in m.log()
        assert unmount(m) == 0, m.log()
