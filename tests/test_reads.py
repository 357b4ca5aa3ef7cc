"""Reads return the file's bytes, whatever the pool does meanwhile (issue: silent wrong reads)."""

import mmap
import os

from mounting import aiturbo, wait_state

MiB = 1 << 20
CHUNK = 8 * MiB


def pread_direct(path: str, offset: int, size: int) -> bytes:
    """One O_DIRECT read: the kernel sends it to the daemon as one request, page cache bypassed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with mmap.mmap(-1, size) as aligned:  # O_DIRECT wants a page-aligned buffer
            n = os.preadv(fd, [aligned], offset)
            return aligned[:n]
    finally:
        os.close(fd)


def test_read_straddling_chunks_under_a_full_pool_returns_the_files_bytes(make_mount):
    # A pool of two chunk buffers, one held by an open writer: reading across the
    # chunk 0/1 boundary must fetch chunk 1 into the buffer chunk 0 was read into.
    # The first span's bytes must have been taken before that.
    m = make_mount(dram="16M")
    data = os.urandom(3 * CHUNK)
    path = m.path("ckpt.bin")
    with open(path, "wb") as f:
        f.write(data)
    wait_state(path, "durable")
    aiturbo("drop-cache", m.mountpoint)
    with open(m.path("open-writer.bin"), "wb") as w:
        w.write(b"x" * MiB)
        w.flush()
        for offset in (CHUNK - 4096, 2 * CHUNK - 65536):
            got = pread_direct(path, offset, 2 * 65536)
            assert got == data[offset : offset + 2 * 65536], f"wrong bytes at {offset}"
