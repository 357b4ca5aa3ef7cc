"""Future 0 / future 1 end to end, on real mounts over a local dir and a real S3 server.

What close(), fsync(), ``-o sync_close`` and ``aiturbo wait`` promise; that a
backend outage, renames and unlinks of in-flight files, a full DRAM pool and
SIGTERM never lose or misplace a byte; and that errors reach the caller as an
errno while the mount stays up.

The S3 tests stop and restart the module's own moto server (the fixture
``s3m``, an ``OutageS3Server``): a restarted moto is empty, and it is
restarted with its buckets already there, because a persist retry that lands
between "listening" and "bucket re-created" would get NoSuchBucket, a
permanent error, and mark the file broken.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import trio
from fileio import get, local_objects, put, sha
from mounting import aiturbo, aiturbo_proc, assert_no_bug, is_mounted, state, status, wait_state
from waiting import WAIT_S, in_thread, wait_until

from aiturbofs import chunk
from aiturbofs._errors import BackendError, TransientBackendError
from aiturbofs._limits import DIRS_TO_CLEAN_MAX, PERSIST_PARTS_IN_FLIGHT
from aiturbofs.cluster import PersistHints, SingleNode
from aiturbofs.persist import Persister

MiB = 1 << 20
CHUNK = 8 * MiB

# --------------------------------------------------------------------------- helpers


def assert_durable(m, files: dict[str, bytes], backend_objects) -> None:
    """Every file reaches ``durable`` and the backend holds exactly its bytes."""
    for name in files:
        assert wait_state(m.path(name), "durable", WAIT_S) == "durable", name
    objects = backend_objects()
    for name, data in files.items():
        assert name in objects, f"{name} missing from the backend: {sorted(objects)}"
        assert sha(objects[name]) == sha(data), f"{name}: backend bytes differ"


# --------------------------------------------------------------------- close / fsync


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_close_returns_staged_then_durable(kind, request, make_mount, tmp_path):
    if kind == "s3":
        s3m = request.getfixturevalue("s3m")
        m, objects = s3m.mount(), s3m.objects
    else:
        m = make_mount()
        objects = lambda: local_objects(tmp_path / "backend")  # noqa: E731
    files = {"big.bin": os.urandom(2 * CHUNK + 12345), "small.txt": b"hello\n", "empty": b""}
    os.mkdir(m.path("sub"))
    files["sub/exact.bin"] = os.urandom(CHUNK)
    for name, data in files.items():
        put(m.path(name), data)
        assert state(m.path(name)) in ("staged", "persisting", "durable")
        assert get(m.path(name)) == data  # readable at future 0
    assert_durable(m, files, objects)
    assert set(objects()) == set(files)


def test_sync_close_returns_durable(s3m):
    m = s3m.mount(sync_close=True)
    data = os.urandom(CHUNK + 777)
    put(m.path("f.bin"), data)
    assert state(m.path("f.bin")) == "durable"  # no waiting: close() was future 1
    assert s3m.objects() == {"f.bin": data}


def test_sync_close_fails_when_the_file_cannot_become_durable(s3m):
    m = s3m.mount(sync_close=True, persist_retry_window=1)
    s3m.server.stop()
    f = open(m.path("f.bin"), "wb")
    f.write(b"data")
    with pytest.raises(OSError) as caught:
        f.close()
    assert caught.value.errno == errno.EIO
    assert state(m.path("f.bin")) == "broken"


def test_fsync_durable_option(s3m):
    m = s3m.mount(fsync="durable")
    data = os.urandom(CHUNK + 4096)
    with open(m.path("f.bin"), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        assert state(m.path("f.bin")) == "durable"
        assert s3m.objects() == {"f.bin": data}


def test_wait_and_fsync_durable_do_not_wait_for_the_writers_to_pause(make_mount, tmp_path):
    """Uploads wait for the application's writes to pause (-o persist_yield), but never when someone
    waits for durability: here the writers never pause and persist_yield is a minute."""
    m = make_mount(persist_yield="60", fsync="durable")
    os.mkdir(m.path("w"))
    stop = threading.Event()
    written = []

    def writer():  # the application, writing small files without a pause
        i = 0
        while not stop.is_set():
            put(m.path(f"w/{i % 20}"), b"%d" % i)
            i += 1
        written.append(i)

    t = threading.Thread(target=writer)
    t.start()
    try:
        time.sleep(0.5)
        data = os.urandom(CHUNK + 99)
        put(m.path("a.bin"), data)
        t0 = time.monotonic()
        aiturbo("wait", m.path("a.bin"), timeout=50)
        assert state(m.path("a.bin")) == "durable"
        with open(m.path("b.bin"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            assert state(m.path("b.bin")) == "durable"
        assert time.monotonic() - t0 < 40
    finally:
        stop.set()
        t.join()
    assert written and written[0] > 20  # the writer did write meanwhile
    assert get(str(tmp_path / "backend" / "a.bin")) == data  # (w/ may still be uploading: not walked)


def test_fsync_staged_returns_while_backend_down(s3m):
    m = s3m.mount()
    s3m.server.stop()
    data = os.urandom(CHUNK + 5)
    t0 = time.monotonic()
    put(m.path("f.bin"), data, fsync=True)
    assert time.monotonic() - t0 < 10, "fsync=staged must not wait for the backend"
    time.sleep(1)
    assert state(m.path("f.bin")) in ("staged", "persisting")
    assert get(m.path("f.bin")) == data
    s3m.server.start()
    assert_durable(m, {"f.bin": data}, s3m.objects)


def test_fsync_directory_override_waits_for_durable(s3m):
    m = s3m.mount()
    os.mkdir(m.path("ckpt"))
    os.setxattr(m.path("ckpt"), "user.aiturbo.fsync", b"durable")
    s3m.server.stop()
    data = os.urandom(CHUNK + 1)
    plain = os.urandom(1000)
    put(m.path("plain.bin"), plain, fsync=True)  # outside the tagged dir: returns at once
    t, box = in_thread(lambda: put(m.path("ckpt", "shard.bin"), data, fsync=True))
    t.join(3)
    assert t.is_alive(), f"fsync in a fsync=durable dir returned while S3 was down: {box}"
    s3m.server.start()
    t.join(WAIT_S)
    assert not t.is_alive() and "error" not in box, box
    assert state(m.path("ckpt", "shard.bin")) == "durable"
    assert_durable(m, {"ckpt/shard.bin": data, "plain.bin": plain}, s3m.objects)


# ----------------------------------------------------------------- aiturbo wait / status


def test_wait_blocks_through_outage_with_progress(s3m):
    m = s3m.mount()
    os.mkdir(m.path("ckpt"))
    s3m.server.stop()
    files = {f"ckpt/shard{i}.bin": os.urandom(CHUNK // 2 + i) for i in range(3)}
    for name, data in files.items():
        put(m.path(name), data)
    r = aiturbo("wait", "--timeout", "1", m.path("ckpt"), check=False)
    assert r.returncode == 3 and "timed out" in r.stderr, r.stderr
    waiter = aiturbo_proc("wait", m.path("ckpt"))
    time.sleep(2)
    assert waiter.poll() is None, "aiturbo wait returned while the backend was down"
    s3m.server.start()
    out, err = waiter.communicate(timeout=WAIT_S)
    assert waiter.returncode == 0, err
    assert "durable" in err and "100%" in err, f"no progress bar on stderr: {err!r}"
    assert_durable(m, files, s3m.objects)


def test_wait_names_broken_file_and_status_reports(s3m):
    m = s3m.mount(persist_retry_window=1)
    good = os.urandom(1000)
    put(m.path("good.bin"), good)
    assert wait_state(m.path("good.bin"), "durable") == "durable"
    s3m.server.stop()
    bad = os.urandom(CHUNK + 3)
    put(m.path("bad.bin"), bad)
    st = status(m)
    assert st["ok"] and st["pool"]["budget_bytes"] > 0
    if state(m.path("bad.bin")) != "broken":  # (read after: the status is from before the 1 s window ran out)
        # in DRAM, or (written by the kernel) on disk; a broken file's chunks are let go
        assert st["pool"]["used_bytes"] + st["pool"]["disk_dirty_bytes"] >= len(bad)
        assert st["persist"]["queue"] >= 1
    r = aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 1, r.stderr
    assert "broken: " + m.path("bad.bin") in r.stderr
    assert "good.bin" not in r.stderr.replace("\r", "\n").split("broken:", 1)[1]
    assert state(m.path("bad.bin")) == "broken"
    assert state(m.path("good.bin")) == "durable"
    with pytest.raises(OSError) as caught:
        get(m.path("bad.bin"))
    assert caught.value.errno == errno.EIO
    st = status(m)
    assert st["persist"]["files_broken"] == 1 and st["persist"]["queue"] == 0
    assert st["persist"]["retries"] >= 1
    assert any("bad.bin" in e and "broken" in e for e in st["errors"]), st["errors"]
    assert "broken path=bad.bin reason=" in m.log()
    text = aiturbo("status", m.mountpoint).stdout
    assert "broken 1" in text and "bad.bin" in text
    assert get(m.path("good.bin")) == good  # from the DRAM cache: durable is not broken


def test_status_while_staged(s3m):
    m = s3m.mount(dram="64M")
    s3m.server.stop()
    data = os.urandom(2 * CHUNK)
    put(m.path("q.bin"), data)
    st = status(m)
    pool, persist = st["pool"], st["persist"]
    assert pool["budget_bytes"] == 64 * MiB
    assert pool["dirty_bytes"] + pool["disk_dirty_bytes"] >= len(data) and pool["pinned_chunks"] == 2
    assert pool["used_bytes"] <= pool["budget_bytes"]
    assert persist["queue"] == 1 and persist["queued"] == ["q.bin"]
    assert st["errors"] == []
    s3m.server.start()
    assert_durable(m, {"q.bin": data}, s3m.objects)
    st = wait_until(lambda: (s := status(m))["pool"]["pinned_chunks"] == 0 and s, what="pins released")
    assert st["persist"]["queue"] == 0 and st["persist"]["files_durable"] == 1
    assert st["pool"]["dirty_bytes"] == 0 and st["pool"]["disk_dirty_bytes"] == 0


# ---------------------------------------------------------- namespace changes in flight


def test_rename_and_unlink_while_persisting(s3m):
    m = s3m.mount()
    put(m.path("old.bin"), b"old version")  # durable before the outage, then replaced
    assert wait_state(m.path("old.bin"), "durable") == "durable"
    s3m.server.stop()
    a, c = os.urandom(CHUNK + 11), os.urandom(3 * MiB)
    put(m.path("a.bin"), a)
    os.rename(m.path("a.bin"), m.path("b.bin"))
    put(m.path("c.bin"), c)
    os.unlink(m.path("c.bin"))
    os.mkdir(m.path("d"))
    x, y = os.urandom(MiB), os.urandom(CHUNK + 2)
    put(m.path("d", "x"), x)
    put(m.path("d", "y"), y)
    os.rename(m.path("d"), m.path("e"))
    new_old = os.urandom(5000)
    put(m.path("tmp.bin"), new_old)
    os.rename(m.path("tmp.bin"), m.path("old.bin"))  # replaces a durable file
    time.sleep(1)
    s3m.server.start()  # empty: the old durable object is gone too
    r = aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    want = {"b.bin": a, "e/x": x, "e/y": y, "old.bin": new_old}
    objects = s3m.objects()
    assert sorted(objects) == sorted(want)
    for k, v in want.items():
        assert sha(objects[k]) == sha(v), k
        assert get(m.path(k)) == v
    assert_no_bug(m.log())



def test_rename_and_unlink_mid_upload(s3m):
    m = s3m.mount()
    big, moved = secrets.token_bytes(40 * MiB), secrets.token_bytes(40 * MiB)
    put(m.path("gone.bin"), big)
    put(m.path("moving.bin"), moved)
    wait_until(lambda: status(m)["persist"]["bytes_uploaded"] > 0, what="uploads to start")
    os.unlink(m.path("gone.bin"))
    os.mkdir(m.path("dst"))
    os.rename(m.path("moving.bin"), m.path("dst", "moved.bin"))
    r = aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: status(m)["persist"]["queue"] == 0, what="the persist queue to empty")
    objects = s3m.objects()
    assert sorted(objects) == ["dst/moved.bin"], sorted(objects)
    assert sha(objects["dst/moved.bin"]) == sha(moved)
    uploads = s3m.server.client().list_multipart_uploads(Bucket=s3m.bucket).get("Uploads", [])
    assert uploads == [], "multipart uploads left behind"


# ------------------------------------------------------------------------ backpressure


class PoolWatcher:
    """Samples ``aiturbo status`` in the background: the pool must stay in budget."""

    def __init__(self, m):
        self.m = m
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            r = aiturbo("status", self.m.mountpoint, "--json", check=False)
            if r.returncode == 0:
                self.samples.append(json.loads(r.stdout)["pool"])
            self._stop.wait(0.1)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.samples


@pytest.mark.parametrize("spill", [False, True], ids=["no-spill", "spill"])
def test_backpressure_loses_nothing(spill, s3m, tmp_path, daemon_data_path):
    budget = 32 * MiB
    options = {"dram": "32M"}
    if spill:
        # The backend is held back while the files are written: nothing becomes clean, so what does
        # not fit must spill.  (Left running, it kept up with a writer slowed down by a loaded machine,
        # and nothing spilled.)  No re-listing of the root meanwhile: it would wait for the server.
        options.update(spill=str(tmp_path / "spill"), import_ttl=3600)
    m = s3m.mount(**options)
    rng = secrets.token_bytes
    files = {f"f{i}.bin": rng(12 * MiB + i) for i in range(4)}
    files["huge.bin"] = rng(3 * budget - sum(map(len, files.values())))  # larger than the budget
    assert len(files["huge.bin"]) > budget
    assert os.listdir(m.mountpoint) == []  # (listed before the server is held back)
    watcher = PoolWatcher(m)
    t0 = time.monotonic()
    if spill:
        s3m.server.freeze()
    try:
        for name, data in files.items():
            with open(m.path(name), "wb") as f:
                for off in range(0, len(data), MiB):
                    f.write(data[off: off + MiB])
    finally:
        if spill:
            s3m.server.thaw()
    written_s = time.monotonic() - t0
    r = aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S)
    samples = watcher.stop()
    assert r.returncode == 0, r.stderr
    assert samples, "no status samples"
    peak = {k: max(s[k] for s in samples) for k in samples[0]}
    assert peak["used_bytes"] <= budget, peak
    assert peak["used_bytes"] > budget // 2, f"the pool never filled up: no backpressure tested {peak}"
    if spill:
        assert peak["spilled_bytes"] > 0, peak
    assert all(s["budget_bytes"] == budget for s in samples)
    assert m.stop() == 0
    # Nothing lost: a fresh mount (new state dir, empty pool) reads the backend.
    fresh = s3m.mount(name="fresh")
    for name, data in files.items():
        assert os.stat(fresh.path(name)).st_size == len(data)
        assert sha(get(fresh.path(name))) == sha(data), name
    assert "broken" not in m.log(), f"wrote {sum(map(len, files.values())) >> 20} MiB in {written_s:.1f} s"


def put_unaligned(path: str, data: bytes, skew: int = 48) -> None:
    """``skew`` bytes, then 1 MiB writes: every write straddles a chunk boundary's neighbourhood."""
    with open(path, "wb", buffering=0) as f:
        f.write(data[:skew])
        for off in range(skew, len(data), MiB):
            f.write(data[off: off + MiB])


_HOLD_OPEN = """
import sys
with open(sys.argv[1], "r+b", buffering=0) as f, open(sys.argv[2], "rb") as src:
    f.write(src.read())
    print("written", flush=True)
    sys.stdin.readline()
"""


def test_rewrite_while_uploading_keeps_the_committed_versions_chunks(s3m, tmp_path):
    """A chunk rewritten while the version naming it still uploads stays in DRAM.

    The committed version is what a crash or a reader falls back on, so its
    chunks stay pinned until a version at least as new is durable, even when
    the open file's slots already hold newer bytes.  Releasing the pin with
    the slot let pool pressure evict the chunk mid-upload, and that version
    was marked broken.  Also: a write that fills a chunk and waits for memory
    for the next one must not let the sealer hash the filled chunk short.
    """
    m = s3m.mount(dram="32M")
    s3m.server.stop()
    v1 = secrets.token_bytes(2 * CHUNK)
    put(m.path("f.bin"), v1)  # committed: staged, its upload retries against the outage
    new_head = secrets.token_bytes(CHUNK)
    (tmp_path / "head").write_bytes(new_head)
    # Another process keeps the file open and dirty: this one forks the S3
    # server, and a child closing an inherited descriptor would flush (commit) it.
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_OPEN, m.path("f.bin"), str(tmp_path / "head")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "written\n"  # chunk 0 replaced; version 1 still names the old one
        g = secrets.token_bytes(2 * CHUNK)
        # pool pressure: evictable is only the old chunk 0.  The writes are
        # not chunk-aligned, so the one that fills g's chunk 0 goes on into
        # chunk 1 and waits for memory while chunk 0 is sealed.
        writer, box = in_thread(put_unaligned, m.path("g.bin"), g)
        writer.join(3)
        s3m.server.start()
        writer.join(WAIT_S)
        assert not writer.is_alive() and "error" not in box, box
        # the file is still open and dirty: version 1 is what the persister uploads
        wait_until(lambda: "broken" in m.log() or s3m.objects().get("f.bin") == v1, what="version 1 persisted")
        assert "broken" not in m.log(), m.log()[-3000:]
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(WAIT_S) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    v2 = new_head + v1[CHUNK:]
    assert_durable(m, {"f.bin": v2, "g.bin": g}, s3m.objects)
    assert get(m.path("f.bin")) == v2
    assert status(m)["errors"] == [], status(m)["errors"]
    assert_no_bug(m.log())


# ---------------------------------------------------------------------- backend outage


def test_outage_mid_persist_recovers_with_bounded_retries(s3m):
    m = s3m.mount()
    data = secrets.token_bytes(48 * MiB)
    put(m.path("big.bin"), data)
    wait_until(lambda: state(m.path("big.bin")) in ("persisting", "durable"), what="the upload to start")
    time.sleep(0.1)  # some parts on the wire
    s3m.server.stop()
    assert state(m.path("big.bin")) != "durable", "the upload finished before the outage (test too small?)"
    outage_s = 5.0
    t0 = time.monotonic()
    time.sleep(outage_s)
    retries = status(m)["persist"]["retries"]
    elapsed = time.monotonic() - t0
    assert 1 <= retries <= 2 * elapsed + 3, f"{retries} retries in {elapsed:.1f} s of outage"
    s3m.server.start()
    assert_durable(m, {"big.bin": data}, s3m.objects)
    assert sorted(s3m.objects()) == ["big.bin"]
    assert "persist_retry path=" in m.log()
    assert_no_bug(m.log())


def test_file_of_more_chunks_than_parts_goes_in_wide_parts(s3m):
    """D4: S3 takes 10,000 parts, so at one 8 MiB chunk a part an object ended
    at ~78 GiB: a larger file passed close() and was marked broken at persist.
    ``s3_parts_max=2`` stands in for the limit at test scale: 5 chunks go as 2
    parts of 3 chunks, holes (chunks never written) as zeros."""
    m = s3m.mount(s3_parts_max="2")
    head, tail = os.urandom(CHUNK + 5), os.urandom(CHUNK + 3 * MiB)
    with open(m.path("big.bin"), "wb") as f:
        f.write(head)
        f.seek(3 * CHUNK)  # chunk 1 is partly a hole, chunk 2 wholly
        f.write(tail)
    want = head + bytes(3 * CHUNK - len(head)) + tail
    assert wait_state(m.path("big.bin"), "durable", WAIT_S) == "durable"
    assert sha(s3m.objects()["big.bin"]) == sha(want)
    c = s3m.server.client()
    first = c.head_object(Bucket=s3m.bucket, Key="pre/big.bin", PartNumber=1)
    assert first["PartsCount"] == 2 and first["ContentLength"] == 3 * CHUNK
    assert re.search(r"5 chunks exceed the backend's 2 parts; sending 2 parts of 24 MiB", m.log()), m.log()[-3000:]
    assert get(m.path("big.bin")) == want
    assert_no_bug(m.log())


def test_size_beyond_what_the_backend_holds_is_efbig(s3m, daemon_data_path):
    """D4: a file the backend cannot hold is refused at write time (EFBIG), not
    accepted and broken at persist; up to the limit everything is accepted."""
    m = s3m.mount(s3_parts_max="1")  # one part of at most 5 GiB: objects of 5 GiB
    limit = 5 << 30
    fd = os.open(m.path("f.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as e:
            os.ftruncate(fd, limit + 1)
        assert e.value.errno == errno.EFBIG
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"x", limit)
        assert e.value.errno == errno.EFBIG
        assert os.pwrite(fd, b"ok", 0) == 2
    finally:
        os.close(fd)
    assert wait_state(m.path("f.bin"), "durable", WAIT_S) == "durable"
    assert s3m.objects() == {"f.bin": b"ok"}
    assert "the most the backend can hold" in m.log()
    assert_no_bug(m.log())


async def test_parts_failing_together_are_one_transient_error():
    """Regression: parts failing in one outage raised an exception group, which
    the retry loop did not catch: the file was left "persisting", never retried."""
    parts = PERSIST_PARTS_IN_FLIGHT

    class Upload:
        def __init__(self):
            self.waiting, self.go, self.aborted = 0, trio.Event(), False

        async def write_part(self, index, data):
            self.waiting += 1
            if self.waiting == parts:
                self.go.set()
            await self.go.wait()  # every part wakes in the same scheduler batch
            raise TransientBackendError(f"write part {index}: connection refused")

        async def zero_part(self, index, length):  # the parts are holes: no pool needed
            await self.write_part(index, None)

        async def complete(self, size):
            raise AssertionError("complete after failed parts")

        async def abort(self):
            self.aborted = True

    upload = Upload()

    async def open_upload(key):
        return upload

    fs = SimpleNamespace(meta=None, pool=None, cluster=SingleNode(), backend=SimpleNamespace(open_upload=open_upload),
                         store=SimpleNamespace(ns_lock=trio.Lock()))
    row = SimpleNamespace(ino=7, size=parts * CHUNK, manifest=chunk.pack_manifest([chunk.HOLE] * parts), backend_keys=[])

    async def main():
        with pytest.raises(TransientBackendError, match="connection refused"):
            await Persister(fs).uploads.send(row, "k")

    await main()
    assert upload.aborted


class FakeMeta:
    """The few metadata calls a persist job makes, on one inode whose version a test moves."""

    def __init__(self, ino: int, version: int):
        self.row = SimpleNamespace(ino=ino, version=version, nlink=1, state="persisting", backend_keys=[])
        self.states: list[tuple[str, int | None]] = []

    async def get_inode(self, ino):
        return self.row

    async def paths_of(self, ino):
        return ["f.bin"]

    async def inodes_in_states(self, states):
        return []  # (a drain's check of what the queue may have dropped)

    async def set_state(self, ino, state, *, if_version=None, **fields):
        self.states.append((state, if_version))
        if if_version is not None and if_version != self.row.version:
            return False
        self.row.state = state
        return True


def fake_fs(meta=None):
    errors = []
    return SimpleNamespace(meta=meta, pool=None, cluster=SingleNode(), backend=None, errors=errors,
                           options=SimpleNamespace(persist_retry_window_s=0.0, persist_yield_s=0.0),
                           record_error=lambda msg, event=None: errors.append(msg),
                           is_open=lambda ino: False,
                           store=SimpleNamespace(ns_lock=trio.Lock(), health=SimpleNamespace(mark_up=lambda: None)))


async def test_broken_marks_the_version_that_failed_not_a_newer_one():
    """D14: version 2 committed between version 1's failed upload and the
    marking was marked broken (and unpinned) without ever being tried."""
    meta = FakeMeta(7, version=1)
    p = Persister(fake_fs(meta))

    async def reconcile(ino):
        p.reconciler.trying[ino] = 1  # the job uploads version 1 ...
        meta.row.version = 2  # ... and a commit lands as its upload fails for good
        raise BackendError("part 0 of 'f.bin': refused")

    p.reconciler.reconcile = reconcile
    await p._persist_one(7)
    assert ("broken", 2) not in meta.states
    assert meta.row.state != "broken"
    assert 7 in p._pending  # version 2 gets a job of its own
    assert p.stats.files_broken == 0


async def test_finished_jobs_drop_their_round_hints():
    """D12: the round plan's hints were kept for every grouped commit forever."""
    p = Persister(fake_fs(FakeMeta(7, version=1)))

    async def reconcile(ino):
        return None

    p.reconciler.reconcile = reconcile
    for ino in range(1, 201):
        p.set_hints(ino, 1, PersistHints())
        await p._persist_one(ino)
    assert p.uploads.hints == {}


async def test_a_late_deferral_leaves_the_object_another_file_moved_in(tmp_path):
    """Two durable files swap names (RENAME_EXCHANGE) and one of them is
    unlinked at once.  Its job had decided to wait for the other; the other,
    no longer held back by an unlinked file, moved its object onto the old
    name.  The waiting job then moved that object aside as if it were still
    its own, and unlinking its file deleted the other file's only copy (the
    random namespace test lost a file in CI this way)."""
    from aiturbofs.backend import open_backend
    from aiturbofs.meta import ROOT_INO, STATE_DURABLE, InodeRow, open_meta

    (tmp_path / "backend").mkdir()

    meta = open_meta(f"sqlite://{tmp_path}/meta.db")
    await meta.init(root_uid=0, root_gid=0, root_mode=0o755)
    backend = await open_backend(f"file://{tmp_path}/backend")
    inos = {}
    for name, body in ((b"a", b"A" * 10), (b"b", b"B" * 20)):
        (tmp_path / "backend" / name.decode()).write_bytes(body)
        row = await meta.create(ROOT_INO, name, InodeRow(0, 0o100644, 0, 0, len(body), 1, 0, 0, 0))
        await meta.set_state(row.ino, STATE_DURABLE, backend_keys=[name.decode()], persisted_version=row.version)
        inos[name] = row.ino
    a, b = inos[b"a"], inos[b"b"]
    host = fake_fs(meta)
    host.backend = backend
    host.notify_state = lambda ino: None
    p = Persister(host)
    rec = p.reconciler
    await meta.rename(ROOT_INO, b"a", ROOT_INO, b"b", exchange=True)
    p.enqueue(a, moved=True)
    p.enqueue(b, moved=True)
    # b's job finds its new name "a" still holding a's object: it will wait.
    p.running.add(b)
    rec.job_started(b)
    row_b = await meta.get_inode(b)
    assert not await rec._relocate(row_b, ["a"])
    # Before it defers, b is unlinked, and a's job moves a's object onto "b".
    await meta.unlink(ROOT_INO, b"a")
    p.running.add(a)
    rec.job_started(a)
    assert await rec._relocate(await meta.get_inode(a), ["b"])
    p.running.discard(a)
    rec.job_ended(a, again=False)
    await rec._defer(row_b, ["a"])
    assert (tmp_path / "backend" / "b").read_bytes() == b"A" * 10
    assert (await meta.get_inode(a)).backend_keys == ["b"]
    assert "b" not in (await meta.get_inode(b)).backend_keys  # its object there is gone
    await meta.close()


async def _attrs_persister(tmp_path, data: bytes, *, durable: bool):
    """A persister over SQLite and a file:// backend holding file ``f`` (0644, durable or staged)."""
    from aiturbofs.backend import open_backend
    from aiturbofs.meta import ROOT_INO, STATE_DURABLE, InodeRow, open_meta

    (tmp_path / "backend").mkdir()
    meta = open_meta(f"sqlite://{tmp_path}/meta.db")
    await meta.init(root_uid=0, root_gid=0, root_mode=0o755)
    backend = await open_backend(f"file://{tmp_path}/backend")
    row = await meta.create(ROOT_INO, b"f", InodeRow(0, 0o100644, 0, 0, len(data), 1, 0, 10**18, 0))
    if durable:
        (tmp_path / "backend" / "f").write_bytes(data)
        await meta.set_state(row.ino, STATE_DURABLE, backend_keys=["f"], persisted_version=row.version,
                             persisted_attrs=row.attrs())
    host = fake_fs(meta)

    async def on_persisted(ino, row):
        pass

    host.backend, host.notify_state, host.on_persisted = backend, lambda ino: None, on_persisted
    host.is_open = host.is_cached = lambda ino: False
    host.unlinked_keys = set
    host.pool = SimpleNamespace(accept_waits=lambda: None)
    return Persister(host), meta, row.ino


def send_in_one_part(p, data: bytes) -> None:
    """The persister's uploads send ``data`` (the test's file content) in one part."""
    real_open_upload = p.backend.open_upload

    async def send(row, key):
        upload = await real_open_upload(key)
        await upload.write_part(0, data)
        return upload
    p.uploads.send = send


async def test_a_chmod_of_a_durable_file_that_cannot_reach_the_backend_leaves_it_durable(tmp_path):
    """Only its attributes are missing there: never ``broken`` (reads would get EIO)."""
    p, meta, ino = await _attrs_persister(tmp_path, b"data", durable=True)
    await meta.set_attrs(ino, mode=0o100600)
    async def unavailable(key, attrs):
        raise TransientBackendError("no answer")
    p.backend.set_attrs = unavailable
    await p._persist_one(ino)  # retry window 0: given up at once
    row = await meta.get_inode(ino)
    assert (row.state, p.stats.files_broken) == ("durable", 0)
    assert p.attrs_pending(row)  # asked again at the next change or state query
    await meta.close()


async def test_a_chmod_landing_after_the_upload_read_the_attributes_is_pushed_after_it(tmp_path):
    """The upload publishes with the mode read just before its rename; a chmod after
    that (before the file is marked durable) is given to the object by the same job."""
    data = b"x" * 1000

    p, meta, ino = await _attrs_persister(tmp_path, data, durable=False)
    real_open_upload = p.backend.open_upload
    async def send(row, key):
        upload = await real_open_upload(key)
        await upload.write_part(0, data)
        real_complete = upload.complete
        async def complete(size, *, attrs=None):
            assert attrs is not None and attrs.mode == 0o100644
            await meta.set_attrs(ino, mode=0o100600, mtime_ns=7)  # the race
            return await real_complete(size, attrs=attrs)
        upload.complete = complete
        return upload
    p.uploads.send = send
    await p._persist_one(ino)
    st = os.stat(tmp_path / "backend" / "f")
    assert (st.st_mode, st.st_mtime_ns) == (0o100600, 7)
    row = await meta.get_inode(ino)
    assert row.state == "durable" and row.persisted_attrs == row.attrs()
    assert (p.stats.files_durable, p.stats.attrs_persisted) == (1, 1)
    await meta.close()


async def test_a_file_renamed_back_during_its_upload_leaves_no_object_its_row_does_not_name(tmp_path):
    """``f`` (durable, v1) is renamed to ``g`` and rewritten; its upload publishes v2 at ``g``, and the
    rename back to ``f`` lands as the job deletes its stale v1 object at ``f`` (renames do not wait for
    ``ns_lock``).  The delete took the file itself for "the file that has this name now, which put its own
    object there", kept v1 at ``f`` and dropped the key from the row: an object no row named.  An unlink
    and a kill -9 later the import brought the removed file back with v1 (the torture suite's kill -9
    case, seed 999583)."""
    from aiturbofs.meta import ROOT_INO, STATE_STAGED

    v1, v2 = b"1" * 1000, b"2" * 2000
    p, meta, ino = await _attrs_persister(tmp_path, v1, durable=True)
    await meta.rename(ROOT_INO, b"f", ROOT_INO, b"g")
    row = await meta.set_attrs(ino, version=2, size=len(v2), state=STATE_STAGED)
    send_in_one_part(p, v2)
    removals = p.reconciler.removals
    real_delete_key = removals.delete_key
    async def delete_key(key, ino):
        if key == "f":
            await meta.rename(ROOT_INO, b"g", ROOT_INO, b"f")  # the race
        await real_delete_key(key, ino)
    removals.delete_key = delete_key
    p.running.add(ino)
    p.reconciler.job_started(ino)
    assert await p.reconciler._upload_version(row, ["g"])
    keys = (await meta.get_inode(ino)).backend_keys
    assert sorted(os.listdir(tmp_path / "backend")) == sorted(keys) == ["g"]
    assert (tmp_path / "backend" / "g").read_bytes() == v2
    p.running.discard(ino)
    p.reconciler.job_ended(ino, again=False)
    await meta.unlink(ROOT_INO, b"f")  # then, before the job moves ``g`` to ``f``, the file goes
    await p._persist_one(ino)
    assert os.listdir(tmp_path / "backend") == []  # nothing for an import to bring back
    await meta.close()


async def test_an_upload_job_reads_its_files_row_and_names_twice(tmp_path):
    """Once before the upload, once after the publish (the names) and the durable record (the row): a
    change after those reads queues the file again, so the job does not read them a third time to see
    that nothing is left to do (that was a quarter of the job's metadata calls for a small file)."""
    data = b"x" * 1000
    p, meta, ino = await _attrs_persister(tmp_path, data, durable=False)
    send_in_one_part(p, data)
    before = meta.calls.copy()
    await p._persist_one(ino)
    calls = meta.calls - before
    assert (calls["get_inode"], calls["paths_of"]) == (2, 2), calls
    row = await meta.get_inode(ino)
    assert row.state == "durable" and row.backend_keys == ["f"] and p.stats.files_durable == 1
    await meta.close()


async def test_an_object_is_published_only_where_its_file_records_it_first(tmp_path):
    """A kill -9 between an upload's publish and the durable record used to leave an object no row
    named: when the file had been unlinked meanwhile (a worker's unlink of an open file), the restart
    had nothing to delete and the import brought the deleted name back (the torture suite's kill -9
    case, one run in a hundred).  The key is recorded in the row before the object appears there."""
    data = b"x" * 1000
    p, meta, ino = await _attrs_persister(tmp_path, data, durable=False)
    real_open_upload = p.backend.open_upload
    seen = []
    async def send(row, key):
        upload = await real_open_upload(key)
        await upload.write_part(0, data)
        real_complete = upload.complete
        async def complete(size, *, attrs=None):
            info = await real_complete(size, attrs=attrs)
            seen.append((await meta.get_inode(ino)).backend_keys)  # what a kill -9 now would leave
            return info
        upload.complete = complete
        return upload
    p.uploads.send = send
    await p._persist_one(ino)
    assert seen == [["f"]]
    row = await meta.get_inode(ino)
    assert row.state == "durable" and row.backend_keys == ["f"]
    await meta.close()


async def test_giving_way_at_a_key_recorded_before_a_publish_that_never_came_forgets_it(tmp_path):
    """A job names its target in the row before it publishes there; when the publish never comes (the
    job deferred, or the daemon died first) and another file lives at that name now, giving way finds
    no object to move aside: the key is forgotten, and the job does not fail."""
    from aiturbofs.backend import open_backend
    from aiturbofs.meta import ROOT_INO, InodeRow, open_meta

    (tmp_path / "backend").mkdir()
    meta = open_meta(f"sqlite://{tmp_path}/meta.db")
    await meta.init(root_uid=0, root_gid=0, root_mode=0o755)
    mine = await meta.create(ROOT_INO, b"a", InodeRow(0, 0o100644, 0, 0, 1, 1, 0, 0, 0))
    await meta.set_attrs(mine.ino, backend_keys=["a"])  # named, never published
    await meta.rename(ROOT_INO, b"a", ROOT_INO, b"c")
    await meta.create(ROOT_INO, b"a", InodeRow(0, 0o100644, 0, 0, 1, 1, 0, 0, 0))  # another file there
    host = fake_fs(meta)
    host.backend = await open_backend(f"file://{tmp_path}/backend")
    host.notify_state = lambda ino: None
    p = Persister(host)
    await p.reconciler.removals.give_way(mine.ino, 0o100644)
    assert (await meta.get_inode(mine.ino)).backend_keys == []
    assert os.listdir(tmp_path / "backend") == []
    await meta.close()


async def test_a_move_aside_names_its_hidden_key_before_the_object_goes_there(tmp_path):
    """A kill -9 between a move aside (``give_way``) and its record left the file's only object at a
    hidden key no row named: the restart forgot the old key (nothing there) and the data was gone.  The
    hidden key is named beside the old one before the move, and the restart keeps the one that holds the
    object (``KeyClaims.settled``)."""
    from aiturbofs.backend import ASIDE_PREFIX, open_backend
    from aiturbofs.meta import ROOT_INO, InodeRow, open_meta

    class Killed(BaseException):
        pass

    (tmp_path / "backend").mkdir()
    (tmp_path / "backend" / "a").write_bytes(b"mine")
    meta = open_meta(f"sqlite://{tmp_path}/meta.db")
    await meta.init(root_uid=0, root_gid=0, root_mode=0o755)
    mine = await meta.create(ROOT_INO, b"a", InodeRow(0, 0o100644, 0, 0, 4, 1, 0, 0, 0))
    await meta.set_attrs(mine.ino, backend_keys=["a"])
    await meta.rename(ROOT_INO, b"a", ROOT_INO, b"c")
    await meta.create(ROOT_INO, b"a", InodeRow(0, 0o100644, 0, 0, 1, 1, 0, 0, 0))  # another file there
    host = fake_fs(meta)
    host.backend = await open_backend(f"file://{tmp_path}/backend")
    host.notify_state = lambda ino: None
    real_move = host.backend.move

    async def move_then_die(src, dst):
        await real_move(src, dst)
        raise Killed  # what a kill -9 leaves: the object moved, the record below never written

    host.backend.move = move_then_die
    with pytest.raises(Killed):
        await Persister(host).reconciler.removals.give_way(mine.ino, 0o100644)
    (aside,) = os.listdir(tmp_path / "backend")
    assert aside.startswith(ASIDE_PREFIX)
    assert (await meta.get_inode(mine.ino)).backend_keys == ["a", aside]
    restarted = Persister(host).reconciler
    restarted.note_moved(mine.ino, resumed=True)
    async with restarted.ns_lock:
        row = await restarted.claims.settled(await meta.get_inode(mine.ino))
    assert row.backend_keys == [aside] == (await meta.get_inode(mine.ino)).backend_keys
    assert mine.ino not in restarted.claims.unsure
    await meta.close()


async def test_a_file_queued_while_files_in_flight_wait_gets_a_spare_upload():
    """Every upload in flight waited for a shared chunk that a file not yet
    queued was to upload: when that file was queued, no spare upload started
    (spares were only considered when a file began to wait), so it sat in the
    queue until the waits ran out (CLUSTER_SOURCE_WAIT_S, 120 s; the kv burst
    cluster test failed in CI this way)."""
    p = Persister(fake_fs(FakeMeta(7, version=1)))
    ran = []

    async def reconcile(ino):
        ran.append(ino)

    p.reconciler.reconcile = reconcile

    async def main():
        async with trio.open_nursery() as nursery:
            p._nursery = nursery  # no regular workers: they all wait for a source
            p._files_wait(+1)  # a file in flight starts waiting; nothing else is queued yet
            p.enqueue(9)  # the file that uploads the shared chunk
            with trio.move_on_after(5):
                while not ran:
                    await trio.sleep(0.01)
            p._files_wait(-1)
            nursery.cancel_scope.cancel()

    await main()
    assert ran == [9]


def yielding_persister(yield_s: float):
    """A persister whose host's application writes until ``host.active`` is cleared; its jobs' start times."""
    host = fake_fs(FakeMeta(7, version=1))
    host.options.persist_yield_s = yield_s
    host.active = True
    host.writers_active = lambda: host.active
    host.pool = SimpleNamespace(writers_waiting=0, free_fraction=lambda: 1.0)
    p = Persister(host)
    started: list[float] = []

    async def reconcile(ino):
        started.append(trio.current_time())

    p.reconciler.reconcile = reconcile
    return host, p, started


async def test_a_closed_file_waits_for_the_writers_to_pause_before_it_uploads():
    """Small files closed twice as fast when the persister's per-file work did not run between the
    writers' requests (issue: many files at kernel speed)."""
    host, p, started = yielding_persister(30.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(p.run)
        t0 = trio.current_time()
        p.enqueue(7)
        await trio.sleep(0.3)
        assert not started, "the upload started while the application was writing"
        assert p.queue_length() == 1  # still queued: status and drain count it
        host.active = False
        with trio.fail_after(5):
            while not started:
                await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    assert started[0] - t0 >= 0.3


async def test_a_file_waits_no_longer_than_persist_yield_while_the_writers_keep_writing():
    host, p, started = yielding_persister(0.4)
    async with trio.open_nursery() as nursery:
        await nursery.start(p.run)
        t0 = trio.current_time()
        p.enqueue(7)
        with trio.fail_after(5):
            while not started:
                await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    assert 0.4 <= started[0] - t0 < 3.0


@pytest.mark.parametrize("why", ["drain", "memory"])
async def test_a_drain_or_a_writer_waiting_for_memory_starts_uploads_at_once(why):
    host, p, started = yielding_persister(30.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(p.run)
        p.enqueue(7)
        await trio.sleep(0.1)
        assert not started
        if why == "drain":
            with trio.fail_after(5):
                assert await p.drain(10.0) == []
        else:
            host.pool.writers_waiting = 1
            with trio.fail_after(5):
                while not started:
                    await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    assert len(started) == 1


async def test_a_read_finds_an_object_moved_to_a_name_it_no_longer_has(tmp_path):
    """A file is renamed (a -> b), then its directory renamed and a link made
    (b -> c, d) while the persister still moves its object from a to b.  A
    reader whose chunk is not in DRAM tried the recorded key (a, just moved
    away) and the current names (c, d, not there yet), and failed with EIO
    (the random namespace test, under load).  Objects move and their keys
    are recorded under the store's ns_lock: read under it, the recorded
    keys are where the object is."""
    from aiturbofs.backend import open_backend
    from aiturbofs.store import ChunkStore

    (tmp_path / "backend").mkdir()
    body = os.urandom(5000)
    (tmp_path / "backend" / "a").write_bytes(body)
    row = SimpleNamespace(ino=5, backend_keys=["a"], holders=[])

    class Meta:
        async def get_inode(self, ino):
            return row

        async def paths_of(self, ino):
            return ["c", "d"]  # renamed twice more meanwhile

    backend = await open_backend(f"file://{tmp_path}/backend")
    health = SimpleNamespace(available=True, mark_up=lambda: None, mark_down=lambda why: None)
    store = ChunkStore(Meta(), backend, None, SingleNode(), health, record_error=print)
    ns_lock = store.ns_lock
    moved = trio.Event()
    async def persister_moves():
        async with ns_lock:
            await backend.move("a", "b")  # the move the first rename asked for ...
            moved.set()
            await trio.sleep(0.2)
            row.backend_keys = ["b"]  # ... and its keys, recorded under the same lock
    async with trio.open_nursery() as nursery:
        nursery.start_soon(persister_moves)
        await moved.wait()
        data = await store.fetch(5, 0, chunk.content_key(body), len(body), SimpleNamespace(**vars(row)))
    assert data == body


def test_directory_cleanups_are_bounded_and_deduplicated(caplog):
    """D12: every removed directory queued a backend cleanup, without bound
    while the backend hung, and the same path once per removal."""
    p = Persister(fake_fs())
    for _ in range(3):
        p.enqueue_dir_cleanup("ckpt/step-1")
    assert list(p._dirs_to_clean) == ["ckpt/step-1"]
    for i in range(DIRS_TO_CLEAN_MAX + 5):
        p.enqueue_dir_cleanup(f"d/{i}")
    assert len(p._dirs_to_clean) == DIRS_TO_CLEAN_MAX
    assert "directory removals already wait for the backend" in caplog.text


# ---------------------------------------------------------------- errors stay errors


@pytest.mark.parametrize("name, value", [
    ("user.aiturbo.fsync", b"sometimes"),
    ("user.aiturbo.group", b"bad group/with slash"),
    ("user.aiturbo.group", b""),
    ("user.aiturbo.group.size", b"0"),
    ("user.aiturbo.group.size", b"-3"),
    ("user.aiturbo.group.size", b"99999999"),
    ("user.aiturbo.nosuch", b"1"),
])
def test_bad_aiturbo_xattr_is_einval_and_logged(name, value, mnt):
    os.mkdir(mnt.path("d"))
    with pytest.raises(OSError) as caught:
        os.setxattr(mnt.path("d"), name, value)
    assert caught.value.errno == errno.EINVAL
    assert name not in os.listxattr(mnt.path("d"))
    assert re.search(rf"setxattr {re.escape(name)} on inode \d+ refused", mnt.log()), mnt.log()[-2000:]
    os.setxattr(mnt.path("d"), "user.aiturbo.fsync", b"durable")  # a good value still works
    assert os.getxattr(mnt.path("d"), "user.aiturbo.fsync") == b"durable"


def test_state_xattr_is_read_only(mnt):
    put(mnt.path("f"), b"x")
    for op in (lambda: os.setxattr(mnt.path("f"), "user.aiturbo.state", b"durable"),
               lambda: os.removexattr(mnt.path("f"), "user.aiturbo.state")):
        with pytest.raises(OSError) as caught:
            op()
        assert caught.value.errno == errno.EPERM
    with pytest.raises(OSError) as caught:
        os.getxattr(mnt.path(""), "user.aiturbo.state")  # directories have no state
    assert caught.value.errno == errno.ENODATA


def test_handler_exception_is_eio_and_mount_survives(make_mount, datapath):
    # a READ must reach the daemon: the kernel session without passthrough stands in for it
    m = make_mount(debug_faults=True, datapath="kernel" if datapath == "passthrough" else datapath)
    data = os.urandom(3 * MiB)
    put(m.path("f.bin"), data)
    r = aiturbo("debug-fault", m.mountpoint, "read")
    assert json.loads(r.stdout)["ok"]
    # O_DIRECT: through the page cache, the kernel would retry a failed
    # readahead with a second read and hide the EIO from the caller.
    fd = os.open(m.path("f.bin"), os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(OSError) as caught:
            os.pread(fd, MiB, 0)
        assert caught.value.errno == errno.EIO
        assert os.pread(fd, MiB, 0) == data[:MiB]  # the next read works
    finally:
        os.close(fd)
    assert is_mounted(m.mountpoint) and m.proc.poll() is None
    assert get(m.path("f.bin")) == data
    log = m.log()
    assert "BUG in read handler" in log and "Traceback" in log and "RuntimeError: injected fault in read" in log
    assert any("internal error in read" in e for e in status(m)["errors"])


def test_fault_injection_needs_the_option(mnt):
    r = aiturbo("debug-fault", mnt.mountpoint, "read", check=False)
    assert r.returncode != 0 and "debug_faults" in r.stdout
    put(mnt.path("f"), b"ok")
    assert get(mnt.path("f")) == b"ok"


# --------------------------------------------------------------------------- shutdown


@pytest.mark.parametrize("outage", [False, True], ids=["up", "outage"])
def test_sigterm_drains_before_exit(outage, s3m):
    m = s3m.mount()
    if outage:
        s3m.server.stop()  # keep every file queued when the signal arrives
    files = {f"f{i}.bin": os.urandom(CHUNK // 2 + i) for i in range(5)}
    for name, data in files.items():
        put(m.path(name), data)
    m.proc.send_signal(signal.SIGTERM)
    if outage:
        time.sleep(2)
        assert m.proc.poll() is None, "the daemon exited with the persist queue full"
        s3m.server.start()
    assert m.proc.wait(WAIT_S) == 0, m.log()[-3000:]
    objects = s3m.objects()
    assert sorted(objects) == sorted(files)
    for name, data in files.items():
        assert sha(objects[name]) == sha(data)
    log = m.log()
    assert "SIGTERM received" in log and "drain complete" in log
    if outage:
        assert f"draining {len(files)} file(s)" in log


def test_sigterm_drain_timeout_names_what_is_left(s3m):
    m = s3m.mount(drain_timeout=1)
    s3m.server.stop()
    put(m.path("left.bin"), os.urandom(MiB))
    t0 = time.monotonic()
    m.proc.send_signal(signal.SIGTERM)
    code = m.proc.wait(30)
    assert time.monotonic() - t0 < 10
    assert code == 1
    assert re.search(r"drain timed out: 1 file\(s\) not durable: left\.bin", m.log()), m.log()[-3000:]


def test_unresponsive_backend_does_not_stall_creates(s3m):
    m = s3m.mount()
    os.listdir(m.path(""))
    s3m.server.freeze()  # accepts TCP connections, never answers
    time.sleep(1)  # past import_ttl=0.5: the next create re-lists the root
    t, box = in_thread(lambda: put(m.path("f.bin"), b"x"))
    t.join(5)
    stalled = t.is_alive()
    s3m.server.thaw()
    t.join(WAIT_S)
    assert "error" not in box, box
    assert not stalled, "create() waited for a backend listing"


def test_an_aborted_fuse_connection_still_drains_what_was_staged(s3m):
    """An admin aborts the FUSE connection (/sys/fs/fuse/connections/N/abort):
    the mount is gone, but the daemon must not die with the staged files: it
    drains them to the backend and exits cleanly, as at an unmount."""
    m = s3m.mount(import_ttl=3600)  # the root is imported once, before the freeze
    put(m.path("warm.txt"), b"warm")
    assert wait_state(m.path("warm.txt"), "durable", WAIT_S) == "durable"
    s3m.server.freeze()  # nothing gets durable before the abort
    files = {"a.bin": secrets.token_bytes(CHUNK + 5), "b.txt": b"small"}
    for name, data in files.items():
        put(m.path(name), data)
    conn = os.minor(os.stat(m.mountpoint).st_dev)
    s3m.server.thaw()
    ctl = "/sys/fs/fuse/connections"
    mounted_ctl = not os.path.exists(f"{ctl}/{conn}")
    if mounted_ctl:
        subprocess.run(["mount", "-t", "fusectl", "none", ctl], check=True)
    try:
        with open(f"{ctl}/{conn}/abort", "w") as f:
            f.write("1")
        assert m.proc.wait(WAIT_S) == 0, m.log()[-3000:]
    finally:
        if mounted_ctl:
            subprocess.run(["umount", ctl], check=False)
    log = m.log()
    # the daemon's read of /dev/fuse fails with ENODEV (an unmount) or ECONNABORTED (seen once at an unmount)
    assert "drain complete: every file is durable" in log, log[-3000:]
    assert_no_bug(log)
    objects = s3m.objects()
    for name, data in files.items():
        assert objects[name] == data
