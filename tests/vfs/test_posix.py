"""POSIX behaviour of a real aiturbofs mount, compared with what a local
filesystem does, and the backend layout the persister leaves behind.

After each significant scenario the mount is stopped (which drains the
persist queue) and ``verify_persisted`` checks that the backend directory
holds the natural layout with exactly the expected bytes and no upload
leftovers, then mounts the same backend with a NEW state dir (everything is
imported from the backend) and checks it shows the same tree and bytes.

What the backend is not expected to hold (object-store semantics): symlinks,
empty directories, modes/owners/times and xattrs.  Those live in the
metadata engine only, so ``verify_persisted`` leaves them out.
"""

import ctypes
import errno
import json
import mmap
import os
import random
import secrets
import socket
import stat
import subprocess
import time

import pytest
from mounting import aiturbo, state, wait_state
from trees import describe_diff, tree, verify_persisted

MiB = 1 << 20
CHUNK = 8 * MiB

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


# ----------------------------------------------------------------- helpers
def write_file(path, data: bytes, mode: str = "wb") -> None:
    with open(path, mode) as f:
        f.write(data)


def read_file(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def err_of(fn, *args, **kwargs) -> int:
    try:
        fn(*args, **kwargs)
    except OSError as exc:
        return exc.errno
    raise AssertionError(f"{getattr(fn, '__name__', fn)}{args} did not fail")


_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(old: str, new: str, flags: int) -> None:
    fn = _libc.renameat2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), old)


def rand_bytes(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n)



def test_an_ioctl_is_enotty_and_security_capability_is_enodata(make_mount):
    """What every open and first write ask on a FUSE file (Python's open() asks isatty, the kernel asks
    for security.capability before a write): an ioctl a regular file does not know is ENOTTY, as on a
    local filesystem, and a file has no capability."""
    import fcntl
    import termios

    m = make_mount()
    write_file(m.path("f"), b"data")
    with open(m.path("f"), "rb") as f:
        assert err_of(fcntl.ioctl, f.fileno(), termios.TCGETS, bytes(64)) == errno.ENOTTY
        assert not os.isatty(f.fileno())
    assert err_of(os.getxattr, m.path("f"), "security.capability") == errno.ENODATA
    assert os.getxattr(m.path("f"), "user.aiturbo.state") in (b"staged", b"persisting", b"durable")

# ------------------------------------------------- create/read/write/truncate
def test_write_read_truncate_across_chunks(make_mount, tmp_path):
    m = make_mount()
    rng = random.Random(1)
    p = m.path("t.bin")
    model = bytearray(rand_bytes(rng, CHUNK + MiB + 123))  # crosses the 8 MiB boundary
    write_file(p, model)
    assert os.stat(p).st_size == len(model)
    assert read_file(p) == model

    # shrink into the first chunk, by path (file not open)
    os.truncate(p, CHUNK - 10)
    del model[CHUNK - 10 :]
    assert os.stat(p).st_size == CHUNK - 10
    assert read_file(p) == model

    # grow across the boundary through an fd: the new range reads as zeros
    with open(p, "r+b") as f:
        os.ftruncate(f.fileno(), 2 * CHUNK + 5)
        model.extend(bytes(2 * CHUNK + 5 - len(model)))
        assert os.fstat(f.fileno()).st_size == len(model)
        f.seek(CHUNK - 3)
        assert f.read(10) == bytes(10)
        # write into the hole across the boundary, then read back
        os.pwrite(f.fileno(), b"X" * 7, CHUNK - 2)
        model[CHUNK - 2 : CHUNK + 5] = b"X" * 7
    assert read_file(p) == model

    # shrink exactly to the boundary, then to zero, then grow sparse
    os.truncate(p, CHUNK)
    del model[CHUNK:]
    assert read_file(p) == model
    with open(p, "r+b") as f:
        f.truncate(0)
        assert os.fstat(f.fileno()).st_size == 0
        os.pwrite(f.fileno(), b"tail", 3 * CHUNK + 100)  # chunks 0..2 are holes
    model = bytearray(3 * CHUNK + 100) + b"tail"
    assert os.stat(p).st_size == len(model)
    got = read_file(p)
    assert got == model
    assert wait_state(p, "durable") == "durable"

    # a sparse file written with seek+write (holes in the middle)
    q = m.path("sparse.bin")
    with open(q, "wb") as f:
        f.write(b"A" * 100)
        f.seek(2 * CHUNK + 17)
        f.write(b"B" * 100)
    sparse = b"A" * 100 + bytes(2 * CHUNK + 17 - 100) + b"B" * 100
    assert read_file(q) == sparse
    # an empty file
    write_file(m.path("empty"), b"")
    assert os.stat(m.path("empty")).st_size == 0
    verify_persisted(make_mount, m, tmp_path)


def test_write_past_eof_after_reopen(make_mount, tmp_path):
    """A write that skips the short tail chunk of a closed file (it grows to
    a full chunk of zeros): was a broken file after a failed upload."""
    m = make_mount()
    cases = {
        "small-tail": (b"a" * 100, CHUNK + 5),
        "two-chunks-later": (b"b" * 5000, 2 * CHUNK + 1),
        "tail-in-chunk-1": (b"c" * (CHUNK + 3), 3 * CHUNK - 2),
    }
    want = {}
    for name, (head, off) in cases.items():
        write_file(m.path(name), head)
        fd = os.open(m.path(name), os.O_RDWR)
        try:
            os.pwrite(fd, b"Z" * 10, off)
        finally:
            os.close(fd)
        want[name] = head + bytes(off - len(head)) + b"Z" * 10
        assert read_file(m.path(name)) == want[name], name
    with open(m.path("durable-first"), "wb") as f:
        f.write(b"d" * 10)
    assert wait_state(m.path("durable-first"), "durable") == "durable"
    with open(m.path("durable-first"), "r+b") as f:
        f.seek(CHUNK + 1)
        f.write(b"e")
    want["durable-first"] = b"d" * 10 + bytes(CHUNK + 1 - 10) + b"e"
    for name in want:
        assert wait_state(m.path(name), "durable") == "durable", name
    aiturbo("drop-cache", m.mountpoint)
    for name, data in want.items():
        assert read_file(m.path(name)) == data, name
    verify_persisted(make_mount, m, tmp_path)


def test_truncate_of_durable_file_and_reopen(make_mount, tmp_path):
    """Shrink/grow a file whose chunks were already persisted (sealed slots)."""
    m = make_mount()
    rng = random.Random(2)
    p = m.path("d.bin")
    data = bytearray(rand_bytes(rng, 2 * CHUNK + 3 * MiB))
    write_file(p, data)
    assert wait_state(p, "durable") == "durable"
    aiturbo("drop-cache", m.mountpoint)  # chunks must now come back from the backend
    os.truncate(p, CHUNK + 5)
    del data[CHUNK + 5 :]
    assert read_file(p) == data
    os.truncate(p, 2 * CHUNK)
    data.extend(bytes(2 * CHUNK - len(data)))
    assert read_file(p) == data
    with open(p, "r+b") as f:
        f.seek(CHUNK + 1)
        f.write(b"mid")
        data[CHUNK + 1 : CHUNK + 4] = b"mid"
    assert read_file(p) == data
    assert wait_state(p, "durable") == "durable"
    verify_persisted(make_mount, m, tmp_path)


def test_open_o_trunc_overwrites(make_mount, tmp_path):
    """open(O_TRUNC) on an existing file (libfuse's atomic_o_trunc path)."""
    m = make_mount()
    rng = random.Random(12)
    p = m.path("x")
    write_file(p, b"0123456789")
    write_file(p, b"abc")  # "wb" = O_WRONLY|O_CREAT|O_TRUNC
    assert os.stat(p).st_size == 3 and read_file(p) == b"abc"
    big = m.path("big")
    write_file(big, rand_bytes(rng, 2 * CHUNK + 9))
    assert wait_state(big, "durable") == "durable"
    fd = os.open(big, os.O_RDWR | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        assert os.read(fd, 100) == b""
        os.write(fd, b"short")
    finally:
        os.close(fd)
    assert read_file(big) == b"short"
    verify_persisted(make_mount, m, tmp_path)

    # files imported from the backend: truncate by path, overwrite with "wb"
    data = rand_bytes(rng, 2 * CHUNK + 5)
    for name in ("imp-shrink", "imp-grow", "imp-over", "imp-zero"):
        (tmp_path / "backend" / name).write_bytes(data)
    m2 = make_mount(name="m2")
    os.truncate(m2.path("imp-shrink"), CHUNK + 100)  # was EIO: an unhashed chunk stayed
    assert read_file(m2.path("imp-shrink")) == data[: CHUNK + 100]
    os.truncate(m2.path("imp-grow"), 3 * CHUNK)
    assert read_file(m2.path("imp-grow")) == data + bytes(3 * CHUNK - len(data))
    os.truncate(m2.path("imp-zero"), 0)
    assert read_file(m2.path("imp-zero")) == b""
    fetched_before = json.loads(aiturbo("status", m2.mountpoint, "--json").stdout)["persist"]["bytes_fetched"]
    write_file(m2.path("imp-over"), b"new")
    assert read_file(m2.path("imp-over")) == b"new"
    status = json.loads(aiturbo("status", m2.mountpoint, "--json").stdout)
    assert status["persist"]["bytes_fetched"] == fetched_before  # not read just to be thrown away
    verify_persisted(make_mount, m2, tmp_path)


def test_o_append(make_mount, tmp_path):
    m = make_mount()
    p = m.path("log.txt")
    write_file(p, b"start\n")
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"one\n")
        os.lseek(fd, 0, os.SEEK_SET)  # O_APPEND ignores the position
        os.write(fd, b"two\n")
        os.write(fd, b"three\n")
    finally:
        os.close(fd)
    # a second appender after another writer grew the file
    with open(p, "ab") as f:
        f.write(b"x" * (CHUNK + 1))
    with open(p, "ab") as f:
        f.write(b"end\n")
    want = b"start\none\ntwo\nthree\n" + b"x" * (CHUNK + 1) + b"end\n"
    assert read_file(p) == want
    assert os.stat(p).st_size == len(want)
    verify_persisted(make_mount, m, tmp_path)


def test_o_direct_aligned_writes(make_mount, tmp_path):
    m = make_mount()
    p = m.path("direct.bin")
    rng = random.Random(3)
    block = 1 * MiB
    total = CHUNK + 2 * block  # crosses a chunk boundary
    want = bytearray()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        buf = mmap.mmap(-1, block)  # page-aligned memory, as O_DIRECT needs
        for _ in range(total // block):
            piece = rand_bytes(rng, block)
            buf[:] = piece
            assert os.write(fd, buf) == block
            want += piece
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.stat(p).st_size == total
    assert read_file(p) == want
    # read back through O_DIRECT too, into aligned memory
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, block)
        got = bytearray()
        while True:
            n = os.readv(fd, [buf])
            if n == 0:
                break
            got += buf[:n]
    finally:
        os.close(fd)
    assert got == want
    verify_persisted(make_mount, m, tmp_path)


# ------------------------------------------------------------- directories
def test_mkdir_rmdir_errors(mnt):
    d = mnt.path("d")
    os.mkdir(d)
    assert stat.S_ISDIR(os.stat(d).st_mode)
    assert err_of(os.mkdir, d) == errno.EEXIST
    write_file(mnt.path("d", "f"), b"x")
    assert err_of(os.rmdir, d) == errno.ENOTEMPTY
    assert err_of(os.rmdir, mnt.path("d", "f")) == errno.ENOTDIR
    assert err_of(os.mkdir, mnt.path("d", "f", "sub")) == errno.ENOTDIR
    assert err_of(open, mnt.path("d", "f", "x"), "wb") == errno.ENOTDIR
    assert err_of(os.unlink, d) == errno.EISDIR
    assert err_of(open, d, "wb") == errno.EISDIR
    assert err_of(os.listdir, mnt.path("d", "f")) == errno.ENOTDIR
    assert err_of(os.rmdir, mnt.path("nope")) == errno.ENOENT
    assert err_of(os.stat, mnt.path("nope")) == errno.ENOENT
    # a directory over a file and a file over a directory
    os.mkdir(mnt.path("d2"))
    assert err_of(os.rename, mnt.path("d2"), mnt.path("d", "f")) == errno.ENOTDIR
    assert err_of(os.rename, mnt.path("d", "f"), mnt.path("d2")) == errno.EISDIR
    assert err_of(os.rename, d, mnt.path("d", "inside")) == errno.EINVAL
    nlink_before = os.stat(mnt.path()).st_nlink
    os.mkdir(mnt.path("d3"))
    assert os.stat(mnt.path()).st_nlink == nlink_before + 1  # ".." of the new dir
    os.rmdir(mnt.path("d3"))
    assert os.stat(mnt.path()).st_nlink == nlink_before
    os.unlink(mnt.path("d", "f"))
    os.rmdir(d)
    assert not os.path.exists(d)
    assert sorted(os.listdir(mnt.path())) == ["d2"]


ODD_NAMES = [
    b"with space", b"tab\there", b"new\nline", b"\xff\xfe-not-utf8", "ümlaut-日本".encode(),
    b"-leading-dash", b".hidden", b"..dots..", b"back\\slash", b"quote'\"", b"star*?[x]",
    b"%percent%2F", b"x" * 255,
]


def test_readdir_lists_dot_and_dotdot_with_their_inodes(make_mount):
    # getdents of a directory gives "." and ".." first, as every local filesystem does (find, fts and
    # some backup tools expect them); they were missing.
    m = make_mount()
    os.makedirs(m.path("a", "b"))
    for i in range(3):
        open(m.path("a", "b", f"f{i}"), "wb").close()
    for d, parent in ((m.path("a", "b"), m.path("a")), (m.path("a"), m.mountpoint), (m.mountpoint, m.mountpoint)):
        out = subprocess.run(["ls", "-a1i", "-f", d], capture_output=True, text=True, check=True).stdout.split("\n")
        listed = [line.split(None, 1) for line in out if line]
        assert [name for _, name in listed[:2]] == [".", ".."], listed
        assert int(listed[0][0]) == os.stat(d).st_ino
        if d != m.mountpoint:  # (the mount root's ".." is outside: the kernel answers stat for it)
            assert int(listed[1][0]) == os.stat(parent).st_ino
        assert sorted(name for _, name in listed[2:]) == sorted(os.listdir(d))


def test_readdir_many_and_odd_names(make_mount, tmp_path):
    m = make_mount()
    big = os.fsencode(m.path("big"))
    os.mkdir(big)
    names = {b"f%05d" % i for i in range(2000)}
    for i, n in enumerate(sorted(names)):
        fd = os.open(os.path.join(big, n), os.O_WRONLY | os.O_CREAT, 0o644)
        if i % 100 == 0:
            os.write(fd, n)
        os.close(fd)
    listed = os.listdir(big)
    assert len(listed) == len(set(listed)) == 2000
    assert set(listed) == names
    # scandir with stat (readdirplus) agrees
    sizes = {e.name: e.stat().st_size for e in os.scandir(big)}
    assert sum(sizes.values()) == 20 * 6
    odd = os.fsencode(m.path("odd"))
    os.mkdir(odd)
    for n in ODD_NAMES:
        write_file(os.path.join(odd, n), n)
    assert set(os.listdir(odd)) == set(ODD_NAMES)
    for n in ODD_NAMES:
        assert read_file(os.path.join(odd, n)) == n
    # removing half while listing keeps the rest listed exactly once
    for n in sorted(names)[::2]:
        os.unlink(os.path.join(big, n))
    assert set(os.listdir(big)) == set(sorted(names)[1::2])
    verify_persisted(make_mount, m, tmp_path)


def test_name_too_long(mnt):
    ok = "n" * 255
    long = "n" * 256
    write_file(mnt.path(ok), b"ok")
    assert read_file(mnt.path(ok)) == b"ok"
    assert err_of(open, mnt.path(long), "wb") == errno.ENAMETOOLONG
    assert err_of(os.stat, mnt.path(long)) == errno.ENAMETOOLONG
    assert err_of(os.mkdir, mnt.path(long)) == errno.ENAMETOOLONG
    assert err_of(os.symlink, "t", mnt.path(long)) == errno.ENAMETOOLONG
    assert err_of(os.rename, mnt.path(ok), mnt.path(long)) == errno.ENAMETOOLONG
    assert err_of(os.link, mnt.path(ok), mnt.path(long)) == errno.ENAMETOOLONG
    assert os.listdir(mnt.path()) == [ok]


# ----------------------------------------------------------------- unlink
def test_unlink_open_file(make_mount, tmp_path):
    m = make_mount()
    rng = random.Random(4)
    p = m.path("gone.bin")
    data = rand_bytes(rng, CHUNK + 4096)
    write_file(p, data)
    keep = m.path("keep.bin")
    write_file(keep, b"keep")
    f = open(p, "rb")
    try:
        os.unlink(p)
        assert not os.path.exists(p)
        assert "gone.bin" not in os.listdir(m.path())
        assert os.fstat(f.fileno()).st_nlink == 0
        assert f.read() == data  # data still readable through the open fd
        f.seek(CHUNK - 10)
        assert f.read(20) == data[CHUNK - 10 : CHUNK + 10]
        # a new file may take the name meanwhile
        write_file(p, b"new")
        assert read_file(p) == b"new"
    finally:
        f.close()
    assert read_file(p) == b"new"
    assert wait_state(p, "durable") == "durable"  # the new file took the backend name
    assert (tmp_path / "backend" / "gone.bin").read_bytes() == b"new"
    # an unlinked file that is still being written
    q = m.path("scratch.bin")
    fd = os.open(q, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.unlink(q)
        os.write(fd, b"a" * (CHUNK + 1))
        assert os.pread(fd, 5, CHUNK - 2) == b"aaa"
        assert os.fstat(fd).st_size == CHUNK + 1
    finally:
        os.close(fd)
    assert not os.path.exists(q)
    # a durable file unlinked while open: its backend object goes after close
    r = m.path("durable-gone.bin")
    write_file(r, b"d" * 5000)
    assert wait_state(r, "durable") == "durable"
    with open(r, "rb") as f:
        os.unlink(r)
        aiturbo("drop-cache", m.mountpoint)
        assert f.read() == b"d" * 5000  # from the backend object, still there
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (tmp_path / "backend" / "durable-gone.bin").exists():
        time.sleep(0.05)
    assert not (tmp_path / "backend" / "durable-gone.bin").exists()
    verify_persisted(make_mount, m, tmp_path)


# ----------------------------------------------------------------- rename
def test_rename_files(make_mount, tmp_path):
    m = make_mount()
    rng = random.Random(5)
    a, b = m.path("a"), m.path("b")
    da, db = rand_bytes(rng, 3 * MiB), rand_bytes(rng, CHUNK + 1)
    write_file(a, da)
    write_file(b, db)
    assert wait_state(b, "durable") == "durable"
    ino_a = os.stat(a).st_ino
    os.rename(a, b)  # over an existing (durable) file
    assert not os.path.exists(a)
    assert read_file(b) == da
    assert os.stat(b).st_ino == ino_a

    # rename of an open file, then keep writing through the fd
    c = m.path("c")
    with open(c, "wb") as f:
        f.write(b"1" * MiB)
        f.flush()
        os.rename(c, m.path("c2"))
        f.write(b"2" * (CHUNK))
    assert read_file(m.path("c2")) == b"1" * MiB + b"2" * CHUNK
    assert not os.path.exists(c)

    # rename of a file not yet persisted (big enough to still be staged)
    big = rand_bytes(rng, 3 * CHUNK)
    n = m.path("new")
    write_file(n, big)
    os.rename(n, m.path("renamed"))
    os.mkdir(m.path("sub"))
    os.rename(m.path("renamed"), m.path("sub", "moved"))
    assert read_file(m.path("sub", "moved")) == big
    assert wait_state(m.path("sub", "moved"), "durable") == "durable"

    # RENAME_NOREPLACE
    write_file(m.path("x"), b"x")
    write_file(m.path("y"), b"y")
    with pytest.raises(OSError) as ei:
        renameat2(m.path("x"), m.path("y"), RENAME_NOREPLACE)
    assert ei.value.errno == errno.EEXIST
    assert read_file(m.path("y")) == b"y" and read_file(m.path("x")) == b"x"
    renameat2(m.path("x"), m.path("z"), RENAME_NOREPLACE)
    assert read_file(m.path("z")) == b"x" and not os.path.exists(m.path("x"))

    # RENAME_EXCHANGE, across directories, one side durable
    assert wait_state(m.path("y"), "durable") == "durable"
    write_file(m.path("sub", "w"), b"w" * (CHUNK + 2))
    renameat2(m.path("y"), m.path("sub", "w"), RENAME_EXCHANGE)
    assert read_file(m.path("y")) == b"w" * (CHUNK + 2)
    assert read_file(m.path("sub", "w")) == b"y"
    with pytest.raises(OSError) as ei:
        renameat2(m.path("y"), m.path("missing"), RENAME_EXCHANGE)
    assert ei.value.errno == errno.ENOENT

    # rename onto itself and onto a hard link of itself: no-ops
    os.rename(m.path("z"), m.path("z"))
    os.link(m.path("z"), m.path("z-link"))
    os.rename(m.path("z"), m.path("z-link"))
    assert read_file(m.path("z")) == b"x" and read_file(m.path("z-link")) == b"x"
    os.unlink(m.path("z-link"))
    verify_persisted(make_mount, m, tmp_path)


def test_rename_directory_with_contents(make_mount, tmp_path):
    m = make_mount()
    rng = random.Random(6)
    contents = {}
    for rel in ["top/a.bin", "top/sub/b.bin", "top/sub/deeper/c.bin", "top/other/d.bin"]:
        os.makedirs(os.path.dirname(m.path(rel)), exist_ok=True)
        data = rand_bytes(rng, rng.choice([10, 5000, CHUNK + 7]))
        write_file(m.path(rel), data)
        contents[rel] = data
    for rel in contents:
        assert wait_state(m.path(rel), "durable") == "durable"
    os.rename(m.path("top"), m.path("renamed"))
    os.mkdir(m.path("dst"))
    os.rename(m.path("renamed", "sub"), m.path("dst", "sub2"))
    moved = {
        "renamed/a.bin": contents["top/a.bin"],
        "dst/sub2/b.bin": contents["top/sub/b.bin"],
        "dst/sub2/deeper/c.bin": contents["top/sub/deeper/c.bin"],
        "renamed/other/d.bin": contents["top/other/d.bin"],
    }
    assert not os.path.exists(m.path("top"))
    for rel, data in moved.items():
        assert read_file(m.path(rel)) == data
    # the backend follows: files at the new paths, durable
    deadline = time.monotonic() + 30
    backend = tmp_path / "backend"
    while time.monotonic() < deadline:
        if all((backend / rel).exists() for rel in moved) and not (backend / "top" / "a.bin").exists():
            break
        time.sleep(0.1)
    for rel, data in moved.items():
        assert (backend / rel).read_bytes() == data
        assert state(m.path(rel)) == "durable"
    # a directory renamed over an empty directory
    os.mkdir(m.path("empty"))
    os.rename(m.path("renamed", "other"), m.path("empty"))
    moved["empty/d.bin"] = moved.pop("renamed/other/d.bin")
    assert read_file(m.path("empty", "d.bin")) == moved["empty/d.bin"]
    # special files in a renamed directory (a socket's mode shares a bit with S_IFDIR)
    os.mkdir(m.path("specials"))
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(m.path("specials", "sock"))
    finally:
        sock.close()
    os.mkfifo(m.path("specials", "fifo"))
    write_file(m.path("specials", "f"), b"f")
    os.rename(m.path("specials"), m.path("specials2"))
    assert sorted(os.listdir(m.path("specials2"))) == ["f", "fifo", "sock"]
    assert stat.S_ISSOCK(os.lstat(m.path("specials2", "sock")).st_mode)
    assert stat.S_ISFIFO(os.lstat(m.path("specials2", "fifo")).st_mode)
    moved["specials2/f"] = b"f"
    # a directory renamed while its new file is still staged
    os.mkdir(m.path("fresh"))
    write_file(m.path("fresh", "n.bin"), b"n" * (2 * CHUNK))
    os.rename(m.path("fresh"), m.path("fresh2"))
    assert read_file(m.path("fresh2", "n.bin")) == b"n" * (2 * CHUNK)
    verify_persisted(make_mount, m, tmp_path)


def test_rename_cycles_of_durable_files(make_mount, tmp_path):
    """Files swapping names faster than the persister moves their objects.

    Each file's backend object sits at the other's new name: moving one
    naively overwrites the other's only backend copy.
    """
    m = make_mount()
    rng = random.Random(9)
    data = {n: rand_bytes(rng, s) for n, s in [("a", 1000), ("b", CHUNK + 5), ("c", 3), ("d", 70_000), ("e", 12)]}
    for n, d in data.items():
        write_file(m.path(n), d)
    for n in data:
        assert wait_state(m.path(n), "durable") == "durable"
    aiturbo("drop-cache", m.mountpoint)  # later reads must come from the right objects
    # swap through a temporary name, in a burst
    os.rename(m.path("a"), m.path("tmp"))
    os.rename(m.path("b"), m.path("a"))
    os.rename(m.path("tmp"), m.path("b"))
    # a three-cycle with RENAME_EXCHANGE and a plain rename over a durable file
    renameat2(m.path("c"), m.path("d"), RENAME_EXCHANGE)
    renameat2(m.path("d"), m.path("e"), RENAME_EXCHANGE)
    want = {"a": data["b"], "b": data["a"], "c": data["d"], "d": data["e"], "e": data["c"]}
    for n, d in want.items():
        assert read_file(m.path(n)) == d, n
    backend = tmp_path / "backend"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all((backend / n).exists() and (backend / n).read_bytes() == d for n, d in want.items()):
            break
        time.sleep(0.1)
    for n, d in want.items():
        assert (backend / n).read_bytes() == d, n
        assert state(m.path(n)) == "durable"
    time.sleep(1)  # past import_ttl: a re-import must not drop or resurrect anything
    assert sorted(os.listdir(m.path())) == sorted(want)
    aiturbo("drop-cache", m.mountpoint)
    for n, d in want.items():
        assert read_file(m.path(n)) == d, n
    verify_persisted(make_mount, m, tmp_path)


def test_rm_rf_of_durable_tree_stays_gone(make_mount, tmp_path):
    m = make_mount()
    for d in ("t/u/v", "t/w"):
        os.makedirs(m.path(d))
    names = [f"t/u/v/f{i}" for i in range(30)] + [f"t/w/g{i}" for i in range(5)] + ["t/top"]
    for n in names:
        write_file(m.path(n), n.encode())
    for n in names:
        assert wait_state(m.path(n), "durable") == "durable"
    time.sleep(0.7)  # past import_ttl, so every directory is listed again below
    # unlink then rmdir at once: the backend still has the file when rmdir lists it
    write_file(m.path("solo"), b"x")
    os.mkdir(m.path("sd"))
    write_file(m.path("sd", "f"), b"y")
    assert wait_state(m.path("sd", "f"), "durable") == "durable"
    time.sleep(0.7)
    os.unlink(m.path("sd", "f"))
    os.rmdir(m.path("sd"))  # was ENOTEMPTY: the file came back from the backend
    out = subprocess.run(["rm", "-rf", m.path("t")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(m.path("t"))
    backend = tmp_path / "backend"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ((backend / "t").exists() or (backend / "sd").exists()):
        time.sleep(0.1)
    assert not (backend / "t").exists(), "the removed tree (or its directories) is still in the backend"
    assert not (backend / "sd").exists()
    time.sleep(0.7)
    assert sorted(os.listdir(m.path())) == ["solo"]  # nothing came back from the backend
    verify_persisted(make_mount, m, tmp_path)


def _entries(root: str) -> tuple[list[str], list[str]]:
    """(directories, files) under ``root`` as sorted relative paths ('' is root)."""
    dirs, files = [], []
    for dirpath, _dnames, fnames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel
        dirs.append(rel)
        files.extend(os.path.join(rel, f) for f in fnames)
    return sorted(dirs), sorted(files)


def _apply(root: str, op: str, args: tuple) -> str | None:
    """Do one namespace operation; the errno name it failed with, or None."""
    p = [os.path.join(root, a) if isinstance(a, str) else a for a in args]
    try:
        if op == "create":
            write_file(p[0], p[1])
        elif op == "write":
            with open(p[0], "r+b") as f:
                f.seek(p[1])
                f.write(p[2])
        elif op == "rename":
            os.rename(p[0], p[1])
        elif op == "exchange":
            renameat2(p[0], p[1], RENAME_EXCHANGE)
        elif op == "link":
            os.link(p[0], p[1])
        elif op == "unlink":
            os.unlink(p[0])
        elif op == "mkdir":
            os.mkdir(p[0])
        elif op == "rmdir":
            os.rmdir(p[0])
        return None
    except OSError as exc:
        return errno.errorcode[exc.errno]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_namespace_ops_match_local_fs(make_mount, tmp_path, seed):
    """Bursts of namespace changes (renames of durable files and of
    directories, swaps, links, unlinks), faster than the persister: the
    mount answers like a local filesystem, and the backend ends up with the
    same tree (nothing lost, nothing resurrected, no ghost directories)."""
    m = make_mount()
    local = str(tmp_path / "local")
    os.mkdir(local)
    rng = random.Random(seed)
    for i in range(200):
        dirs, files = _entries(local)
        op = rng.choice(["create", "create", "write", "rename", "rename", "exchange", "link", "unlink",
                         "mkdir", "rmdir", "rename_dir", "pause"])
        path = os.path.join(rng.choice(dirs), f"n{rng.randrange(12)}")
        args = None
        if op == "create":
            args = (path, rng.randbytes(rng.choice([0, 10, 5000, CHUNK + 10])))
        elif op == "write" and files:
            args = (rng.choice(files), rng.randrange(0, 6000), rng.randbytes(rng.randrange(1, 3000)))
        elif op in ("rename", "link") and files:
            args = (rng.choice(files), path)
        elif op == "exchange" and len(files) > 1:
            args = tuple(rng.sample(files, 2))
        elif op == "unlink" and files:
            args = (rng.choice(files),)
        elif op == "mkdir":
            args = (path,)
        elif op == "rmdir" and len(dirs) > 1:
            args = (rng.choice(dirs[1:]),)
        elif op == "rename_dir" and len(dirs) > 1:
            op, args = "rename", (rng.choice(dirs[1:]), path)
        elif op == "pause":  # let the persister catch up: later renames move durable objects
            if rng.random() < 0.5:
                time.sleep(0.3)
            else:
                aiturbo("drop-cache", m.mountpoint)
        if args is not None:
            want, got = _apply(local, op, args), _apply(m.mountpoint, op, args)
            assert got == want, (i, op, args[:2] if op != "create" else args[:1])
        if i % 25 == 0 or op == "pause":
            assert tree(m.mountpoint) == tree(local), f"after op {i}:\n" + describe_diff(tree(local), tree(m.mountpoint))
    time.sleep(1)  # past import_ttl: re-imports must neither drop nor resurrect anything
    want, got = tree(local), tree(m.mountpoint)
    assert got == want, describe_diff(want, got)
    verify_persisted(make_mount, m, tmp_path, got)


# ------------------------------------------------------------- hard links
def test_hard_links(make_mount, tmp_path):
    m = make_mount()
    p, q = m.path("orig"), m.path("sub", "link")
    os.mkdir(m.path("sub"))
    write_file(p, b"hello" * 1000)
    os.link(p, q)
    assert os.stat(p).st_nlink == 2 and os.stat(q).st_nlink == 2
    assert os.stat(p).st_ino == os.stat(q).st_ino
    assert read_file(q) == b"hello" * 1000
    # a write through one name is seen through the other
    with open(q, "r+b") as f:
        f.write(b"HELLO")
    assert read_file(p) == b"HELLO" + b"hello" * 999
    assert wait_state(p, "durable") == "durable"
    snap = tree(m.mountpoint)
    # both names exist in the backend with the same bytes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (tmp_path / "backend" / "sub" / "link").exists():
        time.sleep(0.1)
    assert (tmp_path / "backend" / "sub" / "link").read_bytes() == read_file(p)
    assert err_of(os.link, m.path("sub"), m.path("dirlink")) == errno.EPERM
    assert err_of(os.link, p, q) == errno.EEXIST
    verify_persisted(make_mount, m, tmp_path, snap)

    m2 = make_mount(name="m2")  # same backend, new state: unlink one name
    write_file(m2.path("a"), b"abc")
    os.link(m2.path("a"), m2.path("b"))
    os.unlink(m2.path("a"))
    assert os.stat(m2.path("b")).st_nlink == 1
    assert read_file(m2.path("b")) == b"abc"
    assert not os.path.exists(m2.path("a"))
    verify_persisted(make_mount, m2, tmp_path)


# ---------------------------------------------------------------- symlinks
def test_symlinks(make_mount, tmp_path):
    m = make_mount()
    write_file(m.path("target"), b"data")
    os.symlink("target", m.path("ln"))
    os.symlink("does/not/exist", m.path("dangling"))
    long_target = "x/" * 2000 + "end"
    os.symlink(long_target, m.path("longlink"))
    assert os.readlink(m.path("ln")) == "target"
    assert os.readlink(m.path("longlink")) == long_target
    assert stat.S_ISLNK(os.lstat(m.path("ln")).st_mode)
    assert os.lstat(m.path("ln")).st_size == len("target")
    assert read_file(m.path("ln")) == b"data"
    assert os.path.lexists(m.path("dangling")) and not os.path.exists(m.path("dangling"))
    assert err_of(open, m.path("dangling"), "rb") == errno.ENOENT
    assert err_of(os.readlink, m.path("target")) == errno.EINVAL
    assert err_of(os.symlink, "y", m.path("ln")) == errno.EEXIST
    # writing through a dangling symlink creates its target
    os.symlink("made", m.path("maker"))
    write_file(m.path("maker"), b"via link")
    assert read_file(m.path("made")) == b"via link"
    os.rename(m.path("ln"), m.path("ln2"))
    assert os.readlink(m.path("ln2")) == "target"
    os.unlink(m.path("ln2"))
    assert os.path.exists(m.path("target"))
    snap = tree(m.mountpoint)
    m.stop()
    m_again = make_mount()  # same state dir
    assert tree(m_again.mountpoint) == snap
    verify_persisted(make_mount, m_again, tmp_path)  # the backend holds the symlinks too, as symlinks


# -------------------------------------------------------------- attributes
def _attr_steps(p: str, d: str) -> list:
    """chmod/chown/utime steps; returns the mode/owner seen after each."""
    seen = []

    def note():
        st = os.stat(p)
        seen.append((oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid))

    write_file(p, b"attrs")
    os.chmod(p, 0o640)
    note()
    os.chmod(p, 0o4755)
    note()
    os.chown(p, 1000, 1001)  # Linux clears set-user-ID on chown of a file
    note()
    os.chmod(p, 0o6755)
    os.chown(p, -1, 1002)
    note()
    with open(p, "ab") as f:  # a write by root (CAP_FSETID) keeps the bits
        f.write(b"!")
    note()
    os.mkdir(d, 0o700)
    os.chmod(d, 0o2775)
    seen.append(oct(stat.S_IMODE(os.stat(d).st_mode)))
    return seen


def test_chmod_chown_utimens(make_mount, tmp_path):
    m = make_mount()
    (tmp_path / "local").mkdir()
    want = _attr_steps(str(tmp_path / "local" / "f"), str(tmp_path / "local" / "d"))
    p = m.path("f")
    assert _attr_steps(p, m.path("d")) == want  # the same as on the local filesystem
    atime, mtime = 1_600_000_000_123_456_789, 1_650_000_000_987_654_321
    os.utime(p, ns=(atime, mtime))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (atime, mtime)
    assert st.st_ctime_ns > mtime
    # utime through an open fd, then a write moves mtime again
    with open(p, "r+b") as f:
        os.utime(f.fileno(), ns=(atime, mtime))
        assert os.fstat(f.fileno()).st_mtime_ns == mtime
    assert os.stat(p).st_mtime_ns == mtime
    before = time.time_ns()
    with open(p, "ab") as f:
        f.write(b"?")
    assert os.stat(p).st_mtime_ns >= before - 10**9
    os.utime(p, ns=(atime, mtime))
    t0 = time.time_ns()
    os.utime(m.path("d"))  # UTIME_NOW
    assert abs(os.stat(m.path("d")).st_mtime_ns - t0) < 2 * 10**9
    snap = tree(m.mountpoint)
    # attributes survive a restart on the same state dir
    m.stop()
    m = make_mount()
    st = os.stat(p)
    assert (oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid) == want[4]
    assert (st.st_atime_ns, st.st_mtime_ns) == (atime, mtime)
    assert oct(stat.S_IMODE(os.stat(m.path("d")).st_mode)) == want[5]
    assert read_file(p) == b"attrs!?"
    verify_persisted(make_mount, m, tmp_path, snap)


def test_statvfs(mnt):
    s = os.statvfs(mnt.path())
    assert s.f_namemax == 255
    assert s.f_bsize > 0 and s.f_frsize > 0
    assert s.f_blocks > 0 and 0 <= s.f_bavail <= s.f_blocks
    free_before = s.f_bfree
    write_file(mnt.path("f"), b"z" * (4 * MiB))
    s2 = os.statvfs(mnt.path())
    assert s2.f_bfree <= free_before - (4 * MiB) // s2.f_frsize
    assert s2.f_files > 0 and s2.f_ffree > 0


# ------------------------------------------------------------------ xattrs
def test_xattrs(make_mount, tmp_path):
    m = make_mount()
    p = m.path("f")
    write_file(p, b"x")
    os.setxattr(p, "user.color", b"blue")
    os.setxattr(p, "user.empty", b"")
    os.setxattr(p, "user.bin", bytes(range(256)))
    assert os.getxattr(p, "user.color") == b"blue"
    assert os.getxattr(p, "user.empty") == b""
    assert os.getxattr(p, "user.bin") == bytes(range(256))
    assert {"user.color", "user.empty", "user.bin"} <= set(os.listxattr(p))
    os.setxattr(p, "user.color", b"red")
    assert os.getxattr(p, "user.color") == b"red"
    assert err_of(os.setxattr, p, "user.color", b"g", os.XATTR_CREATE) == errno.EEXIST
    assert err_of(os.setxattr, p, "user.none", b"g", os.XATTR_REPLACE) == errno.ENODATA
    os.removexattr(p, "user.color")
    assert err_of(os.getxattr, p, "user.color") == errno.ENODATA
    assert err_of(os.removexattr, p, "user.color") == errno.ENODATA
    assert "user.color" not in os.listxattr(p)
    # other namespaces are not supported
    assert err_of(os.setxattr, p, "security.foo", b"v") == errno.EOPNOTSUPP
    assert err_of(os.setxattr, p, "trusted.foo", b"v") == errno.EOPNOTSUPP
    assert err_of(os.getxattr, p, "security.selinux") in (errno.ENODATA, errno.EOPNOTSUPP)
    # the state is read-only and computed
    assert os.getxattr(p, "user.aiturbo.state") in (b"staged", b"persisting", b"durable")
    assert err_of(os.setxattr, p, "user.aiturbo.state", b"durable") == errno.EPERM
    assert err_of(os.removexattr, p, "user.aiturbo.state") == errno.EPERM
    os.mkdir(m.path("d"))
    # a directory's state is its own backend form's (docs/design.md: it is persisted too), also read-only
    assert os.getxattr(m.path("d"), "user.aiturbo.state") in (b"staged", b"persisting", b"durable")
    assert err_of(os.setxattr, m.path("d"), "user.aiturbo.state", b"durable") == errno.EPERM
    # bad values of the aiturbo tags
    for name, value in [
        ("user.aiturbo.group", b""), ("user.aiturbo.group", b"has space"), ("user.aiturbo.group", b"x" * 129),
        ("user.aiturbo.group", b"a/b"), ("user.aiturbo.group.size", b"0"), ("user.aiturbo.group.size", b"-1"),
        ("user.aiturbo.group.size", b"65537"), ("user.aiturbo.group.size", b"two"), ("user.aiturbo.group.size", b""),
        ("user.aiturbo.fsync", b"maybe"), ("user.aiturbo.fsync", b""), ("user.aiturbo.fsync", b"\xff"),
        ("user.aiturbo.unknown", b"1"),
    ]:
        assert err_of(os.setxattr, m.path("d"), name, value) == errno.EINVAL, (name, value)
    # inheritance of the tags by new children (not by existing ones)
    os.setxattr(m.path("d"), "user.aiturbo.group", b"job-42.a:b_c")
    os.setxattr(m.path("d"), "user.aiturbo.group.size", b"8")
    os.setxattr(m.path("d"), "user.aiturbo.fsync", b"durable")
    os.setxattr(m.path("d"), "user.other", b"not inherited")
    os.mkdir(m.path("d", "sub"))
    write_file(m.path("d", "sub", "child"), b"c")
    write_file(m.path("d", "file"), b"f")
    for child in (m.path("d", "sub"), m.path("d", "sub", "child"), m.path("d", "file")):
        assert os.getxattr(child, "user.aiturbo.group") == b"job-42.a:b_c"
        assert os.getxattr(child, "user.aiturbo.group.size") == b"8"
        assert os.getxattr(child, "user.aiturbo.fsync") == b"durable"
        assert err_of(os.getxattr, child, "user.other") == errno.ENODATA
    # fsync=durable inherited: fsync returns when the file is durable
    with open(m.path("d", "sync.bin"), "wb") as f:
        f.write(b"s" * (CHUNK + 3))
        f.flush()
        os.fsync(f.fileno())
        assert state(m.path("d", "sync.bin")) == "durable"
    assert err_of(os.getxattr, p, "user.aiturbo.group") == errno.ENODATA
    # xattrs of symlinks: user.* is refused by Linux on symlinks
    os.symlink("f", m.path("l"))
    assert err_of(os.setxattr, m.path("l"), "user.x", b"1", follow_symlinks=False) == errno.EPERM
    # limits
    assert err_of(os.setxattr, p, "user.big", b"v" * (64 * 1024 + 1)) in (errno.ERANGE, errno.E2BIG, errno.ENOSPC)
    os.setxattr(p, "user.big", b"v" * (60 * 1024))
    assert os.getxattr(p, "user.big") == b"v" * (60 * 1024)
    # xattrs survive a restart on the same state dir
    m.stop()
    m = make_mount()
    assert os.getxattr(m.path("f"), "user.bin") == bytes(range(256))
    assert os.getxattr(m.path("d", "file"), "user.aiturbo.group") == b"job-42.a:b_c"
    verify_persisted(make_mount, m, tmp_path)


def test_a_file_takes_its_directorys_tags_as_they_are_when_it_is_made(make_mount):
    """A new file's tags are its directory's at its create (the daemon keeps them from the directory's,
    not read back per file): a file made before the directory was tagged is in no group, one made after is,
    and one made after the tag was removed again is not."""
    m = make_mount()
    os.mkdir(m.path("d"))
    write_file(m.path("d", "before.bin"), os.urandom(MiB))  # the directory's tags are read here: none
    os.setxattr(m.path("d"), "user.aiturbo.group", b"j1")
    write_file(m.path("d", "tagged.bin"), os.urandom(MiB + 1))
    os.removexattr(m.path("d"), "user.aiturbo.group")
    write_file(m.path("d", "after.bin"), os.urandom(MiB + 2))
    groups = json.loads(aiturbo("status", m.mountpoint, "--json").stdout)["groups"]
    assert set(groups) == {"j1"} and groups["j1"]["files"] == 1 and groups["j1"]["bytes"] == MiB + 1, groups
    assert os.getxattr(m.path("d", "tagged.bin"), "user.aiturbo.group") == b"j1"
    for name in ("before.bin", "after.bin"):
        with pytest.raises(OSError) as caught:
            os.getxattr(m.path("d", name), "user.aiturbo.group")
        assert caught.value.errno == errno.ENODATA


# --------------------------------------------------------------- ownership
def _run_as(uid: int, gid: int, code: str, dir_fd: int) -> subprocess.CompletedProcess:
    """Run ``code`` as uid/gid; it finds the directory ``dir_fd`` as ``D``.

    The test's tmp dir is private to root (0700 ancestors): the child works
    relative to the passed descriptor, which needs no search permission on
    the ancestors.  The system Python is used because the test's own one may
    live below /root.
    """
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("needs /usr/bin/python3 to run a child as another user")
    code = f"D = {dir_fd}\n" + code
    return subprocess.run([python, "-c", code], user=uid, group=gid, extra_groups=[], pass_fds=(dir_fd,),
                          capture_output=True, text=True, timeout=60, cwd="/")


_CHILD = """
import errno, os
def attempt(fn, *args, **kw):
    try:
        fn(*args, **kw)
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
fd = os.open("mine", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=D)
os.write(fd, b"by 1000")
os.close(fd)
os.mkdir("mydir", dir_fd=D)
os.symlink("mine", "mylink", dir_fd=D)
print(attempt(os.open, "../denied", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=D))
print(attempt(os.chown, "mine", 0, 0, dir_fd=D))
print(attempt(os.chmod, "mine", 0o600, dir_fd=D))
print(attempt(os.open, "../root-only", os.O_RDONLY, dir_fd=D))
"""


@pytest.mark.root("running a child as another user")
def test_created_files_owned_by_caller(make_mount, tmp_path):
    m = make_mount(allow_other=True)  # other users may use the mount at all
    shared = m.path("shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    os.chmod(m.mountpoint, 0o755)
    write_file(m.path("root-only"), b"secret")
    os.chmod(m.path("root-only"), 0o600)
    dfd = os.open(shared, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = _run_as(1000, 1000, _CHILD, dfd)
        assert out.returncode == 0, out.stderr
        # default_permissions: the kernel checks modes against the caller
        assert out.stdout.split() == ["EACCES", "EPERM", "ok", "EACCES"]
        for name in ("mine", "mydir", "mylink"):
            st = os.lstat(os.path.join(shared, name))
            assert (st.st_uid, st.st_gid) == (1000, 1000), name
        assert stat.S_IMODE(os.stat(os.path.join(shared, "mine")).st_mode) == 0o600
        assert read_file(os.path.join(shared, "mine")) == b"by 1000"
        # setgid directory: new entries take the directory's group, subdirs stay setgid
        os.chown(shared, 0, 1234)
        os.chmod(shared, 0o2777)
        code = "import os\nos.close(os.open('g', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=D))\nos.mkdir('gd', dir_fd=D)\n"
        out = _run_as(1000, 1000, code, dfd)
        assert out.returncode == 0, out.stderr
    finally:
        os.close(dfd)
    assert os.stat(os.path.join(shared, "g")).st_gid == 1234
    assert os.stat(os.path.join(shared, "g")).st_uid == 1000
    gd = os.stat(os.path.join(shared, "gd"))
    assert gd.st_gid == 1234 and gd.st_mode & stat.S_ISGID
    verify_persisted(make_mount, m, tmp_path)


# --------------------------------------------------------------- mmap reads
def test_mmap_reads(make_mount, tmp_path):
    m = make_mount()
    rng = random.Random(7)
    data = rand_bytes(rng, CHUNK + 3 * MiB + 17)
    p = m.path("mm.bin")
    write_file(p, data)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert len(mm) == len(data)
        assert mm[:] == data
        for _ in range(50):
            off = rng.randrange(len(data))
            n = rng.randrange(1, 100_000)
            assert mm[off : off + n] == data[off : off + n]
        assert mm[CHUNK - 5 : CHUNK + 5] == data[CHUNK - 5 : CHUNK + 5]
    # mmap after the chunks were evicted: pages come from the backend again
    assert wait_state(p, "durable") == "durable"
    aiturbo("drop-cache", m.mountpoint)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[:] == data
    # a shared writable mapping: stores reach the file
    q = m.path("mw.bin")
    write_file(q, bytes(2 * MiB))
    with open(q, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        mm[100:105] = b"HELLO"
        mm[MiB : MiB + 3] = b"abc"
        mm.flush()
    want = bytearray(2 * MiB)
    want[100:105] = b"HELLO"
    want[MiB : MiB + 3] = b"abc"
    assert read_file(q) == want
    verify_persisted(make_mount, m, tmp_path)


# ----------------------------------------------------------- random writes
def _random_pwrites(fd: int, model: bytearray, rng: random.Random, count: int) -> None:
    for i in range(count):
        kind = rng.random()
        if kind < 0.1:  # across a chunk boundary
            k = rng.randrange(1, len(model) // CHUNK + 1)
            off = k * CHUNK - rng.randrange(1, 5000)
            n = rng.randrange(1, 10_000)
        elif kind < 0.2:  # a big block
            n = rng.randrange(256 * 1024, 2 * MiB)
            off = rng.randrange(0, len(model))
        else:  # small h5py-style metadata/data writes
            n = rng.randrange(1, 4096)
            off = rng.randrange(0, len(model))
        piece = rand_bytes(rng, n)
        assert os.pwrite(fd, piece, off) == n
        if off + n > len(model):
            model.extend(bytes(off + n - len(model)))
        model[off : off + n] = piece
        if i % 25 == 0:  # interleaved reads see the model
            roff = rng.randrange(0, len(model))
            rn = rng.randrange(1, 300_000)
            assert os.pread(fd, rn, roff) == bytes(model[roff : roff + rn])


def test_random_writes_with_model(make_mount, tmp_path):
    m = make_mount()
    rng = random.Random(8)
    p = m.path("h5like.bin")
    size = 2 * CHUNK + 3 * MiB
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, size)  # preallocate, as h5py does
        model = bytearray(size)
        _random_pwrites(fd, model, rng, 300)
        assert os.fstat(fd).st_size == len(model)
    finally:
        os.close(fd)
    assert read_file(p) == model
    # overwrite after close/reopen (sealed, still staged), then after durable
    for phase in ("reopen", "durable", "evicted"):
        if phase != "reopen":
            assert wait_state(p, "durable") == "durable"
        if phase == "evicted":
            aiturbo("drop-cache", m.mountpoint)
        fd = os.open(p, os.O_RDWR)
        try:
            _random_pwrites(fd, model, rng, 100)
            os.fsync(fd)
        finally:
            os.close(fd)
        assert read_file(p) == model, phase
    # two handles on one file: writes through one are seen through the other
    fa, fb = os.open(p, os.O_RDWR), os.open(p, os.O_RDONLY)
    try:
        os.pwrite(fa, b"both", CHUNK - 2)
        model[CHUNK - 2 : CHUNK + 2] = b"both"
        assert os.pread(fb, 4, CHUNK - 2) == b"both"
    finally:
        os.close(fa)
        os.close(fb)
    fresh = verify_persisted(make_mount, m, tmp_path, keep_fresh=True)
    # and random writes into the imported (unhashed) copy in the fresh mount
    q = fresh.path("h5like.bin")
    assert read_file(q) == model
    fd = os.open(q, os.O_RDWR)
    try:
        _random_pwrites(fd, model, rng, 60)
    finally:
        os.close(fd)
    assert read_file(q) == model
    verify_persisted(make_mount, fresh, tmp_path)


def test_imported_object_written_before_any_read(make_mount, tmp_path):
    """An object put into the backend by another tool (a zero chunk, a data
    chunk, a short tail), opened for writing before anything read it: its
    chunks are fetched and hashed for a manifest, the write lands in one of
    them, and the rest (the zero chunk a hole) persist unchanged."""
    model = bytearray(CHUNK) + bytearray(os.urandom(CHUNK)) + bytearray(os.urandom(1000))
    (tmp_path / "backend").mkdir(exist_ok=True)
    (tmp_path / "backend" / "outside.bin").write_bytes(model)
    m = make_mount()
    p = m.path("outside.bin")
    fd = os.open(p, os.O_RDWR)
    try:
        os.pwrite(fd, b"patched", CHUNK + 5)
        model[CHUNK + 5 : CHUNK + 12] = b"patched"
    finally:
        os.close(fd)
    assert wait_state(p, "durable", timeout_s=30) == "durable"
    assert (tmp_path / "backend" / "outside.bin").read_bytes() == model
    aiturbo("drop-cache", m.mountpoint)
    assert read_file(p) == model
    verify_persisted(make_mount, m, tmp_path)


def test_file_created_read_only_and_closed_becomes_durable(make_mount, local_backend):
    # open(O_CREAT|O_RDONLY) creates an empty file whose close() never wrote:
    # it must still be committed and persisted like any other file.
    m = make_mount()
    path = m.path("created-rdonly")
    os.close(os.open(path, os.O_CREAT | os.O_RDONLY, 0o644))
    assert wait_state(path, "durable", timeout_s=30) == "durable"
    assert (local_backend / "created-rdonly").stat().st_size == 0
    assert m.stop() == 0, m.log()  # the drain has nothing left that is not durable


def test_paths_longer_than_a_backend_key_are_refused_at_create(make_mount, local_backend):
    # A key is at most PATH_MAX bytes (the file:// backend opens one name
    # at a time, so its own root does not count).  Directories of 255-byte
    # names fill a path to 20 bytes short of the longest key it takes: a
    # short name still fits, a 255-byte one cannot be stored and is refused
    # at once.  Descriptors walk down: the
    # kernel caps a path argument at PATH_MAX, and the daemon must refuse what
    # the kernel lets through.
    from aiturbofs.backend._local import LocalBackend

    key_bytes_max = LocalBackend(str(local_backend), 1.0).key_bytes_max
    names, used = [], 0
    while used + 1 + 255 <= key_bytes_max - 20:
        names.append(f"{len(names):02d}" + "d" * 253)
        used += (1 if used else 0) + 255
    names.append("e" * (key_bytes_max - 20 - used - 1))
    m = make_mount()
    fds = [os.open(m.mountpoint, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for name in names:
            os.mkdir(name, dir_fd=fds[-1])
            fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        deep = fds[-1]
        f = os.open("fits", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=deep)
        os.write(f, b"ok")
        os.close(f)
        long_name = "f" * 255
        attempts = {
            "create": lambda: os.close(os.open(long_name, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=deep)),
            "mkdir": lambda: os.mkdir(long_name, dir_fd=deep),
            "symlink": lambda: os.symlink("fits", long_name, dir_fd=deep),
            "link": lambda: os.link("fits", long_name, src_dir_fd=deep, dst_dir_fd=deep),
            "rename": lambda: os.rename("fits", long_name, src_dir_fd=deep, dst_dir_fd=deep),
        }
        for what, attempt in attempts.items():
            with pytest.raises(OSError) as e:
                attempt()
            assert e.value.errno == errno.ENAMETOOLONG, what
        state_of = os.getxattr(f"/proc/self/fd/{deep}/fits", "user.aiturbo.state").decode()
        deadline = time.monotonic() + 30
        while state_of != "durable" and time.monotonic() < deadline:
            time.sleep(0.1)
            state_of = os.getxattr(f"/proc/self/fd/{deep}/fits", "user.aiturbo.state").decode()
        assert state_of == "durable"
    finally:
        for fd in reversed(fds):
            os.close(fd)


def test_a_path_of_path_max_minus_one_bytes_reaches_the_file_backend_and_comes_back(make_mount, local_backend):
    """issue 23: a path of 4,095 bytes (PATH_MAX - 1) below the mount got ENAMETOOLONG, since the
    file:// backend named objects by their absolute path; a local filesystem takes it, and so
    does the backend now, one name at a time."""
    names = [f"{i:02d}" + "d" * 253 for i in range(15)] + ["f" * 255]
    assert len("/".join(names)) == 4095
    data = secrets.token_bytes(100_000)

    def walk(top: str, create: bool) -> list[int]:
        fds = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
        for name in names[:-1]:
            if create:
                os.mkdir(name, dir_fd=fds[-1])
            fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
        return fds

    def read_at(top: str) -> bytes:
        fds = walk(top, create=False)
        try:
            f = os.open(names[-1], os.O_RDONLY, dir_fd=fds[-1])
            try:
                return os.read(f, len(data) + 1)
            finally:
                os.close(f)
        finally:
            for fd in reversed(fds):
                os.close(fd)

    m = make_mount()
    fds = walk(m.mountpoint, create=True)
    try:
        f = os.open(names[-1], os.O_CREAT | os.O_WRONLY, 0o640, dir_fd=fds[-1])
        os.write(f, data)
        os.close(f)
    finally:
        for fd in reversed(fds):
            os.close(fd)
    r = aiturbo("wait", m.mountpoint, check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "broken" not in m.log()
    assert read_at(str(local_backend)) == data
    assert m.stop() == 0
    fresh = make_mount(name="fresh")  # a fresh state dir: the import walks the backend down to it
    assert read_at(fresh.mountpoint) == data


@pytest.mark.parametrize("create", ["rdonly", "written"])
def test_rename_over_a_hard_link_updates_its_other_links_ctime(create, mnt):
    # pjdfstest rename/23.t: replacing a name drops a link of the file it
    # named, a change of that inode (nlink): its ctime moves, as seen by
    # another of its links.
    a, b, c = mnt.path("a"), mnt.path("b"), mnt.path("c")
    if create == "rdonly":
        os.close(os.open(a, os.O_CREAT | os.O_RDONLY, 0o644))
    else:
        with open(a, "wb") as f:
            f.write(b"x")
    os.link(a, b)
    before = os.stat(b)
    assert before.st_nlink == 2
    time.sleep(0.05)
    with open(c, "wb") as f:
        f.write(b"new")
    os.rename(c, a)
    after = os.stat(b)
    assert after.st_nlink == 1
    assert after.st_ctime_ns > before.st_ctime_ns
