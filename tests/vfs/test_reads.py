"""Reads return the file's bytes, whatever the pool does meanwhile (issue: silent wrong reads)."""

import json
import os

from fileio import pread_direct
from mounting import aiturbo, wait_state

MiB = 1 << 20
CHUNK = 8 * MiB


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


def test_readers_of_two_files_evicting_each_other_never_see_other_bytes(make_mount):
    # Chunks read in are cached in each file's backing file; a pool of two
    # chunks holds at most two of the six, so every read evicts (hole-punches)
    # a range another reader was just served from.  Each read must still
    # return its own file's bytes, never zeros or the other file's.
    m = make_mount(dram="16M")
    files = {name: os.urandom(3 * CHUNK - 777) for name in ("a.bin", "b.bin")}
    for name, data in files.items():
        with open(m.path(name), "wb") as f:
            f.write(data)
        wait_state(m.path(name), "durable")
    aiturbo("drop-cache", m.mountpoint)
    step = 3 * MiB + 4096  # not aligned to chunks: reads straddle them
    for offset in range(0, 3 * CHUNK, step):
        for name, data in files.items():
            got = pread_direct(m.path(name), offset, step)
            assert got == data[offset : offset + step], f"{name}: wrong bytes at {offset}"
    st = json.loads(aiturbo("status", m.mountpoint, "--json").stdout)
    assert st["pool"]["used_bytes"] <= 16 * MiB
