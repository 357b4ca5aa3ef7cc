"""Differential integrity checks: what was written, against what the mount serves, what the backend
holds after ``aiturbo wait``, and what a remount with a fresh state dir serves.

Several processes write the same content at once under a small DRAM budget, with a busy loop on
one core: deduplication, sealing in place, the kernel's own writes (passthrough) and the pool's
eviction and spill all meet.  The oracle is the content each writer was given; every byte of every
file is compared at each of the three places.  (docs/design.md, "Staging": the invariant these
guard.)
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import textwrap
import time

import pytest
from mounting import aiturbo, state
from s3server import S3Server

MiB = 1 << 20

# Four processes each write the same content to a file of their own: buffered 3 MB writes, flush,
# fsync, close (what torch.save and the reproducer do); the content spans several chunks
# and ends in a short tail, and is the same in every round.
WRITERS = textwrap.dedent("""
    import os, sys
    d, seed = sys.argv[1], int(sys.argv[2])
    import hashlib, random
    rnd = random.Random(seed)
    blocks = [hashlib.sha256(bytes([i % 256, i // 256])).digest() * 32768 for i in range(20)]
    data = b"".join(blocks) + rnd.randbytes(123456)
    def w(i):
        with open(f"{d}/f{i}", "wb") as f:
            for at in range(0, len(data), 3_000_000):
                f.write(data[at:at + 3_000_000])
            f.flush()
            os.fsync(f.fileno())
    if __name__ == "__main__":
        import multiprocessing as mp
        ps = [mp.Process(target=w, args=(i,)) for i in range(4)]
        [p.start() for p in ps]; [p.join() for p in ps]
        sys.exit(max(p.exitcode for p in ps))
""")
ROUNDS = 6


def _content(seed: int) -> bytes:
    """The oracle: what WRITERS writes with ``seed`` (the same code, run here)."""
    import random
    rnd = random.Random(seed)
    blocks = [hashlib.sha256(bytes([i % 256, i // 256])).digest() * 32768 for i in range(20)]
    return b"".join(blocks) + rnd.randbytes(123456)


@pytest.fixture
def busy_core():
    """A busy loop on one core while the test runs (the races show under load)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def _write_rounds(mnt, script: str) -> dict[str, bytes]:
    """ROUNDS rounds of the writers into fresh directories; returns the oracle by relative path."""
    oracle = {}
    for k in range(ROUNDS):
        d = mnt.path(f"r{k}")
        os.mkdir(d)
        done = subprocess.run([sys.executable, script, d, "7"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"round {k}: a writer failed:\n{done.stderr[-3000:]}"
        for i in range(4):
            oracle[f"r{k}/f{i}"] = _content(7)
    return oracle


def _differs(oracle: dict[str, bytes], read) -> list[str]:
    """The paths whose bytes ``read(path)`` does not give as the oracle has them (with where they first differ)."""
    bad = []
    for path, want in oracle.items():
        got = read(path)
        if got != want:
            if got is None or len(got) != len(want):
                bad.append(f"{path}: {None if got is None else len(got)} bytes, want {len(want)}")
            else:
                at = next(i for i in range(len(want)) if got[i] != want[i])
                bad.append(f"{path}: first difference at byte {at} (chunk {at >> 23})")
    return bad


def _read_file(root: str):
    def read(path: str) -> bytes | None:
        try:
            with open(os.path.join(root, path), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
    return read


def _no_bug_in(mnt) -> None:
    log = mnt.log()
    for marker in ("BUG", "Traceback", "Fatal Python error", "staging invariant"):
        assert marker not in log, f"daemon log has {marker!r}:\n{log[-4000:]}"


@pytest.mark.parametrize("backend", ["file", "s3"])
@pytest.mark.parametrize("dram", ["64M", "1G"])
def test_identical_writers_land_exact(backend, dram, datapath, make_mount, tmp_path, busy_core, request):
    # The four-writers reproducer, smaller.  The old code sent zeros for chunks whose range
    # was punched under a lease's map (durable, wrong bytes), lost a chunk that moved between two
    # files the kernel wrote (KeyError in fsync, then "broken"), and leaked staging memory through a
    # hash's map of a punched range (writers got ENOSPC, or the daemon died of SIGBUS).  Under
    # dram=64M most files are written through requests (the pool is short of memory); with 1G
    # every file goes to the kernel where passthrough is on.
    script = tmp_path / "writers.py"
    script.write_text(WRITERS)
    if backend == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        bucket = server.make_bucket(f"integrity-{secrets.token_hex(6)}")
        url, opts = f"s3://{bucket}/pre", {"s3_endpoint": server.endpoint}
        client = server.client()

        def stored(path: str) -> bytes | None:
            try:
                return client.get_object(Bucket=bucket, Key=f"pre/{path}")["Body"].read()
            except client.exceptions.NoSuchKey:
                return None
    else:
        (tmp_path / "backend").mkdir()
        url, opts = f"file://{tmp_path / 'backend'}", {}
        stored = _read_file(str(tmp_path / "backend"))
    mnt = make_mount(url, dram=dram, **opts)
    oracle = _write_rounds(mnt, str(script))

    assert _differs(oracle, _read_file(mnt.mountpoint)) == [], "the mount serves other bytes than were written"
    aiturbo("wait", mnt.mountpoint, timeout=300)
    assert {state(mnt.path(p)) for p in oracle} == {"durable"}
    assert _differs(oracle, stored) == [], "the backend holds other bytes than were written"
    verified = aiturbo("verify", "-q", mnt.mountpoint, check=False, timeout=300)
    assert verified.returncode == 0, verified.stderr
    _no_bug_in(mnt)
    mnt.stop()

    fresh = make_mount(url, name="fresh", **opts)
    assert _differs(oracle, _read_file(fresh.mountpoint)) == [], "a fresh mount serves other bytes"
    _no_bug_in(fresh)


def test_writers_of_more_than_the_budget_each_keep_the_mount_up(datapath, make_mount, tmp_path, busy_core):
    # Three processes each write a 96 MiB file under dram=64M: the staging tmpfs fills.  The old
    # hash through a map of a range punched meanwhile died of SIGBUS (every process using the
    # mount got ENOTCONN); with passthrough each file kept its own ranges in the tmpfs while open
    # and the second writer got ENOSPC.
    (tmp_path / "backend").mkdir()
    mnt = make_mount(f"file://{tmp_path / 'backend'}", dram="64M")
    script = tmp_path / "big.py"
    script.write_text(textwrap.dedent("""
        import os, sys, multiprocessing as mp
        def w(i):
            block = bytes([i + 1]) * (1 << 20)
            with open(f"{sys.argv[1]}/big{i}", "wb") as f:
                for n in range(96):
                    f.write(block[:-1] + bytes([n]))
        if __name__ == "__main__":
            ps = [mp.Process(target=w, args=(i,)) for i in range(3)]
            [p.start() for p in ps]; [p.join() for p in ps]
            sys.exit(max(p.exitcode for p in ps))
    """))
    done = subprocess.run([sys.executable, str(script), mnt.mountpoint], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"a writer failed:\n{done.stderr[-3000:]}"
    oracle = {f"big{i}": b"".join(bytes([i + 1]) * ((1 << 20) - 1) + bytes([n]) for n in range(96)) for i in range(3)}
    assert _differs(oracle, _read_file(mnt.mountpoint)) == []
    aiturbo("wait", mnt.mountpoint, timeout=300)
    assert _differs(oracle, _read_file(str(tmp_path / "backend"))) == []
    _no_bug_in(mnt)


def test_one_file_of_three_times_the_staging_room_is_written_whole(datapath, make_mount, tmp_path):
    # One file of 384 MiB, sequential 1 MiB writes, under dram=64M (a staging tmpfs of 128 MiB).
    # With passthrough the kernel wrote the file's backing file in the tmpfs and nothing could move
    # it while open: ENOSPC at 128 MiB.  Now a file the kernel writes has its backing file on disk.
    size_mib = 384
    backend = tmp_path / "backend"
    backend.mkdir()
    mnt = make_mount(f"file://{backend}", dram="64M")
    block = os.urandom(MiB)
    digest = hashlib.sha256()
    with open(mnt.path("big"), "wb") as f:
        for n in range(size_mib):
            piece = n.to_bytes(4, "little") + block[4:]
            f.write(piece)
            digest.update(piece)
    want = digest.hexdigest()

    def sha_of(path: str) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while piece := f.read(4 * MiB):
                h.update(piece)
        return h.hexdigest()

    assert os.path.getsize(mnt.path("big")) == size_mib * MiB
    assert sha_of(mnt.path("big")) == want
    aiturbo("wait", mnt.mountpoint, timeout=300)
    assert state(mnt.path("big")) == "durable"
    assert sha_of(str(backend / "big")) == want
    # durable: what the file keeps cached on disk is bounded like the DRAM cache (dram= worth of chunks)
    staging = json.loads(aiturbo("status", "--json", mnt.mountpoint).stdout)["staging"]
    assert staging["disk_allocated_bytes"] <= 64 * MiB + 8 * MiB, staging
    _no_bug_in(mnt)
    assert mnt.stop() == 0
    again = make_mount(f"file://{backend}", name="fresh")  # a fresh state dir: only the backend
    assert sha_of(again.path("big")) == want


def test_verify_reports_missing_resized_and_changed_objects(make_mount, tmp_path):
    # aiturbo verify, the scrub: every durable file's object against its manifest, by path.
    backend = tmp_path / "backend"
    backend.mkdir()
    mnt = make_mount(f"file://{backend}", import_ttl=3600)  # (no re-import of the objects changed below)
    os.mkdir(mnt.path("d"))
    files = {"a": os.urandom(2 * (1 << 23) + 777), "d/b": b"small" * 100, "c": os.urandom(5000), "empty": b""}
    for name, data in files.items():
        with open(mnt.path(name), "wb") as f:
            f.write(data)
    aiturbo("wait", mnt.mountpoint)
    ok = aiturbo("verify", "-q", mnt.mountpoint, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "4 durable file(s) checked, 0 problem(s)" in ok.stderr

    with open(backend / "a", "r+b") as f:  # one byte of chunk 1, size kept
        f.seek((1 << 23) + 5)
        f.write(bytes([files["a"][(1 << 23) + 5] ^ 0xFF]))
    os.truncate(backend / "d" / "b", 10)
    os.unlink(backend / "c")
    bad = aiturbo("verify", "-q", mnt.mountpoint, check=False)
    assert bad.returncode == 1, bad.stderr
    lines = bad.stderr.splitlines()
    assert any(line.endswith("/a: backend object 'a': chunks differ from the manifest (chunks 1)") for line in lines)
    assert any("/d/b: backend object 'd/b': size 10, recorded 500" in line for line in lines)
    assert any(line.endswith("/c: backend object 'c': missing") for line in lines)
    assert "4 durable file(s) checked, 3 problem(s)" in bad.stderr
    assert aiturbo("verify", "-q", mnt.path("d", "b"), check=False).returncode == 1
    outside = aiturbo("verify", str(backend), check=False)
    assert outside.returncode == 2 and "aiturbofs mount" in outside.stderr
    assert "verify: a (inode" in mnt.log()

    # --repair: the mount still holds every chunk (the pool keeps durable files' chunks while it has room).
    repaired = aiturbo("verify", "-q", "--repair", mnt.mountpoint, check=False, timeout=300)
    assert repaired.returncode == 0, repaired.stderr
    assert "3 of 3 file(s) repaired" in repaired.stderr
    for name, data in files.items():
        assert (backend / name).read_bytes() == data, name
    assert aiturbo("verify", "-q", mnt.mountpoint, check=False).returncode == 0

    # Once the pool let go of the chunks, nothing here can repair it: said, and the exit is 1.
    assert aiturbo("drop-cache", mnt.mountpoint).returncode == 0
    os.truncate(backend / "a", 3)
    unrepaired = aiturbo("verify", "-q", "--repair", mnt.path("a"), check=False, timeout=300)
    assert unrepaired.returncode == 1, unrepaired.stderr
    assert "/a: not repaired: no copy of chunks 0, 1, 2 is held in the mount or by a peer" in unrepaired.stderr
    assert state(mnt.path("a")) == "durable"
    _no_bug_in(mnt)


def test_an_unlinked_file_still_open_reads_its_bytes_while_another_takes_its_name(make_mount, tmp_path):
    # POSIX: an open descriptor of an unlinked (or renamed-over) file reads that file until it is closed.
    # Its chunks may have left DRAM: its object must outlive the name, even when a new file is persisted
    # at the same key, and go once the last descriptor is closed.
    backend = tmp_path / "backend"
    backend.mkdir()
    mnt = make_mount(f"file://{backend}", dram="64M")
    old, new, over = os.urandom(3 * (1 << 23) + 4321), os.urandom(1 << 23), os.urandom(5000)
    for name, data in (("f", old), ("g", old[: 1 << 20])):
        with open(mnt.path(name), "wb") as f:
            f.write(data)
    aiturbo("wait", mnt.mountpoint)
    assert aiturbo("drop-cache", mnt.mountpoint).returncode == 0  # its chunks only in the backend now
    fd = os.open(mnt.path("f"), os.O_RDONLY)
    fd_g = os.open(mnt.path("g"), os.O_RDONLY)
    try:
        os.unlink(mnt.path("f"))
        with open(mnt.path("f"), "wb") as f:  # a new file at the name, persisted over the old object's key
            f.write(new)
        with open(mnt.path("h"), "wb") as f:
            f.write(over)
        os.rename(mnt.path("h"), mnt.path("g"))  # renamed over an open file
        aiturbo("wait", mnt.mountpoint)
        assert (backend / "f").read_bytes() == new and (backend / "g").read_bytes() == over
        assert os.pread(fd, len(old) + 1, 0) == old
        assert os.pread(fd_g, 1 << 21, 0) == old[: 1 << 20]
    finally:
        os.close(fd)
        os.close(fd_g)
    for _ in range(200):  # the last close lets the hidden copies go
        left = [p.name for p in backend.iterdir() if p.name.startswith(".aiturbo-")]
        if not left:
            break
        time.sleep(0.05)
    assert left == []
    assert sorted(p.name for p in backend.iterdir()) == ["f", "g"]
    with open(mnt.path("f"), "rb") as f:
        assert f.read() == new
    _no_bug_in(mnt)
