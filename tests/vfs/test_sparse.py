"""Sparse files cost what their data costs (issue 12).

A hole — a range never written, one a truncate or a write past EOF skipped,
or a chunk written as all zeros — takes no pool buffer and no spill byte,
stays a hole in a file:// backend (the object is as sparse as the file) and
is not sent to S3 chunk by chunk (one zero chunk is uploaded once, the rest
are server-side copies of it).  Reads of it return zeros: from the writing
mount, and from a fresh mount that imports the object from the backend.

The file:// tests put the backend on a small tmpfs of their own: a 4 GiB
hole stored dense must fail the test (ENOSPC), not fill the shared disk.
"""

import ctypes
import errno
import os
import random
import secrets
import subprocess
import time

import pytest
from fileio import pread_direct
from mounting import aiturbo, status, wait_state
from scrape import scrape, value

from aiturbofs._limits import CHUNK_BYTES, GiB, MiB

HOLE = 4 * GiB
DATA = MiB
BACKEND_FS_BYTES = 96 * MiB  # far below the hole: a dense copy cannot fit
DURABLE_WAIT_S = 120.0


@pytest.fixture
def small_backend(tmp_path):
    """A tmpfs of BACKEND_FS_BYTES as the file:// backend root; unmounted after the mounts."""
    root = tmp_path / "sparse-backend"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={BACKEND_FS_BYTES}", "tmpfs", str(root)], check=True)
    try:
        yield root
    finally:
        if subprocess.run(["umount", str(root)], check=False).returncode:
            subprocess.run(["umount", "-l", str(root)], check=False)


def allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def pool_figures(m) -> dict[str, float]:
    s = scrape(status(m)["metrics"])
    return {state: value(s, "aiturbo_pool_bytes", state=state) for state in ("dirty", "open", "spilled")}


def check_reads(path: str, data: bytes) -> None:
    """O_DIRECT samples (the daemon answers, not the page cache): in the hole, at its edge, in the data."""
    for offset in (0, CHUNK_BYTES - 4096, HOLE // 2 + 3 * 4096, HOLE - 2 * CHUNK_BYTES):
        assert pread_direct(path, offset, 64 * 1024) == bytes(64 * 1024), f"hole at {offset} is not zeros"
    edge = HOLE - 64 * 1024
    assert pread_direct(path, edge, 128 * 1024) == bytes(64 * 1024) + data[: 64 * 1024]
    assert pread_direct(path, HOLE, len(data)) == data
    assert os.stat(path).st_size == HOLE + len(data)


@pytest.mark.parametrize("how", ["seek", "truncate"])
def test_a_4gib_hole_costs_nothing_on_file_backend_and_reads_back_as_zeros(small_backend, make_mount, tmp_path, how):
    url = f"file://{small_backend}"
    m = make_mount(url, dram="32M", spill=str(tmp_path / "spill"), metrics="127.0.0.1:0", persist_retry_window="10")
    data = os.urandom(DATA)
    path = m.path("sparse.bin")
    with open(path, "wb") as f:
        if how == "truncate":
            f.truncate(HOLE)
        f.seek(HOLE)
        f.write(data)
        f.flush()
        # open, written, not yet closed: only the data's chunk holds memory
        figures = pool_figures(m)
        assert figures["dirty"] + figures["open"] <= CHUNK_BYTES, figures
    assert wait_state(path, "durable", DURABLE_WAIT_S) == "durable", m.log()[-3000:]
    assert pool_figures(m)["spilled"] <= CHUNK_BYTES
    obj = small_backend / "sparse.bin"
    assert obj.stat().st_size == HOLE + DATA
    assert allocated(obj) <= DATA + 64 * 1024, f"the backend object holds {allocated(obj)} bytes"
    # a hard link is a second object, copied in the backend: sparse too
    os.link(path, m.path("link.bin"))
    link = small_backend / "link.bin"
    deadline = time.monotonic() + DURABLE_WAIT_S
    while not (link.exists() and link.stat().st_size == HOLE + DATA) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert link.stat().st_size == HOLE + DATA
    assert allocated(link) <= DATA + 64 * 1024, f"the link's object holds {allocated(link)} bytes"
    aiturbo("drop-cache", m.mountpoint)
    check_reads(path, data)

    m.stop()
    again = make_mount(url, name="m2")  # fresh metadata: the file is imported from the backend
    check_reads(again.path("sparse.bin"), data)


def test_chunks_written_as_zeros_become_holes(small_backend, make_mount):
    # dd if=/dev/zero: written zeros are data to the writer, but they cost
    # no DRAM once sealed and no backend blocks once persisted
    m = make_mount(f"file://{small_backend}", dram="32M", metrics="127.0.0.1:0")
    path = m.path("zeros.bin")
    tail = os.urandom(4096)
    with open(path, "wb") as f:
        for _ in range(4 * CHUNK_BYTES // MiB):
            f.write(bytes(MiB))
        f.write(tail)
    assert wait_state(path, "durable", DURABLE_WAIT_S) == "durable", m.log()[-3000:]
    obj = small_backend / "zeros.bin"
    assert obj.stat().st_size == 4 * CHUNK_BYTES + len(tail)
    assert allocated(obj) <= 64 * 1024, f"the backend object holds {allocated(obj)} bytes"
    aiturbo("drop-cache", m.mountpoint)
    assert pread_direct(path, CHUNK_BYTES + 8192, 8192) == bytes(8192)
    assert pread_direct(path, 4 * CHUNK_BYTES, 4096) == tail


def test_s3_uploads_one_zero_chunk_and_copies_the_other_holes(s3_server, make_mount):
    hole = 256 * MiB
    bucket = s3_server.make_bucket(f"sparse-{secrets.token_hex(6)}")
    m = make_mount(f"s3://{bucket}/pre", s3_endpoint=s3_server.endpoint, dram="32M", metrics="127.0.0.1:0")
    data = os.urandom(DATA)
    names = ["a.bin", "b.bin"]  # the second file's holes reuse the zero chunk the first one uploaded
    for name in names:
        with open(m.path(name), "wb") as f:
            f.truncate(hole)
            f.seek(hole)
            f.write(data)
    for name in names:
        assert wait_state(m.path(name), "durable", DURABLE_WAIT_S) == "durable", m.log()[-3000:]
    s = scrape(status(m)["metrics"])
    uploaded = value(s, "aiturbo_backend_bytes_total", direction="uploaded")
    copied = value(s, "aiturbo_backend_bytes_total", direction="copied")
    assert uploaded <= len(names) * DATA + CHUNK_BYTES, uploaded
    assert copied >= len(names) * hole - CHUNK_BYTES, copied
    client = s3_server.client()
    for name in names:
        head = client.head_object(Bucket=bucket, Key=f"pre/{name}")
        assert head["ContentLength"] == hole + DATA
        got = client.get_object(Bucket=bucket, Key=f"pre/{name}", Range=f"bytes={hole - 4096}-{hole + 4095}")
        assert got["Body"].read() == bytes(4096) + data[:4096]
    listed = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="pre/", Delimiter="/")["Contents"]]
    aiturbo("drop-cache", m.mountpoint)
    assert sorted(os.listdir(m.mountpoint)) == names, listed  # the zero chunk's object is hidden
    assert pread_direct(m.path("a.bin"), hole // 2, 64 * 1024) == bytes(64 * 1024)
    assert pread_direct(m.path("b.bin"), hole, DATA) == data
    for name in names:
        os.unlink(m.path(name))  # moto keeps objects until the session ends: leave it nothing large


def test_copies_sized_by_st_blksize_grow_files_by_holes_only(small_backend, make_mount):
    # fsstress's copy_file_range op: blksize-aligned lengths, a destination
    # anywhere up to 1024 blocks past EOF.  With st_blksize = 1 MiB that
    # grows a file by up to 1 GiB per op: fine while the growth is a hole.
    m = make_mount(f"file://{small_backend}", dram="32M")
    path = m.path("stress.bin")
    seed = os.urandom(DATA)
    with open(path, "wb") as f:
        f.write(seed)
    blksize = os.stat(path).st_blksize
    assert blksize == MiB
    rng = random.Random(12)
    copies = []
    fd = os.open(path, os.O_RDWR)
    try:
        for _ in range(8):
            size = os.fstat(fd).st_size
            dst = rng.randrange(size, size + 1024 * blksize) // blksize * blksize
            assert os.copy_file_range(fd, fd, blksize, 0, dst) == blksize
            copies.append(dst)
    finally:
        os.close(fd)
    size = os.stat(path).st_size
    assert size == max(copies) + blksize
    assert wait_state(path, "durable", DURABLE_WAIT_S) == "durable", m.log()[-3000:]
    obj = small_backend / "stress.bin"
    assert obj.stat().st_size == size
    assert allocated(obj) <= (1 + len(copies)) * DATA + 256 * 1024, (size, allocated(obj))
    aiturbo("drop-cache", m.mountpoint)
    for dst in copies:
        assert pread_direct(path, dst, DATA) == seed
    assert pread_direct(path, copies[0] - 65536, 65536) in (bytes(65536), seed[-65536:])


# ------------------------------------------------------------- fallocate(2) and lseek(2) SEEK_DATA / SEEK_HOLE

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_COLLAPSE_RANGE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x08, 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    """fallocate(2) itself (glibc's posix_fallocate writes zeros where it is refused): 0 or the errno."""
    return 0 if _libc.fallocate(fd, mode, offset, length) == 0 else ctypes.get_errno()


def seek_error(fd: int, offset: int, whence: int) -> int:
    with pytest.raises(OSError) as caught:
        os.lseek(fd, offset, whence)
    return caught.value.errno


@pytest.mark.parametrize("served", ["default", "requests"])
def test_fallocate_punches_zeroes_and_grows_and_seek_finds_the_holes(make_mount, local_backend, datapath, served):
    """issue 23: fallocate answered EOPNOTSUPP and SEEK_DATA/SEEK_HOLE saw no hole, so cp --sparse,
    tar -S and backup tools could not see the holes the backend keeps.  ``requests``: the kernel
    session without passthrough (the daemon's slots, not a backing file the kernel writes)."""
    if served == "requests" and datapath == "pyfuse3":
        pytest.skip("the kernel session served through requests: one run, not one per data path")
    m = make_mount(**({"datapath": "kernel"} if served == "requests" else {}))
    path = m.path("f.bin")
    data = bytearray(secrets.token_bytes(3 * CHUNK_BYTES + 12345))
    with open(path, "wb") as f:
        f.write(data)
    fd = os.open(path, os.O_RDWR)
    try:
        if datapath == "pyfuse3" and served == "default":
            # pyfuse3 registers no fallocate or lseek handler: libfuse answers ENOSYS, the kernel
            # EOPNOTSUPP, and its generic lseek takes the whole file for data (docs/design.md).
            assert fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) == errno.EOPNOTSUPP
            assert os.lseek(fd, CHUNK_BYTES, os.SEEK_DATA) == CHUNK_BYTES
            return
        punch = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        size = len(data)
        for mode, offset, length in [
            (punch, CHUNK_BYTES, CHUNK_BYTES),  # chunk 1: a hole
            (punch, 1000, 4000),  # inside chunk 0: zeros
            (FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, 2 * CHUNK_BYTES + 10, 20),
            (punch, size - 100, 1000),  # past the end: the size stays
        ]:
            assert fallocate(fd, mode, offset, length) == 0, (mode, offset)
            data[offset: offset + length] = bytes(len(data[offset: offset + length]))
        assert os.fstat(fd).st_size == size
        assert os.lseek(fd, 0, os.SEEK_DATA) == 0
        assert os.lseek(fd, 0, os.SEEK_HOLE) == CHUNK_BYTES
        assert os.lseek(fd, CHUNK_BYTES + 5, os.SEEK_HOLE) == CHUNK_BYTES + 5
        assert os.lseek(fd, CHUNK_BYTES + 5, os.SEEK_DATA) == 2 * CHUNK_BYTES
        assert os.lseek(fd, 2 * CHUNK_BYTES, os.SEEK_HOLE) == size  # the hole at the end of every file
        assert seek_error(fd, size, os.SEEK_DATA) == errno.ENXIO
        assert seek_error(fd, size, os.SEEK_HOLE) == errno.ENXIO
        assert fallocate(fd, FALLOC_FL_COLLAPSE_RANGE, 0, CHUNK_BYTES) == errno.EOPNOTSUPP
        assert fallocate(fd, FALLOC_FL_KEEP_SIZE, size, CHUNK_BYTES) == 0
        assert os.fstat(fd).st_size == size
        assert fallocate(fd, 0, size - 10, 5000) == 0  # grows the file, like a truncate
        data += bytes(5000 - 10)
        assert os.fstat(fd).st_size == len(data)
        assert os.pread(fd, len(data) + 1, 0) == data
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == data
    r = aiturbo("wait", m.mountpoint, check=False, timeout=DURABLE_WAIT_S)
    assert r.returncode == 0, r.stderr
    assert (local_backend / "f.bin").read_bytes() == data
    fd = os.open(path, os.O_RDONLY)
    try:  # committed: chunk 1 is a hole of the manifest
        assert os.lseek(fd, CHUNK_BYTES, os.SEEK_DATA) == 2 * CHUNK_BYTES
    finally:
        os.close(fd)
