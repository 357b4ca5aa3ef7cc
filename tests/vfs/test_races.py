"""Races across awaits inside the filesystem (issue: reads are never wrong).

Each test drives one ``Filesystem`` in-process (SQLite metadata, a file://
backend, a small pool) and holds one coroutine at an await with a gate, so
that another request runs exactly there: the interleavings the kernel's
concurrent requests produce now and then, made certain.
"""

from __future__ import annotations

import functools
import os
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from aiturbofs.backend import open_backend
from aiturbofs.meta import ROOT_INO, STATE_DURABLE, open_meta
from aiturbofs.staging import BackingArea, SpillStore, StagingPool
from aiturbofs.vfs import Filesystem, VfsOptions

MiB = 1 << 20
CHUNK = 8 * MiB
UID, GID = os.getuid(), os.getgid()

pytestmark = pytest.mark.fail_after(60)  # a lost wakeup fails the test instead of hanging the suite


@asynccontextmanager
async def filesystem(tmp_path, *, dram: int = 64 * MiB):
    meta = open_meta(f"sqlite:///{tmp_path}/meta.db")
    await meta.init(root_uid=UID, root_gid=GID, root_mode=0o40755)
    os.makedirs(tmp_path / "backend", exist_ok=True)
    backend = await open_backend(f"file://{tmp_path}/backend", {})
    pool = StagingPool(dram, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    fs = Filesystem(meta, backend, pool, VfsOptions(owner_uid=UID, owner_gid=GID), staging=BackingArea(str(tmp_path / "staging")))
    try:
        async with trio.open_nursery() as nursery:
            await fs.start(nursery)
            yield fs
            nursery.cancel_scope.cancel()
    finally:
        await meta.close()


class Gate:
    """Holds the next call of ``obj.name`` for inode ``ino`` after it ran, until ``open()``."""

    def __init__(self, obj, name: str, ino: int):
        self.entered, self.released = trio.Event(), trio.Event()
        real = getattr(obj, name)

        async def gated(i, *args, **kwargs):
            result = await real(i, *args, **kwargs)
            if i == ino and not self.entered.is_set():
                self.entered.set()
                await self.released.wait()
            return result

        setattr(obj, name, gated)

    def open(self) -> None:
        self.released.set()


async def durable_file(fs: Filesystem, name: bytes, data: bytes) -> int:
    handle, row = await fs.create(ROOT_INO, name, 0o644, os.O_WRONLY, UID, GID)
    await fs.write(handle.fh, 0, data)
    await fs.flush(handle.fh)
    await fs.release(handle.fh)
    await fs.wait_durable(row.ino)
    return row.ino


async def test_a_stale_row_read_during_a_commit_is_not_taken(tmp_path):
    """D11: open re-read the row (close-to-open) while a writer committed; the older row
    (its previous version, durable) replaced the committed one, so
    ``sync_close`` could return before the new version was durable."""

    async with filesystem(tmp_path) as fs:
        ino = await durable_file(fs, b"f", b"one")
        gate = Gate(fs.meta, "get_inode", ino)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.open, ino, os.O_RDONLY)  # another process's open
            await gate.entered.wait()  # it has read version 1 ...
            handle, _ = await fs.open(ino, os.O_WRONLY)
            await fs.write(handle.fh, 0, b"two")
            await fs.flush(handle.fh)  # ... and version 2 is committed meanwhile
            committed = fs.inodes.get(ino).row.version
            gate.open()
        row = fs.inodes.get(ino).row
        assert row.version == committed and row.state != STATE_DURABLE
        await fs.release(handle.fh)
        await fs.wait_durable(ino)
        assert (await fs.meta.get_inode(ino)).persisted_version == committed


async def test_open_does_not_drop_the_bytes_of_a_writer_that_opened_meanwhile(tmp_path):
    """D11: in a cluster, open compared the cached content with the row it
    re-read and dropped the content if they differed, but checked that nobody
    had the file open *before* that await: a writer opening meanwhile lost
    the bytes it had written."""

    async with filesystem(tmp_path) as fs:
        ino = await durable_file(fs, b"f", b"one")
        alone = fs.cluster
        fs.cluster = SimpleNamespace(owner="a", shared=True)  # open's cluster check (nothing else runs meanwhile)
        gate = Gate(fs.meta, "get_inode", ino)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.open, ino, os.O_RDONLY)
            await gate.entered.wait()
            writer, _ = await fs.open(ino, os.O_WRONLY)
            await fs.write(writer.fh, 0, b"longer bytes")
            gate.open()
        fs.cluster = alone
        assert fs.inodes.get(ino).content is writer.inode.content
        got = await fs.read(writer.fh, 0, 100)
        assert bytes(got) == b"longer bytes"


async def test_a_truncate_while_a_write_waits_for_memory(tmp_path):
    """D11: a write waiting for pool memory re-read ``slots[index]`` after the
    wait, but a truncate meanwhile had cut the slot list: IndexError (EIO) and
    the chunk buffer it had been given was never returned."""

    async with filesystem(tmp_path, dram=2 * CHUNK) as fs:
        hog, row = await fs.create(ROOT_INO, b"hog", 0o644, os.O_WRONLY, UID, GID)
        for index in range(2):  # two open chunk buffers fill the pool
            await fs.write(hog.fh, index * CHUNK, b"x" * (CHUNK // 2))
        f, frow = await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY, UID, GID)
        await fs.setattr(frow.ino, fh=f.fh, size=4 * CHUNK)
        async with trio.open_nursery() as nursery:
            result = {}
            async def write():
                result["n"] = await fs.write(f.fh, 3 * CHUNK, b"tail")
            nursery.start_soon(write)
            while not fs.pool.stats().waiting_writers:
                await trio.sleep(0.01)
            await fs.setattr(frow.ino, fh=f.fh, size=0)  # while the write waits
            await fs.flush(hog.fh)  # the hog commits: its chunks go durable, memory frees
            await fs.release(hog.fh)
        assert result["n"] == 4
        assert (await fs.getattr(frow.ino)).size == 3 * CHUNK + 4
        assert bytes(await fs.read(f.fh, 3 * CHUNK - 2, 10)) == b"\0\0tail"
        await fs.flush(f.fh)
        await fs.release(f.fh)
        await fs.wait_durable(frow.ino)
        await fs.wait_durable(row.ino)
        fs.pool.drop_clean()
        stats = fs.pool.stats()
        assert stats.open_bytes == 0, stats  # no buffer left behind


async def test_a_version_the_kernel_wrote_over_is_replaced_not_broken_while_its_release_commits(tmp_path):
    """A passthrough writer's close (flush) commits version 1; its mapping writes chunk 0 again, so
    version 1's only copy of that chunk is gone (the kernel wrote over it in place).  Its persist
    fails, and the persister let the file's next commit replace it while the kernel is writing; but
    the last writer's release counts the writer gone before it commits version 2.  A persist that
    failed in that gap marked the file broken (the torture suite's kill -9 case, now and then)."""

    async with filesystem(tmp_path) as fs:
        handle, row = await fs.create(ROOT_INO, b"f", 0o644, os.O_RDWR, UID, GID)
        fd = await fs.open_kernel(handle)
        assert fd is not None
        first, second = os.urandom(CHUNK + 100), os.urandom(CHUNK)
        os.pwrite(fd, first, 0)  # the kernel writes the backing file
        held = []
        real_enqueue = fs.persister.enqueue
        fs.persister.enqueue = lambda ino, **kw: held.append((ino, kw))  # version 1 waits for us
        await fs.flush(handle.fh)  # close(): version 1 staged
        assert (await fs.meta.get_inode(row.ino)).version == 1
        os.pwrite(fd, second, 0)  # a store through the mapping that outlives the close
        await fs.close_kernel(handle)  # the release: the last writer is gone, version 2 not committed yet
        fs.persister.enqueue = real_enqueue
        for ino, kw in held:
            fs.persister.enqueue(ino, **kw)
        await fs.persister.drain(10)  # its persist of version 1 has failed by now
        assert fs.persister.stats.files_broken == 0 and (await fs.meta.get_inode(row.ino)).state != "broken"
        await fs.release(handle.fh)  # version 2
        await fs.wait_durable(row.ino)
        assert bytes(await fs.read((await fs.open(row.ino, os.O_RDONLY))[0].fh, 0, 2 * CHUNK)) == second + first[CHUNK:]


async def test_an_open_the_kernel_serves_that_comes_while_a_truncate_waits_does_not_undo_it(tmp_path):
    """A truncate decided whether to cut the backing file before it waited (for the lock of the chunk
    it shortens); a passthrough open that came meanwhile fitted the backing file to the old size, the
    cut never came, and the opener's flush took the old bytes past the cut back in as the file's:
    the truncate was undone, and chunk 1 named the old version's key again."""
    async with filesystem(tmp_path) as fs:
        handle, row = await fs.create(ROOT_INO, b"f", 0o644, os.O_RDWR, UID, GID)
        fd = await fs.open_kernel(handle)
        assert fd is not None
        data = os.urandom(CHUNK + 4096)
        os.pwrite(fd, data, 0)
        await fs.close_kernel(handle)
        await fs.release(handle.fh)  # version 1: two chunks, sealed
        node = await fs.inodes.load(row.ino)
        content = node.content
        assert content is not None and content.size == len(data)
        async with trio.open_nursery() as nursery:
            await content.lock.acquire()  # the truncate will wait for it (it reopens chunk 0)
            nursery.start_soon(functools.partial(fs.setattr, row.ino, size=100))
            await trio.testing.wait_all_tasks_blocked()
            opener, _ = await fs.open(row.ino, os.O_RDWR)
            assert await fs.open_kernel(opener) is not None  # the kernel serves this open now
            content.lock.release()
        assert (await fs.getattr(row.ino)).size == 100
        await fs.flush(opener.fh)  # the opener's close: what the kernel holds is taken in
        await fs.close_kernel(opener)
        await fs.release(opener.fh)
        assert (await fs.getattr(row.ino)).size == 100
        reader, _ = await fs.open(row.ino, os.O_RDONLY)
        assert bytes(await fs.read(reader.fh, 0, 2 * CHUNK)) == data[:100]
        await fs.release(reader.fh)
        await fs.wait_durable(row.ino)
        assert (tmp_path / "backend" / "f").read_bytes() == data[:100]


@pytest.mark.parametrize("kernel", [False, True], ids=["requests", "passthrough"])
async def test_a_release_while_another_writer_has_the_file_open_commits_none_of_its_writes(tmp_path, monkeypatch,
                                                                                          kernel):
    """close() returns at its FLUSH; the kernel sends the RELEASE later, and the same process's next
    open and writes may come first (through passthrough: while the release hashes the file).  The
    release committed the file as it was then, with the next writer's first write in it, and a kill -9
    brought that back: bytes no close or fsync of the application had made (the torture suite's kill -9
    case, seed 432396).  A release while another writer has the file open leaves the commit to that
    writer's close."""
    from aiturbofs.vfs import _kernel_io

    async def write(handle, fd, at: int, data: bytes) -> None:
        if fd is None:
            await fs.write(handle.fh, at, data)
        else:
            os.pwrite(fd, data, at)

    async def open_writer(ino: int):
        handle, _ = await fs.open(ino, os.O_RDWR)  # (through passthrough its release checks every chunk)
        fd = await fs.open_kernel(handle) if kernel else None
        assert (fd is not None) == kernel
        return handle, fd

    hashing, go = trio.Event(), trio.Event()
    real = _kernel_io.content_key_of
    token = None

    def gated(path, offset, length):  # the first release's check of the chunk, in its thread
        trio.from_thread.run_sync(hashing.set, trio_token=token)
        trio.from_thread.run(go.wait, trio_token=token)
        return real(path, offset, length)

    data = os.urandom(2 * MiB)
    async with filesystem(tmp_path) as fs:
        token = trio.lowlevel.current_trio_token()
        ino = await durable_file(fs, b"f", data)
        first, fd1 = await open_writer(ino)
        await write(first, fd1, 0, b"one")
        await fs.flush(first.fh)  # close() returns: version 2
        committed = (await fs.meta.get_inode(ino)).version
        async with trio.open_nursery() as nursery:
            if kernel:
                monkeypatch.setattr(_kernel_io, "content_key_of", gated)

                async def release_first():
                    await fs.close_kernel(first)
                    await fs.release(first.fh)

                nursery.start_soon(release_first)
                await hashing.wait()  # the release checks the chunk the next writer writes now
            second, fd2 = await open_writer(ino)
            await write(second, fd2, 0, b"two")  # the next operation's first write
            if kernel:
                monkeypatch.setattr(_kernel_io, "content_key_of", real)
                go.set()
            else:
                await fs.release(first.fh)
        assert (await fs.meta.get_inode(ino)).version == committed  # nothing the application committed
        await write(second, fd2, len(data), b"tail")
        await fs.flush(second.fh)
        if kernel:
            await fs.close_kernel(second)
        await fs.release(second.fh)
        row = await fs.meta.get_inode(ino)
        assert row.version == committed + 1 and row.size == len(data) + 4
        reader, _ = await fs.open(ino, os.O_RDONLY)
        assert bytes(await fs.read(reader.fh, 0, 3 * MiB)) == b"two" + data[3:] + b"tail"
        await fs.release(reader.fh)


async def test_a_chunk_another_file_seals_while_a_passthrough_writer_opens_keeps_a_copy(tmp_path):
    """A writable passthrough open of ``a`` moves the chunks other versions still need out of a's backing
    file first (``take_range``), then lets the kernel write there.  While that move waited (for memory,
    or a spill), ``b`` sealed a chunk a's backing file already held where the move had passed: b's range
    was let go and a's became b's only copy, which the kernel then wrote over.  b's reads of its own
    chunk, not yet durable, failed their BLAKE3 check against b's backend object (EIO; the torture
    suite's kill -9 case, seed 857093, whose four workers share template chunks)."""
    shared, tail, rewritten = os.urandom(CHUNK), os.urandom(4096), os.urandom(4096)
    async with filesystem(tmp_path) as fs:
        a = await durable_file(fs, b"a", shared + tail)  # version 1 durable: its chunk 0 pins nothing
        held = []
        fs.persister.enqueue = lambda ino, **kw: held.append(ino)  # nothing below becomes durable
        writer, _ = await fs.open(a, os.O_WRONLY)
        await fs.write(writer.fh, CHUNK, rewritten)  # version 2: chunk 1 pinned (not durable), chunk 0 not
        await fs.flush(writer.fh)
        await fs.release(writer.fh)
        moving, go = trio.Event(), trio.Event()
        real_take_range = fs.pool.take_range

        async def take_range(rng):  # the move of a's chunk 1 waits (only that one)
            if not moving.is_set():
                moving.set()
                await go.wait()
            return await real_take_range(rng)

        fs.pool.take_range = take_range
        opener, _ = await fs.open(a, os.O_RDWR)
        async with trio.open_nursery() as nursery:
            result = {}

            async def open_kernel():
                result["fd"] = await fs.open_kernel(opener)

            nursery.start_soon(open_kernel)
            await moving.wait()
            b_handle, _ = await fs.create(ROOT_INO, b"b", 0o644, os.O_RDWR, UID, GID)
            await fs.write(b_handle.fh, 0, shared)
            await fs.flush(b_handle.fh)  # b's version seals the chunk a's backing file holds
            go.set()
        fs.pool.take_range = real_take_range
        fd = result["fd"]
        assert fd is not None
        os.pwrite(fd, os.urandom(CHUNK), 0)  # the kernel writes a's chunk 0 in place
        assert bytes(await fs.read(b_handle.fh, 0, CHUNK)) == shared
        await fs.close_kernel(opener)
        await fs.release(opener.fh)
        await fs.release(b_handle.fh)
