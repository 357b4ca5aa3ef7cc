"""Crashes, lost DRAM, corrupted chunks and objects made by other tools.

A kill -9 loses nothing closed: the backing files on the DRAM tmpfs outlive
the daemon (and a spill dir keeps what was spilled).  A host reboot empties
the tmpfs: what was only there is reported ``broken`` and never served with
other bytes; a chunk
corrupted on the spill disk or in the backend is caught by its BLAKE3 hash;
objects written by other tools show up in the mount and their changes are
seen after the import TTL.

An outage that must keep the bucket's data freezes moto (SIGSTOP) instead of
stopping it, since a restarted moto is empty.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
import signal
import sqlite3
import time

import pytest
import trio
from fileio import get, local_objects, put, sha, upload_temps
from mounting import aiturbo, assert_no_bug, state, status, wait_state, wipe_staging
from waiting import WAIT_S, wait_until

from aiturbofs import chunk
from aiturbofs.fuse import probe_passthrough
from aiturbofs.staging import SPILL_FILES_DIR, SpillStore

MiB = 1 << 20
CHUNK = 8 * MiB
IMPORT_SETTLE_S = 1.6  # import_ttl=0.5 (tests' default) + the kernel's 1 s attribute cache
# Mounts that see a frozen S3 server: no re-listing of directories (one that
# started before the freeze waits out the S3 read timeout in the background).
NO_REIMPORT = {"import_ttl": 3600}
_libc = ctypes.CDLL(None, use_errno=True)  # fallocate(2) with a mode (os has only posix_fallocate)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def chunk_keys(data: bytes) -> list[str]:
    """Spill file names of ``data``'s chunks."""
    return [chunk.digest(data[i: i + CHUNK]).hex() for i in range(0, len(data), CHUNK)]


def flip_byte(path: str, offset: int) -> None:
    """Corrupt one byte in place, keeping size, atime and mtime."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def assert_eio(path: str, offset: int = 0, length: int = -1) -> None:
    with pytest.raises(OSError) as caught:
        with open(path, "rb") as f:
            f.seek(offset)
            f.read(length)
    assert caught.value.errno == errno.EIO, caught.value


def remount(s3m, m, **options):
    """A new daemon on the crashed one's state dir (a fresh mount point)."""
    return s3m.mount(name="again", state_dir=m.state_dir, **options)


# ------------------------------------------------------------------ kill -9 + spill


def test_kill9_with_spill_dir_loses_nothing(s3m, tmp_path):
    spill = str(tmp_path / "spill")
    m = s3m.mount(spill=spill)
    s3m.server.stop()
    os.mkdir(m.path("d"))
    files = {"a.bin": secrets.token_bytes(2 * CHUNK + 5), "d/b.bin": secrets.token_bytes(CHUNK), "c.txt": b"small"}
    for name, data in files.items():
        put(m.path(name), data)
    total = sum(map(len, files.values()))
    wait_until(lambda: status(m)["pool"]["spilled_bytes"] >= total, what="every staged chunk in the spill dir")
    assert {k for d in files.values() for k in chunk_keys(d)} <= set(os.listdir(spill))
    m.kill()
    s3m.server.start()
    m2 = remount(s3m, m, spill=spill)
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr + m2.log()[-3000:]
    objects = s3m.objects()
    assert sorted(objects) == sorted(files)
    for name, data in files.items():
        assert sha(objects[name]) == sha(data), name
        assert get(m2.path(name)) == data
    assert "recovered ino=" in m2.log()
    assert_no_bug(m2.log())
    st = wait_until(lambda: (s := status(m2))["pool"]["pinned_chunks"] == 0 and s, what="pins released")
    # durable: spill copies dropped (the dir of the backing files on disk is all that is left)
    assert st["pool"]["spilled_bytes"] == 0 and set(os.listdir(spill)) <= {SPILL_FILES_DIR}


def test_kill9_with_spill_dir_partial_rewrite_of_durable_file(s3m, tmp_path):
    """Only the rewritten chunk is staged; the others come from the previous object."""
    spill = str(tmp_path / "spill")
    m = s3m.mount(spill=spill, **NO_REIMPORT)
    old = secrets.token_bytes(3 * CHUNK)
    put(m.path("p.bin"), old)
    assert wait_state(m.path("p.bin"), "durable") == "durable"
    s3m.server.freeze()
    patch = secrets.token_bytes(4096)
    with open(m.path("p.bin"), "r+b") as f:
        f.seek(CHUNK + 10)
        f.write(patch)
    new = old[: CHUNK + 10] + patch + old[CHUNK + 10 + len(patch):]
    wait_until(lambda: chunk_keys(new)[1] in os.listdir(spill), what="the rewritten chunk in the spill dir")
    m.kill()
    s3m.server.thaw()
    m2 = remount(s3m, m, spill=spill)
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr + m2.log()[-3000:]
    assert sha(s3m.objects()["p.bin"]) == sha(new)
    assert get(m2.path("p.bin")) == new
    st = wait_until(lambda: (s := status(m2))["pool"]["pinned_chunks"] == 0 and s, what="pins released")
    assert st["pool"]["spilled_bytes"] == 0
    assert_no_bug(m2.log())


def test_drain_timeout_keeps_spilled_data_for_next_mount(s3m, tmp_path):
    spill = str(tmp_path / "spill")
    m = s3m.mount(spill=spill, drain_timeout=1)
    s3m.server.stop()
    data = secrets.token_bytes(CHUNK + 99)
    put(m.path("late.bin"), data)
    wait_until(lambda: status(m)["pool"]["spilled_bytes"] >= len(data), what="spilled")
    assert m.stop() == 1  # unmount: the drain gives up after 1 s
    assert "stay in the staging and spill dirs" in m.log()
    s3m.server.start()
    m2 = remount(s3m, m, spill=spill)
    assert wait_state(m2.path("late.bin"), "durable", WAIT_S) == "durable"
    assert s3m.objects() == {"late.bin": data}


def test_status_of_all_daemons_skips_sockets_of_killed_ones(make_mount):
    dead = make_mount(name="dead")
    dead.kill()
    live = make_mount(name="live")
    r = aiturbo("status", "--json", check=False)
    assert r.returncode == 0, r.stderr
    shown = [json.loads(line)["mountpoint"] for line in r.stdout.splitlines()]
    assert live.mountpoint in shown and dead.mountpoint not in shown
    assert dead.mountpoint not in r.stderr
    r = aiturbo("status", dead.mountpoint, check=False)  # asked by name: say it is not there
    assert r.returncode == 1 and "Connection refused" in r.stderr


# ---------------------------------------------------------------- kill -9, no spill


def write_while_frozen(s3m, m) -> tuple[bytes, bytes, dict[str, bytes], bytes]:
    """Durable keep.bin and over.bin v1; then, with S3 frozen, lost1/lost2 and over.bin v2 only staged."""
    keep, v1 = secrets.token_bytes(CHUNK + 1), secrets.token_bytes(CHUNK)
    put(m.path("keep.bin"), keep)
    put(m.path("over.bin"), v1)
    assert aiturbo("wait", m.mountpoint, check=False).returncode == 0
    s3m.server.freeze()
    staged = {"lost1.bin": secrets.token_bytes(2 * CHUNK), "lost2.bin": b"tiny"}
    for name, data in staged.items():
        put(m.path(name), data)
    v2 = secrets.token_bytes(CHUNK)
    put(m.path("over.bin"), v2)  # v2 only ever staged
    return keep, v1, staged, v2


def backing_files(m) -> list[str]:
    """The backing files a daemon left: in its staging dir, and those of files the kernel wrote, on disk."""
    found = []
    for d in (m.staging_dir, os.path.join(m.state_dir, "spill", SPILL_FILES_DIR)):
        with contextlib.suppress(FileNotFoundError):
            found += [os.path.join(d, n) for n in os.listdir(d)]
    return found


@pytest.mark.root("FUSE passthrough (CAP_SYS_ADMIN)")
@pytest.mark.skipif(not probe_passthrough().available, reason="needs FUSE passthrough")
def test_kill9_keeps_the_files_the_kernel_wrote_on_disk(s3m):
    """A file the kernel writes has its backing file on disk (one file may be larger than DRAM); after
    a kill -9 and a reboot that empties the tmpfs, the restart finds its chunks there, serves and
    persists them exactly, and the clean exit removes the files there."""
    m = s3m.mount(datapath="passthrough", **NO_REIMPORT)
    os.listdir(m.mountpoint)
    s3m.server.freeze()  # everything stays staged
    files = {"big.bin": secrets.token_bytes(3 * CHUNK + 12345), "small.bin": b"tiny"}
    for name, data in files.items():
        put(m.path(name), data)
    on_disk = [n for n in os.listdir(os.path.join(m.state_dir, "spill", SPILL_FILES_DIR)) if n.isdigit()]
    assert len(on_disk) == 2, on_disk  # (beside them: the spare files' directory)
    m.kill()
    wipe_staging(m.staging_dir)  # a clean reboot: the tmpfs is gone, the disk keeps what the page cache wrote back
    s3m.server.thaw()
    m2 = remount(s3m, m, datapath="passthrough")
    for name, data in files.items():
        assert get(m2.path(name)) == data
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    objects = s3m.objects()
    for name, data in files.items():
        assert objects[name] == data
    log = m2.log()
    assert "broken" not in log and log.count("recovered ino=") == 2, log[-3000:]
    assert_no_bug(log)
    assert m2.stop() == 0
    assert backing_files(m) == []


def test_kill9_without_spill_loses_nothing_closed(s3m):
    """The backing files outlive the daemon: a restart persists every closed file, exact."""
    m = s3m.mount(**NO_REIMPORT)
    keep, _v1, staged, v2 = write_while_frozen(s3m, m)
    m.kill()
    assert backing_files(m)  # the staged bytes are still on the tmpfs (or on disk: files the kernel wrote)
    s3m.server.thaw()
    m2 = remount(s3m, m)
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    for name, data in {**staged, "over.bin": v2, "keep.bin": keep}.items():
        assert state(m2.path(name)) == "durable"
        assert get(m2.path(name)) == data
    objects = s3m.objects()
    assert objects["over.bin"] == v2 and objects["lost1.bin"] == staged["lost1.bin"]
    log = m2.log()
    assert "broken" not in log and "recovered ino=" in log
    assert_no_bug(log)
    assert m2.stop() == 0
    assert not os.path.exists(m.staging_dir)  # all durable: the clean exit gave the DRAM back


@pytest.mark.parametrize("datapath", ["auto", "pyfuse3"])
def test_kill9_keeps_a_deduplicated_chunk_whose_home_was_written_again(s3m, datapath):
    """A chunk two staged files share lives once, in the range of the file that sealed it first.  When
    that file writes the chunk again, the other file's copy moves out first: it must outlive a kill -9
    like the rest of the staged bytes.  It used to move into a buffer on the heap, and the file that
    deduplicated into it came back broken (EIO) after the restart."""
    m = s3m.mount(datapath=datapath, **NO_REIMPORT)
    shared, other = secrets.token_bytes(CHUNK), secrets.token_bytes(4096)
    os.listdir(m.mountpoint)  # (the root's import, before S3 stops answering)
    s3m.server.freeze()  # everything stays staged
    put(m.path("home.bin"), shared)
    put(m.path("twin.bin"), shared)  # deduplicated into home.bin's range
    with open(m.path("home.bin"), "r+b") as f:
        f.write(other)  # the chunk's home is written again
    m.kill()
    s3m.server.thaw()
    m2 = remount(s3m, m)
    assert get(m2.path("twin.bin")) == shared
    assert get(m2.path("home.bin")) == other + shared[4096:]
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert s3m.objects()["twin.bin"] == shared
    assert "broken" not in m2.log()
    assert_no_bug(m2.log())


def _cut_home(path: str, how: str, keep: int) -> bytes:
    """Make the file at ``path`` drop its chunks past ``keep`` bytes without writing their ranges; what it holds."""
    if how == "truncate":
        os.truncate(path, keep)
    elif how == "rewrite":
        put(path, b"h" * keep)  # O_TRUNC, then a shorter file
        return b"h" * keep
    else:  # punch: the chunks past ``keep`` become a hole, the size stays
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, keep, size - keep) != 0:
                err = ctypes.get_errno()
                if err == errno.EOPNOTSUPP:
                    pytest.skip("this data path has no fallocate")
                raise OSError(err, os.strerror(err))
        finally:
            os.close(fd)
    return b""


@pytest.mark.parametrize("how", ["truncate", "rewrite", "punch"])
@pytest.mark.parametrize("datapath", ["auto", "pyfuse3"])
def test_kill9_keeps_a_deduplicated_chunk_whose_home_file_dropped_it(s3m, datapath, how):
    """A chunk two staged files share lives once, in the range of the file that sealed it first.  When
    that file drops the chunk without writing its range (a truncate, an O_TRUNC rewrite that ends
    shorter, a punched hole), the chunk stays in that range for the other file, and a kill -9 must not
    lose it.  The restart used to look for a chunk only at its own index of its own file's backing
    file (and in the files of removed inodes): the copy was EIO after the restart (the torture suite's
    kill -9 case, seed 12: a copy, then a truncate of the file copied)."""
    m = s3m.mount(datapath=datapath, **NO_REIMPORT)
    shared = secrets.token_bytes(2 * CHUNK + 5000)  # the last chunk is short: a tail only the cut drops
    os.listdir(m.mountpoint)  # (the root's import, before S3 stops answering)
    s3m.server.freeze()  # everything stays staged
    put(m.path("home.bin"), shared)
    put(m.path("twin.bin"), shared)  # deduplicated into home.bin's ranges
    keep = CHUNK + 4096
    home = _cut_home(m.path("home.bin"), how, keep)
    if how == "truncate":
        home = shared[:keep]
    elif how == "punch":
        home = shared[:keep] + bytes(len(shared) - keep)
    m.kill()
    s3m.server.thaw()
    m2 = remount(s3m, m)
    assert get(m2.path("twin.bin")) == shared
    assert get(m2.path("home.bin")) == home
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    objects = s3m.objects()
    assert objects["twin.bin"] == shared and objects["home.bin"] == home
    log = m2.log()
    assert "broken" not in log
    assert_no_bug(log)


def test_kill9_before_the_backend_follows_renames_and_links_keeps_them(s3m):
    """A rename, a link, an unlink that leaves a name and a directory rename of durable files change the
    metadata at once; the backend follows in the background.  A kill -9 before it had used to lose that
    for good: the restart never moved the objects, the old names came back through the import, and the
    new ones never reached the backend (a mount with a fresh state dir lacked them)."""
    m = s3m.mount(**NO_REIMPORT)
    os.mkdir(m.path("d"))
    a, b, c, e = (secrets.token_bytes(100_000 + i) for i in range(4))
    for name, data in {"a.bin": a, "b.bin": b, "c.bin": c, "d/e.bin": e}.items():
        put(m.path(name), data)
    r = aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    s3m.server.freeze()  # the backend cannot follow
    os.rename(m.path("a.bin"), m.path("a2.bin"))
    os.link(m.path("b.bin"), m.path("b2.bin"))
    os.link(m.path("c.bin"), m.path("c2.bin"))
    os.unlink(m.path("c.bin"))
    os.rename(m.path("d"), m.path("d2"))
    m.kill()
    s3m.server.thaw()
    want = {"a2.bin": a, "b.bin": b, "b2.bin": b, "c2.bin": c, "d2/e.bin": e}
    m2 = remount(s3m, m)
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    time.sleep(IMPORT_SETTLE_S)  # a re-listing of the root would bring back what the backend still had
    assert local_objects(m2.mountpoint) == want
    assert s3m.objects() == want
    assert "resuming the backend move of ino=" in m2.log()
    assert_no_bug(m2.log())
    assert m2.stop() == 0
    fresh = s3m.mount(name="fresh")
    assert local_objects(fresh.mountpoint) == want


def restart_after_the_backend_moved(s3m, m, data: bytes) -> None:
    """The backend moves a.bin's object to b.bin (S3: a copy, then the delete), as the killed daemon's
    job had before it could record it; a restart then finds the move done and b.bin whole."""
    client = s3m.server.client()
    client.copy_object(Bucket=s3m.bucket, Key="pre/b.bin", CopySource={"Bucket": s3m.bucket, "Key": "pre/a.bin"})
    client.delete_object(Bucket=s3m.bucket, Key="pre/a.bin")
    m2 = remount(s3m, m, **NO_REIMPORT)
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert get(m2.path("b.bin")) == data
    assert state(m2.path("b.bin")) == "durable"
    assert s3m.objects() == {"b.bin": data}
    assert "broken" not in m2.log()
    assert "were a.bin and are b.bin (the record of a move lagged the backend)" in m2.log()
    assert_no_bug(m2.log())


def test_kill9_between_a_backend_move_and_its_record_finds_the_object_moved(s3m):
    """The backend moved a renamed file's object, then the daemon died before the metadata said so:
    the restart's move finds no source.  The object at the new name holds exactly that version (every
    chunk hashed), so that is the move, done; it used to mark the file broken (EIO)."""
    m = s3m.mount(**NO_REIMPORT)
    data = secrets.token_bytes(CHUNK + 12345)
    put(m.path("a.bin"), data)
    assert aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S).returncode == 0
    ino = os.stat(m.path("a.bin")).st_ino
    m.kill()
    db = sqlite3.connect(meta_db(m), isolation_level=None)
    try:  # the rename's own transaction: the name and its pending move
        assert db.execute("UPDATE dentries SET name = ? WHERE name = ?", (b"b.bin", b"a.bin")).rowcount == 1
        db.execute("INSERT INTO moves (ino, gen, dir_path) VALUES (?, 1, NULL)", (ino,))
    finally:
        db.close()
    restart_after_the_backend_moved(s3m, m, data)


def test_kill9_between_a_move_over_another_file_and_its_record_keeps_the_moved_object(s3m):
    """``rename a.bin b.bin`` over a durable b.bin: the backend moved a.bin's object to b.bin, then the
    daemon died before the metadata said so (a kill -9 during the move's directory fsync, under I/O
    load: the torture suite's kill -9 case, about one run in a hundred).  At the restart the replaced
    b.bin's delete ran first and took the object at b.bin for its own stale one: it deleted the renamed
    file's only copy, whose move then found nothing (broken, EIO)."""
    m = s3m.mount(**NO_REIMPORT)
    data, old = secrets.token_bytes(CHUNK + 12345), secrets.token_bytes(CHUNK + 999)
    put(m.path("a.bin"), data)
    put(m.path("b.bin"), old)
    assert aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S).returncode == 0
    s3m.server.freeze()  # the backend cannot follow: the rename stays pending
    os.rename(m.path("a.bin"), m.path("b.bin"))
    m.kill()
    s3m.server.thaw()
    restart_after_the_backend_moved(s3m, m, data)


def backend_keys(m, ino: int) -> list[str]:
    """What the daemon's metadata says ``ino``'s objects are (read beside it: SQLite's WAL lets it)."""
    db = sqlite3.connect(meta_db(m))
    try:
        return json.loads(db.execute("SELECT backend_keys FROM inodes WHERE ino = ?", (ino,)).fetchone()[0])
    finally:
        db.close()


def test_kill9_between_a_backend_copy_and_its_record_brings_back_no_removed_name(s3m):
    """``ln a.bin b.bin``, then ``mv b.bin c.bin``: the backend had copied a.bin's object to b.bin for
    the link, and the daemon died before the metadata said so.  Nothing named the object at b.bin, so
    the restart's import brought the removed name back as a file (the torture suite's kill -9 case,
    seed 592308).  The copy's target is named in the row before the copy, and the restart deletes it
    as a stale object of that file once it finds there exactly the file's version."""
    m = s3m.mount(**NO_REIMPORT)  # (a lookup of b.bin must not wait for a listing of the frozen bucket)
    data = secrets.token_bytes(CHUNK + 4321)
    put(m.path("a.bin"), data)
    assert aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S).returncode == 0
    ino = os.stat(m.path("a.bin")).st_ino
    s3m.server.freeze()  # the copy for the link hangs in the backend
    os.link(m.path("a.bin"), m.path("b.bin"))
    wait_until(lambda: "b.bin" in backend_keys(m, ino), WAIT_S, "the link's target named in the row")
    os.rename(m.path("b.bin"), m.path("c.bin"))
    m.kill()
    s3m.server.thaw()
    client = s3m.server.client()  # the copy the backend made before the kill
    client.copy_object(Bucket=s3m.bucket, Key="pre/b.bin", CopySource={"Bucket": s3m.bucket, "Key": "pre/a.bin"})
    m2 = remount(s3m, m)
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    time.sleep(IMPORT_SETTLE_S)  # a listing after the import's time to live would bring b.bin back
    want = {"a.bin": data, "c.bin": data}
    assert local_objects(m2.mountpoint) == want
    assert s3m.objects() == want
    assert_no_bug(m2.log())


def test_kill9_before_a_move_over_another_file_never_takes_that_files_object_for_its_own(s3m):
    """``rename a.bin b.bin`` over a durable b.bin: the job names b.bin in a.bin's row, then the kill
    comes before the backend moves anything.  b.bin still holds the replaced file's bytes, of a.bin's
    size: taken for a.bin's object because the row names it, the move would be skipped and those bytes
    served as a.bin's.  Kept only where it holds exactly a.bin's version, the move is made."""
    m = s3m.mount(**NO_REIMPORT)
    data, old = secrets.token_bytes(CHUNK + 12345), secrets.token_bytes(CHUNK + 12345)
    put(m.path("a.bin"), data)
    put(m.path("b.bin"), old)
    assert aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S).returncode == 0
    ino = os.stat(m.path("a.bin")).st_ino
    s3m.server.freeze()  # the backend cannot follow
    os.rename(m.path("a.bin"), m.path("b.bin"))
    m.kill()
    s3m.server.thaw()
    db = sqlite3.connect(meta_db(m), isolation_level=None)
    try:  # what the job wrote just before the kill (which job ran first, the move or the replaced file's
        # delete, is the scheduler's choice: here the move named its target first)
        db.execute("UPDATE inodes SET backend_keys = ? WHERE ino = ?", (json.dumps(["a.bin", "b.bin"]), ino))
    finally:
        db.close()
    m2 = remount(s3m, m, **NO_REIMPORT)
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert s3m.objects() == {"b.bin": data}
    assert "were a.bin,b.bin and are a.bin (the record of a move lagged the backend)" in m2.log()
    assert_no_bug(m2.log())
    assert m2.stop() == 0
    fresh = s3m.mount(name="fresh")
    assert local_objects(fresh.mountpoint) == {"b.bin": data}


def test_kill9_during_an_upload_leaves_no_temp_file_in_the_file_backend(make_mount, tmp_path):
    """issue 23: a kill -9 during uploads left ``.aiturbo-upload.*`` files in the backend for good
    (recovery finished, clean unmount after), which also kept ``rmdir`` of their directory from
    reaching the backend."""
    backend = str(tmp_path / "backend")
    m = make_mount()
    os.mkdir(m.path("d"))
    data = secrets.token_bytes(64 * MiB)
    put(m.path("d/big.bin"), data)  # its upload starts at close
    temps = kill_during_an_upload(m, backend)
    assert temps, "the daemon was killed with no upload in flight"
    m2 = make_mount(name="again", state_dir=m.state_dir)
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert get(m2.path("d/big.bin")) == data
    assert upload_temps(backend) == []
    assert_no_bug(m2.log())
    assert m2.stop() == 0
    assert upload_temps(backend) == []


def kill_during_an_upload(m, backend: str, timeout_s: float = 30.0) -> list[str]:
    """kill -9 the daemon while an upload's temp file is in ``backend``; returns those temps.

    The daemon is stopped (SIGSTOP) when one is seen, and killed only if it is still there."""
    assert m.proc is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if upload_temps(backend):
            m.proc.send_signal(signal.SIGSTOP)
            temps = upload_temps(backend)
            if temps:
                m.kill()
                return temps
            m.proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    m.kill()
    return []


def test_kill9_never_serves_bytes_written_after_the_last_close(s3m):
    """Bytes a writer left in a hole of its file's backing file, fd still open at the kill -9, were
    never committed: a restart must neither serve them nor persist them.  The old recovery kept
    them in the backing file and the kernel read them (passthrough found the file "all local"):
    one open read ZZZZ in chunk 1, and the next commit uploaded them as the file's."""
    m = s3m.mount(**NO_REIMPORT)
    path = m.path("h.bin")
    with open(path, "wb") as f:
        f.write(b"A" * CHUNK)
        f.truncate(2 * CHUNK)  # chunk 1 is a hole
    assert wait_state(path, "durable") == "durable"
    s3m.server.freeze()  # the next version stays staged
    with open(path, "r+b") as f:
        f.write(b"B" * 4096)
    want = b"B" * 4096 + b"A" * (CHUNK - 4096) + bytes(CHUNK)
    assert get(path) == want
    writer = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(writer, b"Z" * 4096, CHUNK)  # into the hole; never closed before the crash
        m.kill()
    finally:
        with contextlib.suppress(OSError):
            os.close(writer)
    s3m.server.thaw()
    m2 = remount(s3m, m)
    for _ in range(3):
        assert get(m2.path("h.bin")) == want
    with open(m2.path("h.bin"), "r+b") as f:
        f.seek(100)
        f.write(b"C")
    want = want[:100] + b"C" + want[101:]
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert get(m2.path("h.bin")) == want
    assert s3m.objects()["h.bin"] == want
    assert_no_bug(m2.log())


def test_host_reboot_without_spill_reports_broken_never_other_bytes(s3m):
    """A reboot empties the tmpfs: what was only staged there is broken, never served as other bytes."""
    m = s3m.mount(**NO_REIMPORT)
    keep, v1, lost, _v2 = write_while_frozen(s3m, m)
    m.kill()
    m.wipe_staging()  # what a power cut does to the DRAM tmpfs (and to the page cache)
    s3m.server.thaw()
    m2 = remount(s3m, m)
    for name in lost:
        assert state(m2.path(name)) == "broken"
        assert_eio(m2.path(name))
    # over.bin has an older durable object, but v2 is gone: broken, never v1.
    assert wait_state(m2.path("over.bin"), "broken", WAIT_S) == "broken"
    assert_eio(m2.path("over.bin"))
    r = aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S)
    assert r.returncode == 1
    for name in (*lost, "over.bin"):
        assert f"broken: {m2.path(name)}" in r.stderr
    assert "keep.bin" not in r.stderr.split("broken:", 1)[1]
    assert get(m2.path("keep.bin")) == keep and state(m2.path("keep.bin")) == "durable"
    objects = s3m.objects()
    assert sorted(objects) == ["keep.bin", "over.bin"] and objects["over.bin"] == v1  # no partial upload published
    log = m2.log()
    assert "broken path=lost1.bin reason=" in log and "not in its backing file" in log
    assert_no_bug(log)


# ------------------------------------------------- power cut (the lost tail of the WAL)
#
# A power cut loses what the metadata database committed after its last
# fsync (see aiturbofs/meta/_sqlite.py); a daemon crash loses nothing.  kill -9
# cannot show that, so these tests cut the tail themselves: they put back a
# consistent copy of the database taken earlier (sqlite3's backup API reads
# one snapshot), or undo the rows' last transition, as a replay of the WAL
# up to an older fsync would.


def meta_db(m) -> str:
    return os.path.join(m.state_dir, "meta.db")


def snapshot_db(m, dest: str) -> None:
    src, dst = sqlite3.connect(meta_db(m)), sqlite3.connect(dest)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


def power_cut(m) -> None:
    """The host goes down: the daemon dies and the DRAM tmpfs with it."""
    m.kill()
    m.wipe_staging()


def restore_db(m, snapshot: str) -> None:
    """The daemon is dead: its database becomes ``snapshot`` (no WAL beside it)."""
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(meta_db(m) + suffix)
    shutil.copyfile(snapshot, meta_db(m))


def test_power_cut_after_the_upload_finds_the_bytes_in_the_backend(s3m):
    """The host died after the objects were published but before the
    ``durable`` states were synced: the restart sees ``persisting`` rows.
    Their objects hold exactly those versions (size and every chunk's BLAKE3
    checked), so they are durable, not broken; one whose object was changed
    meanwhile is broken, never served with the other bytes."""
    m = s3m.mount(**NO_REIMPORT)
    files = {"a.bin": secrets.token_bytes(2 * CHUNK + 5), "b.txt": b"small", "empty": b"",
             "c.bin": secrets.token_bytes(CHUNK)}
    for name, data in files.items():
        put(m.path(name), data)
    assert aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S).returncode == 0
    power_cut(m)
    db = sqlite3.connect(meta_db(m), isolation_level=None)
    try:
        changed = db.execute(
            "UPDATE inodes SET state = 'persisting', backend_keys = '[]', persisted_version = 0, backend_etag = NULL"
            " WHERE state = 'durable' AND (mode & 61440) = 32768").rowcount
    finally:
        db.close()
    assert changed == len(files)
    other = secrets.token_bytes(CHUNK)  # another tool rewrote c.bin in between: same size, other bytes
    S3Writer(s3m).put("c.bin", other)
    m2 = remount(s3m, m, **NO_REIMPORT)
    for name in ("a.bin", "b.txt", "empty"):
        assert state(m2.path(name)) == "durable", name
        assert get(m2.path(name)) == files[name], name
    assert state(m2.path("c.bin")) == "broken"
    assert_eio(m2.path("c.bin"))
    log = m2.log()
    assert "from=backend key=a.bin" in log and "from=backend key=b.txt" in log  # (empty has no chunk to lose)
    assert "broken path=c.bin" in log
    assert s3m.objects()["c.bin"] == other  # the broken file's object is left as it is
    assert_no_bug(log)


def test_power_cut_before_a_close_was_synced_brings_back_the_synced_version(s3m, tmp_path):
    """close() commits without an fsync; a power cut right after it (the
    bytes were only in DRAM) brings back the file's last synced version,
    exact and durable, and drops what was created since: never a mix."""
    m = s3m.mount(**NO_REIMPORT)
    v1 = secrets.token_bytes(CHUNK + 7)
    put(m.path("f.bin"), v1)
    assert aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S).returncode == 0
    snapshot = str(tmp_path / "synced.db")
    snapshot_db(m, snapshot)  # what the disk holds at the last fsync
    s3m.server.freeze()  # nothing after this reaches the backend
    put(m.path("f.bin"), secrets.token_bytes(CHUNK + 7))
    put(m.path("new.bin"), b"made after the last fsync")
    power_cut(m)
    restore_db(m, snapshot)
    s3m.server.thaw()
    m2 = remount(s3m, m, **NO_REIMPORT)
    assert get(m2.path("f.bin")) == v1 and state(m2.path("f.bin")) == "durable"
    assert not os.path.exists(m2.path("new.bin"))
    assert aiturbo("wait", m2.mountpoint, check=False, timeout=WAIT_S).returncode == 0
    assert sorted(s3m.objects()) == ["f.bin"] and s3m.objects()["f.bin"] == v1
    assert_no_bug(m2.log())


def test_power_cut_after_a_publish_whose_states_were_not_synced_reads_the_backend_version(s3m, tmp_path):
    """The persisting state is not synced: a power cut after the upload of
    v2 published its object but before any fsync brings back the row of v1
    (durable) beside an object holding v2.  The import sees an object whose
    etag is not the row's and takes it: the file reads v2, exactly, never a
    mix of the two or an I/O error."""
    m = s3m.mount()
    v1, v2 = secrets.token_bytes(CHUNK + 9), secrets.token_bytes(CHUNK + 9)
    put(m.path("f.bin"), v1)
    assert aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S).returncode == 0
    snapshot = str(tmp_path / "synced.db")
    snapshot_db(m, snapshot)
    put(m.path("f.bin"), v2)
    assert aiturbo("wait", m.mountpoint, check=False, timeout=WAIT_S).returncode == 0
    power_cut(m)
    restore_db(m, snapshot)
    m2 = remount(s3m, m)
    time.sleep(IMPORT_SETTLE_S)
    assert get(m2.path("f.bin")) == v2
    assert state(m2.path("f.bin")) == "durable"
    assert_no_bug(m2.log())


# ------------------------------------------------------------------- BLAKE3 checks


def test_corrupt_spill_chunk_is_broken_not_wrong_bytes(s3m, tmp_path):
    spill = str(tmp_path / "spill")
    m = s3m.mount(spill=spill, **NO_REIMPORT)
    os.listdir(m.path(""))  # the one import of the root, before the outage
    s3m.server.freeze()
    bad, good = secrets.token_bytes(2 * CHUNK), secrets.token_bytes(CHUNK // 2)
    put(m.path("bad.bin"), bad)
    put(m.path("good.bin"), good)
    names = chunk_keys(bad) + chunk_keys(good)
    wait_until(lambda: set(names) <= set(os.listdir(spill)), what="chunks spilled")
    m.kill()
    flip_byte(os.path.join(spill, chunk_keys(bad)[1]), 12345)
    s3m.server.thaw()
    m2 = remount(s3m, m, spill=spill)
    assert_eio(m2.path("bad.bin"), CHUNK, MiB)
    assert wait_state(m2.path("bad.bin"), "broken", WAIT_S) == "broken"
    assert_eio(m2.path("bad.bin"))
    assert wait_state(m2.path("good.bin"), "durable", WAIT_S) == "durable"
    assert get(m2.path("good.bin")) == good
    assert sorted(s3m.objects()) == ["good.bin"]
    log = m2.log()
    assert "BLAKE3 mismatch" in log and chunk_keys(bad)[1] in log
    assert_no_bug(log)


def test_corrupt_backend_object_is_eio_not_flipped_bytes(make_mount, tmp_path):
    m = make_mount()
    data = secrets.token_bytes(2 * CHUNK + 100)
    put(m.path("f.bin"), data)
    assert wait_state(m.path("f.bin"), "durable") == "durable"
    obj = str(tmp_path / "backend" / "f.bin")
    flip_byte(obj, CHUNK + 1000)  # chunk 1; size and mtime unchanged: looks untouched
    assert aiturbo("drop-cache", m.mountpoint).returncode == 0
    time.sleep(IMPORT_SETTLE_S)  # a re-import must not take the object as new content
    assert_eio(m.path("f.bin"))
    assert_eio(m.path("f.bin"), CHUNK, MiB)
    with open(m.path("f.bin"), "rb") as f:
        assert f.read(MiB) == data[:MiB]  # chunk 0 is intact and verifies
    log = m.log()
    assert "BLAKE3 mismatch for f.bin chunk 1" in log, log[-3000:]
    assert any("f.bin" in e or "chunk 1" in e for e in status(m)["errors"])


# ---------------------------------------------------------------- import from backend


class LocalWriter:
    def __init__(self, root):
        self.root = root

    def put(self, key: str, data: bytes) -> None:
        path = os.path.join(self.root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def delete(self, key: str) -> None:
        os.unlink(os.path.join(self.root, key))


class S3Writer:
    def __init__(self, s3m):
        self.client, self.bucket = s3m.server.client(), s3m.bucket

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"pre/{key}", Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=f"pre/{key}")


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_objects_from_other_tools_show_up(kind, request, make_mount, tmp_path):
    if kind == "s3":
        s3m = request.getfixturevalue("s3m")
        writer, mount, backend_objects = S3Writer(s3m), s3m.mount, s3m.objects
    else:
        (tmp_path / "backend").mkdir()
        writer, mount = LocalWriter(str(tmp_path / "backend")), make_mount
        backend_objects = lambda: local_objects(tmp_path / "backend")  # noqa: E731
    objects = {
        "top.bin": secrets.token_bytes(CHUNK + 100),
        "dir/a.txt": b"alpha\n",
        "dir/sub/b.bin": secrets.token_bytes(3 * MiB),
        "dir/sub/deeper/c": b"",
    }
    for key, data in objects.items():
        writer.put(key, data)
    m = mount()
    assert sorted(os.listdir(m.path(""))) == ["dir", "top.bin"]
    assert sorted(os.listdir(m.path("dir"))) == ["a.txt", "sub"]
    assert sorted(os.listdir(m.path("dir", "sub"))) == ["b.bin", "deeper"]
    for key, data in objects.items():
        assert os.stat(m.path(key)).st_size == len(data), key
        assert get(m.path(key)) == data, key
        assert state(m.path(key)) == "durable"
    # Changed, added and removed outside the mount: seen after the TTL.
    writer.put("dir/a.txt", b"changed, and longer than before\n")
    same_size = secrets.token_bytes(len(objects["top.bin"]))
    writer.put("top.bin", same_size)  # same size: only the etag tells
    writer.put("dir/sub/new.txt", b"new")
    writer.delete("dir/sub/b.bin")
    time.sleep(IMPORT_SETTLE_S)
    assert sorted(os.listdir(m.path("dir", "sub"))) == ["deeper", "new.txt"]
    assert get(m.path("dir", "a.txt")) == b"changed, and longer than before\n"
    assert os.stat(m.path("dir", "a.txt")).st_size == len(b"changed, and longer than before\n")
    assert sha(get(m.path("top.bin"))) == sha(same_size)
    assert get(m.path("dir", "sub", "new.txt")) == b"new"
    assert not os.path.exists(m.path("dir", "sub", "b.bin"))
    # An imported file written through the mount persists like any other.
    with open(m.path("top.bin"), "r+b") as f:
        f.seek(5)
        f.write(b"XYZ")
    want = same_size[:5] + b"XYZ" + same_size[8:]
    assert wait_state(m.path("top.bin"), "durable", WAIT_S) == "durable"
    assert get(m.path("top.bin")) == want
    assert sha(backend_objects()["top.bin"]) == sha(want)


# ----------------------------------------------------------------- spill store unit


async def test_concurrent_spills_of_one_chunk_leave_a_whole_file(tmp_path):
    """Regression: two spills of one key shared a temp file; one renamed it half-written."""
    data = secrets.token_bytes(CHUNK)
    key = chunk.digest(data)

    for _ in range(10):
        store = SpillStore(str(tmp_path / "spill"))
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(store.write, key, data)
        assert await store.read(key) == data
        assert os.listdir(tmp_path / "spill") == [key.hex()]
        store.discard(key)
