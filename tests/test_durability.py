"""Future 0 / future 1 end to end, on real mounts over a local dir and a real S3 server.

What close(), fsync(), ``-o sync_close`` and ``aiturbo wait`` promise; that a
backend outage, renames and unlinks of in-flight files, a full DRAM pool and
SIGTERM never lose or misplace a byte; and that errors reach the caller as an
errno while the mount stays up.

The S3 tests stop and restart their own moto server (``OutageS3Server``): a
restarted moto is empty, and it is restarted with its buckets already there,
because a persist retry that lands between "listening" and "bucket re-created"
would get NoSuchBucket, a permanent error, and mark the file broken.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest

from mounting import aiturbo, is_mounted, state, wait_state
from s3server import HOST, S3Server

MiB = 1 << 20
CHUNK = 8 * MiB
WAIT_S = 60.0  # generous bound on "becomes durable" for tens of MiB on this machine

# moto, with buckets created in-process before it listens (see module doc).
_PRELOADED_MOTO = """
import sys
from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
for name in sys.argv[3:]:
    s3_backends[DEFAULT_ACCOUNT_ID]["global"].create_bucket(name, "us-east-1")
from moto.server import main
main(["-H", sys.argv[1], "-p", sys.argv[2]])
"""


class OutageS3Server(S3Server):
    """An ``S3Server`` whose ``start()`` brings back every bucket made so far (empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.buckets: list[str] = []

    def start(self) -> "OutageS3Server":
        os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
        if self.running:
            return self
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _PRELOADED_MOTO, HOST, str(self.port), *self.buckets],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def make_bucket(self, name: str) -> str:
        self.buckets.append(name)
        return super().make_bucket(name)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix`` (key relative to it) -> its bytes."""
        c = self.client()
        out = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", ()):
                out[o["Key"][len(prefix):]] = c.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        return out


@pytest.fixture(scope="module")
def s3_outage_server():
    server = OutageS3Server()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture
def s3(s3_outage_server):
    """The module's S3 server, running again (with its buckets) after the test."""
    yield s3_outage_server
    s3_outage_server.start()


class S3Mounts:
    """One fresh bucket per test; mounts of ``s3://bucket/pre``."""

    def __init__(self, server: OutageS3Server, make_mount):
        self.server = server
        self.make_mount = make_mount
        self.bucket = server.make_bucket(f"t-{secrets.token_hex(6)}")
        self.url = f"s3://{self.bucket}/pre"

    def mount(self, name: str = "m", **options):
        return self.make_mount(self.url, name=name, s3_endpoint=self.server.endpoint, **options)

    def objects(self) -> dict[str, bytes]:
        return self.server.objects(self.bucket, "pre/")


@pytest.fixture
def s3m(s3, make_mount) -> S3Mounts:
    return S3Mounts(s3, make_mount)


# --------------------------------------------------------------------------- helpers


def put(path: str, data: bytes, *, fsync: bool = False) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def get(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def status(m) -> dict:
    return json.loads(aiturbo("status", m.mountpoint, "--json").stdout)


def wait_until(predicate, timeout_s: float = WAIT_S, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def assert_durable(m, files: dict[str, bytes], backend_objects) -> None:
    """Every file reaches ``durable`` and the backend holds exactly its bytes."""
    for name in files:
        assert wait_state(m.path(name), "durable", WAIT_S) == "durable", name
    objects = backend_objects()
    for name, data in files.items():
        assert name in objects, f"{name} missing from the backend: {sorted(objects)}"
        assert sha(objects[name]) == sha(data), f"{name}: backend bytes differ"


def local_objects(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = get(p)
    return out


def in_thread(fn, *args):
    """Run ``fn`` in a thread; returns (thread, box) where box gets 'result' or 'error'."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


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


def test_fsync_durable_option(s3m):
    m = s3m.mount(fsync="durable")
    data = os.urandom(CHUNK + 4096)
    with open(m.path("f.bin"), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        assert state(m.path("f.bin")) == "durable"
        assert s3m.objects() == {"f.bin": data}


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
    t, box = in_thread(put, m.path("ckpt", "shard.bin"), data, True)
    t.join(3)
    assert t.is_alive(), f"fsync in a fsync=durable dir returned while S3 was down: {box}"
    s3m.server.start()
    t.join(WAIT_S)
    assert not t.is_alive() and "error" not in box, box
    assert state(m.path("ckpt", "shard.bin")) == "durable"
    assert_durable(m, {"ckpt/shard.bin": data, "plain.bin": plain}, s3m.objects)
