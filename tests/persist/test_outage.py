"""A mount whose backend does not answer (issue 12): it comes up, takes writes, persists later.

"Unresponsive" is a moto server frozen with SIGSTOP: it accepts TCP
connections (the kernel does) and never answers, like a brownout; its data
survives the freeze.  "Refusing" is a stopped server (connection refused),
restarted with its buckets (``OutageS3Server``).  What is checked is what a
writer relies on: the mount is up within seconds, close() returns at once,
recovered files read back, `aiturbo status` says the backend is unavailable,
and everything is durable, with its bytes, once S3 answers again.  Bad
configuration (a missing bucket) still fails the mount with one clear line.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import time

import pytest
from fileio import get, pread_direct, put, sha
from mounting import aiturbo, assert_no_bug, state, status, wait_state
from s3server import S3Server
from scrape import scrape, value
from waiting import WAIT_S, in_thread, wait_until

MiB = 1 << 20
CHUNK = 8 * MiB
MOUNT_UP_S = 20.0  # generous: the daemon gives the backend BACKEND_CHECK_TIMEOUT_S at mount
CLOSE_S = 5.0  # close() of a staged file never waits for the backend
CREATE_S = 10.0  # a create in an expired directory: far under the 60 s S3 read timeout
READ_FAIL_S = 45.0  # a read that needs a frozen backend fails within this (not 5 x 60 s)


def timed(fn, *args) -> float:
    t0 = time.monotonic()
    fn(*args)
    return time.monotonic() - t0


def mount_timed(s3m, **options):
    t0 = time.monotonic()
    m = s3m.mount(**options)
    return m, time.monotonic() - t0


def assert_durable_in_bucket(s3m, m, files: dict[str, bytes]) -> float:
    """Every file durable, with its bytes in the bucket; returns how long that took."""
    t0 = time.monotonic()
    r = aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S + 60)
    assert r.returncode == 0, r.stderr + m.log()[-3000:]
    objects = s3m.objects()
    for name, data in files.items():
        assert state(m.path(name)) == "durable", name
        assert name in objects, f"{name} not in the bucket: {sorted(objects)}"
        assert sha(objects[name]) == sha(data), f"{name}: the bucket holds other bytes"
    return time.monotonic() - t0


def reads_back(path: str, data: bytes) -> bool:
    try:
        return get(path) == data
    except OSError:
        return False


def assert_backend_available(m) -> dict:
    return wait_until(lambda: (s := status(m))["backend_state"]["available"] and s, timeout_s=WAIT_S,
                      what="status: backend available")


# --------------------------------------------------------------- (a) mount during an outage


def test_mount_with_s3_unresponsive_is_up_takes_writes_and_persists_later(s3m):
    files = {"ckpt/shard0.bin": secrets.token_bytes(CHUNK + 4321), "small.txt": b"written while S3 was down\n"}
    s3m.server.freeze()
    try:
        m, mount_s = mount_timed(s3m, metrics="127.0.0.1:0")
        assert mount_s < MOUNT_UP_S, f"mount took {mount_s:.1f} s"
        assert value(scrape(status(m)["metrics"]), "aiturbo_backend_available") == 0
        os.mkdir(m.path("ckpt"))
        closes = {name: timed(put, m.path(name), data) for name, data in files.items()}
        assert max(closes.values()) < CLOSE_S, closes
        for name, data in files.items():
            assert get(m.path(name)) == data
            assert state(m.path(name)) in ("staged", "persisting")
        s = status(m)
        assert s["backend_state"]["available"] is False, s["backend_state"]
        assert s["backend_state"]["since"], s["backend_state"]
        text = aiturbo("status", m.mountpoint).stdout
        assert "backend  unavailable since" in text, text
        assert "backend unavailable at mount" in m.log(), m.log()[-3000:]
    finally:
        s3m.server.thaw()
    durable_s = assert_durable_in_bucket(s3m, m, files)
    assert value(scrape(assert_backend_available(m)["metrics"]), "aiturbo_backend_available") == 1
    assert "backend answers again" in m.log()
    assert_no_bug(m.log())
    print(f"mount with S3 frozen: up in {mount_s:.1f} s; close() max {max(closes.values()) * 1000:.0f} ms; "
          f"all durable {durable_s:.1f} s after S3 answered")


def test_mount_with_s3_refusing_is_up_and_imports_when_it_answers(s3m):
    s3m.server.stop()  # connection refused; start() brings the bucket back, empty
    try:
        m, mount_s = mount_timed(s3m, name="fresh")
        assert mount_s < MOUNT_UP_S, f"mount took {mount_s:.1f} s"
        put(m.path("new.bin"), b"new")
        assert status(m)["backend_state"]["available"] is False
    finally:
        s3m.server.start()
    s3m.server.client().put_object(Bucket=s3m.bucket, Key="pre/outside.bin", Body=b"made by another tool")
    assert_durable_in_bucket(s3m, m, {"new.bin": b"new"})
    assert_backend_available(m)
    # imported once S3 answers: an object the mount never wrote shows up
    wait_until(lambda: "outside.bin" in os.listdir(m.path("")), timeout_s=WAIT_S, what="outside.bin imported")
    assert get(m.path("outside.bin")) == b"made by another tool"
    print(f"mount with S3 refusing: up in {mount_s:.1f} s")


def test_missing_bucket_still_fails_the_mount_with_one_clear_line(s3m, make_mount):
    with pytest.raises(RuntimeError) as caught:
        make_mount(f"s3://no-such-{secrets.token_hex(4)}", s3_endpoint=s3m.server.endpoint)
    assert "mount.aiturbo exited with 32" in str(caught.value)
    assert "does not exist at" in str(caught.value), str(caught.value)[-2000:]


def test_refused_credentials_still_fail_the_mount_with_one_clear_line(make_mount, monkeypatch):
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # moto checks credentials: ours are unknown (403)
    with S3Server() as server:
        with pytest.raises(RuntimeError) as caught:
            make_mount("s3://any-bucket", s3_endpoint=server.endpoint)
    assert "mount.aiturbo exited with 32" in str(caught.value)
    assert re.search(r"mount failed: bucket 'any-bucket' at \S+ cannot be used: .*403", str(caught.value)), \
        str(caught.value)[-2000:]


# ------------------------------------------------------------ (b) crash during an outage


def test_crash_during_outage_remount_is_up_reads_recovered_files_and_persists_later(s3m, tmp_path):
    spill = str(tmp_path / "spill")
    m = s3m.mount(spill=spill)
    os.listdir(m.path(""))  # the root's import, before the outage
    files = {"a.bin": secrets.token_bytes(2 * CHUNK + 5), "b.txt": b"small"}
    s3m.server.freeze()
    try:
        for name, data in files.items():
            put(m.path(name), data)
        total = sum(map(len, files.values()))
        wait_until(lambda: status(m)["pool"]["spilled_bytes"] >= total, what="every staged chunk in the spill dir")
        m.kill()
        t0 = time.monotonic()
        m2 = s3m.mount(name="again", state_dir=m.state_dir, spill=spill)
        mount_s = time.monotonic() - t0
        assert mount_s < MOUNT_UP_S, f"remount took {mount_s:.1f} s"
        for name, data in files.items():
            assert get(m2.path(name)) == data, name
            assert state(m2.path(name)) in ("staged", "persisting"), name
        files["c.bin"] = secrets.token_bytes(MiB)
        assert timed(put, m2.path("c.bin"), files["c.bin"]) < CLOSE_S
        assert status(m2)["backend_state"]["available"] is False
        assert "recovered ino=" in m2.log()
    finally:
        s3m.server.thaw()
    durable_s = assert_durable_in_bucket(s3m, m2, files)
    assert_no_bug(m2.log())
    print(f"remount after a crash, S3 frozen: up in {mount_s:.1f} s; all durable {durable_s:.1f} s after S3 answered")


# ------------------------------------------------- (c) an expired directory, S3 frozen


def test_creates_in_an_expired_directory_do_not_wait_for_an_unresponsive_s3(s3m):
    m = s3m.mount()  # import_ttl=0.5 (the tests' default)
    os.mkdir(m.path("ckpt"))
    put(m.path("ckpt/before.bin"), b"before")
    assert wait_state(m.path("ckpt/before.bin"), "durable", WAIT_S) == "durable"
    files = {f"ckpt/shard{i}.bin": secrets.token_bytes(100_000 + i) for i in range(5)}
    creates = {}
    s3m.server.freeze()
    try:
        time.sleep(1.5)  # past import_ttl and the kernel's entry cache: every lookup asks the daemon
        for name, data in files.items():
            t, box = in_thread(timed, put, m.path(name), data)
            t.join(CREATE_S)
            assert not t.is_alive(), f"creating {name} waited for a backend listing"
            assert "error" not in box, box
            creates[name] = box["result"]
        t, box = in_thread(os.listdir, m.path("ckpt"))
        t.join(CREATE_S)
        assert not t.is_alive(), "readdir waited for a backend listing"
        assert sorted(box["result"]) == sorted(["before.bin", *(n.split("/")[1] for n in files)])
    finally:
        s3m.server.thaw()
    assert_durable_in_bucket(s3m, m, files)
    assert_no_bug(m.log())
    print(f"creates in an expired directory with S3 frozen: max {max(creates.values()):.2f} s, "
          f"all {[round(v, 2) for v in creates.values()]}")


# ------------------------------------------------------------- reads that need the backend


def test_read_of_backend_only_data_fails_with_eio_not_the_mount(s3m):
    m = s3m.mount()
    data = secrets.token_bytes(CHUNK + 100)
    put(m.path("cold.bin"), data)
    assert wait_state(m.path("cold.bin"), "durable", WAIT_S) == "durable"
    assert aiturbo("drop-cache", m.mountpoint).returncode == 0
    s3m.server.freeze()
    try:
        t0 = time.monotonic()
        t, box = in_thread(pread_direct, m.path("cold.bin"), 0, MiB)  # past the kernel's page cache
        t.join(READ_FAIL_S)
        assert not t.is_alive(), f"the read still waits after {READ_FAIL_S} s"
        fail_s = time.monotonic() - t0
        assert isinstance(box.get("error"), OSError) and box["error"].errno == errno.EIO, box
        put(m.path("meanwhile.txt"), b"the mount still takes writes")  # the mount is up
        assert "read of inode" in m.log()
    finally:
        s3m.server.thaw()
    wait_until(lambda: reads_back(m.path("cold.bin"), data), timeout_s=WAIT_S, what="cold.bin readable again")
    print(f"read of backend-only data with S3 frozen: EIO after {fail_s:.1f} s")
