"""The staging pool and spill store, without FUSE."""

import os
import random
import threading
import time

import pytest
import trio

from aiturbofs import chunk
from aiturbofs._errors import IntegrityError
from aiturbofs._limits import CHUNK_BYTES
from aiturbofs.staging import SPILL_FILES_DIR, BackingArea, Pins, SpillStore, StagingPool, content_key_of, room_in
from aiturbofs.staging import _budget as staging_budget
from aiturbofs.staging._backing import SPARES_DIR, SpareFiles, punch_hole


def _chunk(fill: int) -> tuple[bytes, bytearray]:
    data = bytearray([fill]) * CHUNK_BYTES
    return chunk.digest(data), data


async def _sealed(pool: StagingPool, fill: int) -> bytes:
    buf = await pool.alloc(CHUNK_BYTES)
    buf[:] = bytes([fill]) * CHUNK_BYTES
    key = chunk.digest(buf)
    pool.adopt(key, buf, CHUNK_BYTES)
    return key


async def test_dedup_shares_one_buffer(tmp_path):
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    k1 = await _sealed(pool, 7)
    k2 = await _sealed(pool, 7)
    assert k1 == k2
    st = pool.stats()
    assert st.dirty_bytes == CHUNK_BYTES and st.pinned_chunks == 1
    pool.unpin(k1)
    assert pool.pinned(k1)  # one reference left
    pool.unpin(k1)
    assert pool.stats().clean_bytes == CHUNK_BYTES


async def test_clean_chunks_are_evicted_for_writers(tmp_path):
    pool = StagingPool(2 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    a = await _sealed(pool, 1)
    b = await _sealed(pool, 2)
    pool.unpin(a)
    pool.unpin(b)
    with trio.fail_after(1):
        await pool.alloc(CHUNK_BYTES)  # must not wait: clean data is evictable
    assert pool.used_bytes <= pool.budget_bytes


@pytest.mark.parametrize("eager_spill", [False, True])
async def test_free_fraction_counts_the_evictable_charges_through_random_pool_operations(tmp_path, eager_spill):
    # free_fraction keeps the evictable entries' charges as a running sum (it is asked at every open):
    # after every operation it must equal the sum over the entries then evictable.  With eager spill,
    # pinned chunks become evictable once spilled.
    rnd = random.Random(25)
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=eager_spill)
    budget = pool._budget
    pins: list[bytes] = []
    checked = 0
    for _ in range(400):
        op = rnd.choice(["seal", "seal", "unpin", "unpin", "read", "drop", "alloc"])
        if op == "seal":
            n = rnd.choice([100, 5000, CHUNK_BYTES])
            with trio.move_on_after(0.5):
                buf = await pool.alloc(n)
                buf[:n] = bytes([rnd.randrange(6)]) * n
                key = chunk.digest(buf[:n])
                pool.adopt(key, buf, n)
                pins.append(key)
        elif op == "unpin" and pins:
            pool.unpin(pins.pop(rnd.randrange(len(pins))))
        elif op == "read" and pins:
            await pool.read(rnd.choice(pins), fetch=None)
        elif op == "drop":
            pool.drop_clean()
        elif op == "alloc":
            with trio.move_on_after(0.1):
                pool.release(await pool.alloc(CHUNK_BYTES))
        clean = sum(e.charge for e in budget._evictable.values())
        assert pool.free_fraction() == max(0.0, pool.budget_bytes - pool.used_bytes + clean) / pool.budget_bytes
        checked += clean > 0
    assert checked > 50, checked  # the sum was non-zero often enough to mean something


async def test_pinned_chunks_spill_instead_of_being_dropped(tmp_path):
    spill = SpillStore(str(tmp_path / "spill"))
    pool = StagingPool(2 * CHUNK_BYTES, spill, eager_spill=True)
    a = await _sealed(pool, 1)
    b = await _sealed(pool, 2)
    with trio.fail_after(5):
        buf = await pool.alloc(CHUNK_BYTES)
    assert a in spill or b in spill
    assert pool.pinned(a) and pool.pinned(b)
    pool.release(buf)
    for key, fill in ((a, 1), (b, 2)):
        view = await pool.read(key, fetch=None)
        assert bytes(view[:10]) == bytes([fill]) * 10


async def test_writer_waits_for_persist_without_spill_option(tmp_path):
    pool = StagingPool(2 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    a = await _sealed(pool, 1)
    await _sealed(pool, 2)
    got = []
    async def writer():
        got.append(await pool.alloc(CHUNK_BYTES))
    async with trio.open_nursery() as n:
        n.start_soon(writer)
        await trio.sleep(0.5)
        assert not got, "the writer must wait while every byte is dirty"
        pool.unpin(a)  # "persisted": a becomes clean and evictable
        pool._budget.notify_freed()
    assert got and len(got[0]) == CHUNK_BYTES


async def test_a_writer_that_waited_in_vain_for_persist_spills_at_once_until_persist_frees(tmp_path, monkeypatch):
    # One file bigger than the budget, still open: its chunks stay pinned until it is closed and persisted, so
    # waiting for persist cannot free anything.  Each writer waited SPILL_WAIT_S before spilling one chunk:
    # 8 MiB per 2 s (pyfuse3 wrote such a file at 3.9 MiB/s).  After one wait in vain, spills come at once.
    wait_s = 1.0
    monkeypatch.setattr(staging_budget, "SPILL_WAIT_S", wait_s)
    pool = StagingPool(2 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    keys = [await _sealed(pool, 1), await _sealed(pool, 2)]
    start = trio.current_time()
    for fill in range(3, 9):
        keys.append(await _sealed(pool, fill))
    assert trio.current_time() - start < 3.5 * wait_s  # one wait (and six spills), not one per chunk
    assert all(pool.pinned(k) for k in keys) and pool.used_bytes <= pool.budget_bytes
    for fill, key in enumerate(keys, start=1):
        assert bytes((await pool.read(key, fetch=None))[:10]) == bytes([fill]) * 10
    # persist frees memory again (a chunk became durable): the next writer waits for persist before it spills
    for key in keys:
        pool.unpin(key)
    await _sealed(pool, 9)
    await _sealed(pool, 10)
    start = trio.current_time()
    await _sealed(pool, 11)
    assert trio.current_time() - start >= wait_s, "a writer must wait for persist before it spills"


async def test_durable_chunk_leaves_the_spill_dir(tmp_path):
    spill = SpillStore(str(tmp_path / "spill"))
    pool = StagingPool(4 * CHUNK_BYTES, spill, eager_spill=True)
    async with trio.open_nursery() as n:
        n.start_soon(pool.run_spiller)
        a = await _sealed(pool, 3)
        with trio.fail_after(5):
            while a not in spill:
                await trio.sleep(0.01)
        pool.unpin(a)
        assert a not in spill and not os.listdir(spill.directory)
        n.cancel_scope.cancel()


async def _concurrent_misses(pool: StagingPool, readers: int) -> tuple[bytes, int, list[bytes]]:
    """``readers`` reads of one missing chunk at once: (its key, fetches made, what each reader got)."""
    key, data = _chunk(9)
    calls = []

    async def fetch():
        calls.append(1)
        await trio.sleep(0.05)
        return bytes(data)

    results = []

    async def reader():
        results.append(bytes((await pool.read(key, fetch))[:4]))

    async with trio.open_nursery() as n:
        for _ in range(readers):
            n.start_soon(reader)
    return key, len(calls), results


async def test_concurrent_misses_fetch_once(tmp_path):
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    _key, calls, results = await _concurrent_misses(pool, 5)
    assert calls == 1 and results == [bytes([9]) * 4] * 5


async def test_corrupt_spill_file_is_detected(tmp_path):
    spill = SpillStore(str(tmp_path / "spill"))
    key, data = _chunk(5)
    await spill.write(key, data)
    path = os.path.join(spill.directory, key.hex())
    with open(path, "r+b") as f:
        f.seek(12345)
        f.write(b"\x00")
    with pytest.raises(IntegrityError):
        await spill.read(key)
    assert key not in spill and not os.path.exists(path)


async def test_spill_store_survives_restart_and_drops_torn_writes(tmp_path):
    d = str(tmp_path / "spill")
    spill = SpillStore(d)
    key, data = _chunk(4)
    await spill.write(key, data)
    with open(os.path.join(d, "ab" * 32 + ".tmp"), "wb") as f:
        f.write(b"torn")
    again = SpillStore(d)
    assert key in again and len(again.keys()) == 1
    assert await again.read(key) == bytes(data)


async def test_recovered_chunk_adopted_again_has_the_writers_length(tmp_path):
    # After a restart a spilled chunk is known by key only (length unknown);
    # a writer sealing the same bytes again (frozen layers, zero chunks) must
    # give the entry its real length, or view() and the upload part are short.
    spill = SpillStore(str(tmp_path / "spill"))
    key, data = _chunk(5)
    await spill.write(key, memoryview(data))
    pool = StagingPool(4 * CHUNK_BYTES, spill, eager_spill=False)
    assert pool.recover_spilled(key)
    buf = await pool.alloc(CHUNK_BYTES)
    buf[:] = data
    pool.adopt(key, buf, CHUNK_BYTES)
    view = pool.view(key)
    assert view is not None and len(view) == CHUNK_BYTES and view == data


async def _full_pool(tmp_path) -> StagingPool:
    """A pool whose whole budget is pinned chunks: nothing fetched can be cached."""
    pool = StagingPool(2 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    await _sealed(pool, 1)
    await _sealed(pool, 2)
    return pool


async def test_eight_misses_under_a_full_pool_make_one_fetch(tmp_path):
    # The fetched chunk cannot be cached (the pool is full of dirty data):
    # the waiters used to find nothing in the pool and fetch again, one
    # after another (8 fetches in series).  They now get the one result.
    pool = await _full_pool(tmp_path)
    key, calls, results = await _concurrent_misses(pool, 8)
    assert pool.view(key) is None  # really not cached
    assert calls == 1 and results == [bytes([9]) * 4] * 8


async def test_a_failed_fetch_reaches_each_of_eight_waiters_through_its_own_fetch(tmp_path):
    # Eight misses of one key wait for one fetch; when it fails, each waiter's own fetch (its own
    # source) runs, side by side: every reader gets an error, none hangs, none waits on another's retry.
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    key, _data = _chunk(3)
    calls = []
    async def fetch():
        calls.append(1)
        await trio.sleep(0.2)
        raise IntegrityError("the backend's copy does not hash to its key")
    errors = []
    async def reader():
        try:
            await pool.read(key, fetch)
        except IntegrityError as exc:
            errors.append(str(exc))
    start = trio.current_time()
    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(reader)
    assert len(calls) == 8 and len(errors) == 8 and "does not hash" in errors[0]
    assert trio.current_time() - start < 8 * 0.2  # two rounds side by side (0.4 s), not eight in a row (1.6 s)


async def test_a_lease_kept_across_memory_pressure_keeps_its_bytes(tmp_path):
    # A chunk cached in a file's backing range is leased by a reader when a
    # writer needs room: the lease is a copy (never a map of the range), so
    # the writer gets the room at once, the range is punched, and the
    # reader's bytes stay the chunk's.
    area = BackingArea(str(tmp_path / "staging"))
    pool = StagingPool(2 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    key, data = _chunk(6)
    rng = area.file(7).range(0)
    async def fetch():
        return bytes(data)
    assert bytes(await pool.read(key, fetch, into=rng, count=4)) == bytes([6]) * 4
    assert rng.entry is not None and pool.stats().clean_bytes == CHUNK_BYTES
    async with pool.lease(key, fetch) as view:
        assert await pool.reserve(CHUNK_BYTES, wait=False)  # the free chunk of the budget
        with trio.fail_after(5):
            await pool.reserve(CHUNK_BYTES)  # needs the leased chunk's room: evicted under the lease
        assert not pool.has(key) and rng.entry is None
        assert rng.pread(0, CHUNK_BYTES) == bytes(CHUNK_BYTES)  # punched: its memory is back
        assert bytes(view) == bytes(data)


async def test_a_range_written_again_keeps_the_pinned_version_elsewhere(tmp_path):
    # A sealed chunk in its file's range is pinned (its version is not yet
    # durable) when the file writes there again: take_range moves the
    # chunk's bytes into a buffer of its own before the range changes.
    area = BackingArea(str(tmp_path / "staging"))
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    key, data = _chunk(8)
    rng = area.file(9).range(1)
    assert await pool.reserve(CHUNK_BYTES)
    rng.pwrite(0, data)
    pool.adopt_range(key, rng, CHUNK_BYTES, CHUNK_BYTES)
    charge, kept, length = await pool.take_range(rng)
    assert (charge, kept, length) == (CHUNK_BYTES, key, CHUNK_BYTES) and rng.entry is None
    rng.pwrite(0, bytes([1]) * CHUNK_BYTES)
    assert pool.pinned(key) and bytes(pool.view(key)) == bytes(data)
    assert pool.used_bytes == 2 * CHUNK_BYTES  # the range (now the writer's) and the copy


async def test_a_fetch_finishing_while_its_file_writes_there_is_not_cached_in_the_range(tmp_path):
    # A read-ahead of a chunk is in flight when a writer reopens that chunk:
    # the fetched (old) bytes must not become a pool entry in the range the
    # writer is about to change (the entry would then hold the new bytes
    # under the old key, and its eviction would punch the writer's data).
    area = BackingArea(str(tmp_path / "staging"))
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    key, data = _chunk(4)
    rng = area.file(3).range(2)
    fetching = trio.Event()
    async def fetch():
        fetching.set()
        await trio.sleep(0.05)
        return bytes(data)
    async with trio.open_nursery() as n:
        n.start_soon(lambda: pool.read(key, fetch, into=rng, count=0))
        await fetching.wait()
        charge, kept, _ = await pool.take_range(rng)  # the writer takes the range, as _writable_slot does
        assert (charge, kept) == (0, None)
        rng.writing = True
    assert rng.entry is None  # cached elsewhere (a buffer) if at all, not in the writer's range
    rng.pwrite(0, bytes([9]) * 4096)  # the writer's bytes
    view = pool.view(key, 0, 4096)
    assert view is None or bytes(view) == bytes(data[:4096])  # never the writer's bytes under the old key


async def test_pins_of_one_owner_are_released_once(tmp_path):
    """A version (or a replica hold) ends in several ways; whichever comes second must not unpin again."""

    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    key = await _sealed(pool, 5)  # the writer's pin
    pool.pin(key)  # another file's version shares the chunk
    pins = Pins(pool, [key])
    pins.add(key)
    pins.release()
    pins.release()
    assert pins.released and pool.pinned(key)  # the other version's pin is left
    pool.unpin(key)
    assert not pool.pinned(key) and pool.stats().clean_bytes == CHUNK_BYTES


async def test_a_replica_lives_in_a_backing_file_of_its_own_and_outlives_the_process(tmp_path):
    """A peer's chunk stored here is a file named by its digest, found again by the next run."""
    data = os.urandom(CHUNK_BYTES - 100)
    key = chunk.content_key(data)

    async def first_run():
        area = BackingArea(str(tmp_path / "staging"))
        pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
        await pool.store(key, data, into=area.replica(key).range(0))
        await pool.store(key, data, into=area.replica(key).range(0))  # a second file's replica: one copy, two pins
        assert pool.pinned(key) and bytes(pool.view(key)) == data
        pool.unpin(key)
        assert pool.pinned(key)
        area.close()  # the process dies: nothing removes the file

    await first_run()
    area = BackingArea(str(tmp_path / "staging"))
    assert area.found_replicas == {key} and not area.found
    path = area.replica(key).path
    assert content_key_of(path, 0, len(data)) == key
    area.sweep()  # nothing took it: removed
    assert not os.path.exists(path) and not area.found_replicas


async def test_a_clean_chunk_takes_another_key_once_its_hash_is_known(tmp_path):
    """An imported object's chunk cached under its name moves to its content key; pinned or taken keys stay."""
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    data = os.urandom(1000)
    name, key = chunk.digest(b"name"), chunk.digest(data)
    async def fetch():
        return data
    await pool.read(name, fetch)
    async with pool.lease(name, fetch) as view:  # a lease holds the entry, whatever its key
        assert pool.rename(name, key)
        assert bytes(view) == data
    assert not pool.has(name) and bytes(pool.view(key)) == data
    assert not pool.rename(name, key)  # nothing under the old key any more
    pinned = await _sealed(pool, 3)
    assert not pool.rename(pinned, chunk.digest(b"elsewhere"))  # not-yet-durable data keeps its key
    await pool.read(name, fetch)
    assert not pool.rename(name, key)  # the content key is there already: the copy stays where it is
    assert pool.has(name) and pool.has(key)
    assert pool.drop_clean() > 0 and not pool.has(name) and not pool.has(key)


# --- the staging invariant (docs/design.md, "Staging"): a key's bytes are exactly its bytes ---------------

def _kernel_written(area: BackingArea, ino: int):
    """A backing file as FUSE passthrough leaves it while a writer is open: the kernel may write any range."""
    f = area.file(ino)
    f.kernel_opens += 1
    f.kernel_writers += 1
    return f


def _area_and_pool(tmp_path) -> tuple[BackingArea, StagingPool]:
    """A staging dir and a pool of 8 chunks over it (no spill dir)."""
    return (BackingArea(str(tmp_path / "staging")),
            StagingPool(8 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False))


async def _seal_in(pool: StagingPool, rng, data: bytes) -> bytes:
    key = chunk.content_key(data)
    assert await pool.reserve(CHUNK_BYTES)
    rng.pwrite(0, data)
    pool.adopt_range(key, rng, len(data), CHUNK_BYTES)
    return key


async def test_a_clean_chunk_the_kernel_may_change_moves_when_another_file_seals_it(tmp_path):
    # Four writers of one content, each fsyncs then closes: the first's version is durable (its chunk
    # clean) while its file is still open for the kernel to write; the next file seals the same chunk.
    # The old entry went away under adopt_range, which then pinned a key no longer in the pool (KeyError
    # in fsync; the file was marked broken: "chunk 6 ... is in neither DRAM, spill nor the backend").
    area, pool = _area_and_pool(tmp_path)
    data = bytes([5]) * CHUNK_BYTES
    first = _kernel_written(area, 3).range(0)
    key = await _seal_in(pool, first, data)
    pool.unpin(key)  # durable: clean, still in a range the kernel may change
    second = _kernel_written(area, 4).range(0)
    await _seal_in(pool, second, data)
    assert pool.pinned(key) and second.entry is not None and second.entry.key == key
    assert bytes(pool.view(key)) == data


async def test_a_leased_chunk_keeps_its_bytes_when_its_range_is_punched(tmp_path):
    # An upload leases a chunk that lives in the range of a file the kernel writes; another file seals
    # the same chunk (it moves there) and the first file's close punches its range.  The lease was a map
    # of that range: the upload sent zeros and the file was called durable.
    area, pool = _area_and_pool(tmp_path)
    data = os.urandom(CHUNK_BYTES)
    first = _kernel_written(area, 3).range(0)
    key = await _seal_in(pool, first, data)
    async def fetch():
        raise AssertionError("the chunk is in memory")
    async with pool.lease(key, fetch) as view:
        await _seal_in(pool, _kernel_written(area, 4).range(0), data)
        assert first.entry is None
        first.punch()  # what close_kernel does to a range whose chunk lives elsewhere
        assert bytes(view) == data


async def test_a_chunk_the_kernel_changed_is_never_served_under_its_old_key(tmp_path):
    # While a passthrough writer is open, the kernel may write a sealed chunk's range at any moment:
    # whatever is handed out under the key (view, lease, a copy for take_range) is what hashes to it.
    area, pool = _area_and_pool(tmp_path)
    data = bytes([7]) * CHUNK_BYTES
    rng = _kernel_written(area, 3).range(0)
    key = await _seal_in(pool, rng, data)
    rng.pwrite(100, b"changed")  # the kernel writes the range again
    async def fetch():
        return data  # what the backend (or a peer) has of the key
    async with pool.lease(key, fetch) as view:
        assert bytes(view) == data
    assert pool.view(key) is None or bytes(pool.view(key)) == data


def test_hashing_a_range_never_allocates_memory_in_it(tmp_path):
    # content_key_of hashed through a map of the range; a punch between its hole check and the hash
    # made the map's reads fault fresh pages into the hole: memory the pool never counted (writers then
    # got ENOSPC from the staging tmpfs), and SIGBUS where the tmpfs was full.
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm tmpfs")
    path = os.path.join(shm, f"aiturbofs-test-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        data = os.urandom(CHUNK_BYTES)
        leaked = 0
        for i in range(40):
            os.pwrite(fd, data, 0)
            t = threading.Thread(target=content_key_of, args=(path, 0, CHUNK_BYTES))
            t.start()
            time.sleep(i * 0.0001)  # the punch lands at another point of the hash each time
            punch_hole(fd, 0, CHUNK_BYTES)
            t.join()
            leaked += os.fstat(fd).st_blocks * 512
            punch_hole(fd, 0, CHUNK_BYTES)
        assert leaked == 0, f"{leaked} bytes allocated in punched ranges by hashing them"
    finally:
        os.close(fd)
        os.unlink(path)


async def test_the_check_catches_a_sealed_range_changed_in_place_and_spares_named_chunks(tmp_path):
    # AITURBOFS_CHECK_INVARIANTS (conftest sets it): a copy out of a sealed range is hashed against
    # what the range held when sealed; a chunk cached under a name (an imported object's) is not its
    # hash and passes as long as its range is unchanged.
    from aiturbofs import _limits
    if not _limits.CHECK_INVARIANTS:
        pytest.skip("AITURBOFS_CHECK_INVARIANTS is off in this process")

    area, pool = _area_and_pool(tmp_path)
    data = os.urandom(CHUNK_BYTES)
    name = chunk.digest(b"external" + data[:16])  # a name, not the bytes' hash
    async def fetch():
        return data
    named = area.file(5).range(0)
    await pool.read(name, fetch, into=named, count=0)
    assert named.entry is not None
    async with pool.lease(name, fetch) as view:
        assert bytes(view) == data
    rng = area.file(6).range(0)
    key = await _seal_in(pool, rng, data[::-1])
    rng.pwrite(10, b"in place")  # what no one may do to a sealed range
    with pytest.raises(AssertionError, match="staging invariant"):
        async with pool.lease(key, fetch):
            pass


async def test_a_chunk_dropped_from_spill_while_it_is_read_is_fetched(tmp_path):
    # A prefetch found the chunk in the spill store; before its read ran the chunk went durable and
    # its spill file was discarded: the read raised FileNotFoundError in a background task and the
    # daemon exited (every process using the mount got ENOTCONN).
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    key, data = _chunk(4)
    await pool.spill.write(key, data)
    real_read = pool.spill.read
    async def read_after_discard(k):
        os.unlink(os.path.join(pool.spill.directory, k.hex()))  # what discard does to the file
        return await real_read(k)
    pool.spill.read = read_after_discard
    async def fetch():
        return bytes(data)
    assert bytes(await pool.read(key, fetch)) == bytes(data)


# --- backing files on disk (files the kernel writes): they cost the pool nothing ---------------------------

async def test_chunks_on_disk_cost_no_budget_and_clean_ones_are_trimmed_to_it(tmp_path):
    # A file the kernel writes has its backing file on disk: its sealed chunks count for nothing (the
    # page cache holds them), a pinned one is neither evicted nor spilled, and once clean they are an
    # LRU of their own, trimmed to the budget's worth of chunks (oldest first, the leased one kept).
    area = BackingArea(str(tmp_path / "staging"), disk_directory=str(tmp_path / "spill" / SPILL_FILES_DIR))
    pool = StagingPool(2 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    f = area.file(5, on_disk=True)
    assert f.on_disk and f.path.startswith(str(tmp_path / "spill" / SPILL_FILES_DIR))
    keys = []
    for index in range(4):  # twice the budget
        rng = f.range(index)
        data = bytes([index + 1]) * CHUNK_BYTES
        assert room_in(rng, CHUNK_BYTES) == 0
        rng.pwrite(0, data)
        keys.append(chunk.content_key(data))
        pool.adopt_range(keys[-1], rng, CHUNK_BYTES, room_in(rng, CHUNK_BYTES))
    assert pool.used_bytes == 0 and pool.stats().dirty_bytes == 0
    # staged on disk is bounded all the same: past the budget's worth, new files go through requests (wait)
    assert not pool.may_stage_on_disk() and pool.stats().disk_dirty_bytes == 4 * CHUNK_BYTES
    rng = area.file(5, on_disk=True).range(4)  # a chunk written there through requests: room reserved
    assert await pool.reserve(CHUNK_BYTES)
    rng.pwrite(0, bytes([9]) * CHUNK_BYTES)
    keys.append(chunk.content_key(bytes([9]) * CHUNK_BYTES))
    pool.adopt_range(keys[-1], rng, CHUNK_BYTES, CHUNK_BYTES)
    assert pool.used_bytes == 0  # given back once sealed: nothing could evict it to free it (a writer hung)
    assert pool.drop_clean() == 0 and all(pool.has(k) for k in keys)  # pinned: nothing drops them
    with trio.fail_after(1):
        buf = await pool.alloc(CHUNK_BYTES)  # the budget is all free
    pool.release(buf)
    pool.hold(keys[0], +1)  # a reader of the oldest
    for k in keys:
        pool.unpin(k)  # durable
    assert [pool.has(k) for k in keys] == [True, False, False, False, True]
    assert pool.may_stage_on_disk()
    pool.refuse_waits("the backend is full")
    assert not pool.may_stage_on_disk()  # (writers of new files then get ENOSPC with the reason, not a full disk)
    pool.accept_waits()
    assert bytes(pool.view(keys[4])) == bytes([9]) * CHUNK_BYTES
    assert area.bytes_allocated(on_disk=True) <= 2 * CHUNK_BYTES
    pool.hold(keys[0], -1)
    pool.drop_clean()
    assert not any(pool.has(k) for k in keys) and area.bytes_allocated(on_disk=True) == 0


async def test_with_spill_a_pinned_chunk_on_disk_is_copied_to_the_spill_store(tmp_path):
    # The page cache may lose what it has not written back in a power cut; -o spill promises a copy that
    # does not (fsynced), so a pinned chunk on disk is spilled too, and dropped from the spill once durable.
    spill = SpillStore(str(tmp_path / "spill"))
    area = BackingArea(str(tmp_path / "staging"), disk_directory=str(tmp_path / "spill" / SPILL_FILES_DIR))
    pool = StagingPool(2 * CHUNK_BYTES, spill, eager_spill=True)
    rng = area.file(6, on_disk=True).range(0)
    data = os.urandom(CHUNK_BYTES - 7)
    rng.pwrite(0, data)
    key = chunk.content_key(data)
    pool.adopt_range(key, rng, len(data), 0)
    async with trio.open_nursery() as n:
        n.start_soon(pool.run_spiller)
        with trio.fail_after(5):
            while key not in spill:
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert bytes(await spill.read(key)) == data and pool.has(key) and pool.used_bytes == 0
    pool.unpin(key)
    assert key not in spill and pool.has(key)  # durable: the spill copy goes, the cached one stays


def test_a_restart_finds_the_backing_files_on_disk_and_the_spill_store_ignores_their_dir(tmp_path):
    disk = str(tmp_path / "spill" / SPILL_FILES_DIR)
    area = BackingArea(str(tmp_path / "staging"), disk_directory=disk)
    area.file(7, on_disk=True).range(0).pwrite(0, b"x" * 100)
    area.file(7).range(0).pwrite(0, b"y" * 100)  # (a crash while the file moved to disk)
    area.file(8, on_disk=True).range(0).pwrite(0, b"z" * 100)
    area.close()
    again = BackingArea(str(tmp_path / "staging"), disk_directory=disk)
    assert again.found == {7} and again.found_on_disk == {7, 8}
    assert [(f.on_disk, f.ino) for f in again.existing(7)] == [(False, 7), (True, 7)]
    assert [(f.on_disk, f.ino) for f in again.orphans({7})] == [(True, 8)]
    assert SpillStore(str(tmp_path / "spill")).keys() == []  # its files dir is not a chunk
    again.sweep()
    assert os.listdir(disk) == [] and not again.found_on_disk
    again.remove_if_empty()
    assert not os.path.exists(disk)


async def test_a_chunk_dropped_while_it_is_spilled_leaves_the_pool_whole(tmp_path):
    # The spiller copies a pinned chunk of a range and waits for the spill write; meanwhile a
    # passthrough writer changes the range (its entry is disowned there) and the slot that pinned it
    # lets go: the entry leaves the pool.  When the write returned, the spiller filed the dropped
    # entry again and deleted its key from the pool: a KeyError that took the daemon down (CI,
    # test_kill9_with_spill_dir_partial_rewrite_of_durable_file), or, had the chunk arrived again
    # meanwhile, the newer entry of that key.
    area = BackingArea(str(tmp_path / "staging"))
    spill = SpillStore(str(tmp_path / "spill"))
    pool = StagingPool(8 * CHUNK_BYTES, spill, eager_spill=True)
    data = bytes([9]) * CHUNK_BYTES
    rng = area.current(5).range(0)
    key = await _seal_in(pool, rng, data)
    writing, go_on = trio.Event(), trio.Event()
    real_write = spill.write
    async def slow_write(k, view):
        writing.set()
        await go_on.wait()
        await real_write(k, view)
    spill.write = slow_write  # type: ignore[method-assign]
    async with trio.open_nursery() as n:
        n.start_soon(pool._budget.spill_entry, rng.entry)
        await writing.wait()
        pool.unreserve(pool.disown_range(rng))  # the kernel wrote the range
        pool.unpin(key)  # its slot let go: the entry leaves the pool
        again = await _sealed(pool, 9)  # and the same chunk arrives again, in a buffer
        assert again == key
        n.start_soon(pool._budget.spill_entry, pool._entries[key])  # which spills it too
        go_on.set()
    assert pool.pinned(key) and bytes(pool.view(key)) == data
    assert key in spill and await spill.read(key) == data  # the newer entry's spill copy stays


async def test_a_pinned_chunk_does_not_move_into_a_range_the_kernel_may_change(tmp_path):
    # File X sealed a chunk and went durable; file Y deduplicated into X's range (its version pins it,
    # not yet durable); X was released (its range used by nobody).  Then a passthrough writer's absorb
    # sealed the same bytes in its own range: the entry moved there (X's copy punched) and the kernel's
    # next write over that range left Y's version with its chunk nowhere ("chunk 0 of inode 14 is in
    # neither DRAM, spill nor the backend"; the torture suite's kill -9 case, one run in a few).
    area, pool = _area_and_pool(tmp_path)
    data = os.urandom(CHUNK_BYTES)
    xf = area.file(3)
    xf.users += 1  # X's content holds it
    x = xf.range(0)
    key = await _seal_in(pool, x, data)  # X's slot pins it
    y = area.file(4).range(0)
    assert await _seal_in(pool, y, data) == key  # Y's: deduplicated into X's range (pinned twice)
    assert x.entry is not None and y.entry is None
    pool.unpin(key)  # X durable: only Y's pin is left, in X's range,
    xf.users -= 1  # which nobody uses once X is released
    a = _kernel_written(area, 5).range(0)
    assert await _seal_in(pool, a, data) == key  # the absorb of the kernel's write seals it there
    a.pwrite(0, os.urandom(CHUNK_BYTES))  # the kernel writes the range again
    async def fetch():
        raise IntegrityError("not in the backend: Y is not durable")
    assert bytes(await pool.read(key, fetch)) == data  # Y's version still has its bytes


async def test_a_failed_fetch_is_not_handed_to_readers_who_fetch_otherwise(tmp_path):
    # Two files share a chunk: one's fetch (its own source, say a stale content slot) fails while the
    # other waits on that fetch.  The waiter got the first caller's error and its file, whose own source
    # had the right bytes, was marked broken.  A waiter tries its own fetch after a failed one.
    pool = StagingPool(4 * CHUNK_BYTES, SpillStore(str(tmp_path / "spill")), eager_spill=False)
    data = os.urandom(1000)
    key = chunk.digest(data)
    started = trio.Event()
    release = trio.Event()
    async def failing():
        started.set()
        await release.wait()
        raise IntegrityError("this caller's source holds other bytes")
    async def good():
        return data
    results = {}
    async def first():
        try:
            await pool.read(key, failing)
        except IntegrityError as exc:
            results["first"] = exc
    async def second():
        await started.wait()
        results["second"] = bytes(await pool.read(key, good))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        nursery.start_soon(second)
        await started.wait()
        await trio.sleep(0.01)  # the second reader waits on the first's fetch
        release.set()
    assert isinstance(results["first"], IntegrityError)
    assert results["second"] == data


async def _cached(pool: StagingPool):
    """A random chunk read into a buffer of its own (a clean cache): its bytes, key and fetch."""
    data = os.urandom(CHUNK_BYTES)
    key = chunk.content_key(data)
    async def fetch():
        return data
    await pool.read(key, fetch)
    return data, key, fetch


async def test_a_cached_chunk_a_passthrough_file_seals_moves_into_its_range(tmp_path):
    # A chunk read into a buffer (a clean cache: nobody counts on it) that a passthrough writer's absorb
    # then seals lives in that file's range from then on: a buffer would not outlive a daemon crash, and
    # the range is punched once its file closes (the kill -9 case: "recovered ... chunks=3 of 4").
    area, pool = _area_and_pool(tmp_path)
    data, key, fetch = await _cached(pool)
    assert pool.lends(key)
    a = _kernel_written(area, 5).range(0)
    assert await _seal_in(pool, a, data) == key
    assert a.entry is not None and a.entry.key == key and not pool.lends(key)


async def test_a_replica_stored_while_the_chunk_is_in_a_range_the_kernel_may_change_keeps_its_own_copy(tmp_path):
    # A peer's replica arrives for a chunk this node holds only in the range of a file the kernel writes:
    # pinning that entry made the replica's only copy one the kernel's next write takes.
    area, pool = _area_and_pool(tmp_path)
    data = os.urandom(CHUNK_BYTES)
    a = _kernel_written(area, 5).range(0)
    key = await _seal_in(pool, a, data)
    await pool.store(key, data)  # the replica, pinned by that call
    a.pwrite(0, os.urandom(CHUNK_BYTES))  # the kernel writes the range again
    async def fetch():
        raise IntegrityError("not in the backend: the peer's file is not durable")
    assert bytes(await pool.read(key, fetch)) == data


def _wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_new_backing_file_on_disk_is_a_spare_linked_to_its_name_and_never_replaces_a_file(tmp_path):
    disk = str(tmp_path / "spill" / SPILL_FILES_DIR)
    area = BackingArea(str(tmp_path / "staging"), disk_directory=disk)
    spares = os.path.join(disk, SPARES_DIR)
    area.file(1, on_disk=True).range(0).pwrite(0, b"a" * 10)  # the first: the thread starts, none is ready yet
    _wait_for(lambda: os.path.isdir(spares) and len(os.listdir(spares)) >= 8, "the spares")
    before = {os.stat(os.path.join(spares, n)).st_ino for n in os.listdir(spares)}
    f = area.file(2, on_disk=True)
    f.range(0).pwrite(0, b"b" * 10)
    st = os.stat(f.path)
    assert st.st_ino in before and st.st_size == 10 and st.st_mode & 0o777 == 0o600
    # a file that exists is never replaced by a spare: its bytes stay
    with open(os.path.join(disk, "3"), "wb") as out:
        out.write(b"kept")
    assert area.file(3, on_disk=True).range(0).pread(0, 4) == b"kept"
    area.close()
    assert not os.path.exists(spares)  # close removes the spares and their directory
    assert sorted(os.listdir(disk)) == ["1", "2", "3"]  # and nothing else
    assert all(os.stat(os.path.join(disk, n)).st_nlink == 1 for n in ("1", "2", "3"))


def test_spares_a_crashed_run_left_are_removed_at_start_and_a_taken_ones_file_stays(tmp_path):
    disk = tmp_path / "files"
    disk.mkdir()
    spares = SpareFiles(str(disk), keep=4)
    assert not spares.take(str(disk / "1"))  # none ready yet: the caller creates it
    _wait_for(lambda: len(spares._ready) == 4, "the spares")
    assert spares.take(str(disk / "2"))
    (disk / "2").write_bytes(b"data")
    # a kill -9 now: the thread never removed the taken spare's name, nor made the rest into files
    again = SpareFiles(str(disk), keep=4)
    assert not (disk / SPARES_DIR).exists()
    assert (disk / "2").read_bytes() == b"data" and os.stat(disk / "2").st_nlink == 1
    again.close()
    spares.close()


def test_spares_that_cannot_be_made_leave_creating_to_the_caller(tmp_path, caplog):
    disk = tmp_path / "files"
    disk.mkdir()
    spares = SpareFiles(str(disk), keep=4)
    (disk / SPARES_DIR).write_bytes(b"")  # a file where their directory goes: the thread cannot make it
    assert not spares.take(str(disk / "1"))
    _wait_for(lambda: spares._stopped, "the thread to give up")
    assert not spares.take(str(disk / "1")) and "no spare backing files" in caplog.text
    spares.close()
    caplog.clear()
    again = SpareFiles(str(disk), keep=4)  # at start: not a directory of spares either; the mount still starts
    assert again._stopped and not again.take(str(disk / "2")) and "no spare backing files" in caplog.text
    assert (disk / SPARES_DIR).is_file()  # (not ours to remove)
    again.close()


@pytest.mark.parametrize("kernel", [False, True])
async def test_a_cached_chunk_sealed_while_a_reader_holds_it_outlives_a_crash(tmp_path, kernel):
    # A chunk read into a buffer (a clean cache) is lent to a reader (a READ reply, an upload part)
    # while a file seals the same bytes in its own range.  The buffer could not move under the lease,
    # so it stayed the chunk's only copy, now pinned by that file's version, and its range was punched:
    # a kill -9 then lost the chunk ("recovered ... chunks=1 of 2", then a BLAKE3 mismatch against the
    # older object in the backend; the torture suite's kill -9 case, one run in fifty).
    area, pool = _area_and_pool(tmp_path)
    data, key, fetch = await _cached(pool)
    f = _kernel_written(area, 5) if kernel else area.file(5)
    f.users += 1
    a = f.range(0)
    async with pool.lease(key, fetch) as view:
        assert await _seal_in(pool, a, data) == key
        # what a crash leaves must hold it: the file's range, or the spill store
        assert (a.entry is not None and a.entry.key == key) or key in pool.spill
        assert bytes(view) == data
    assert pool.pinned(key) and bytes(await pool.read(key, fetch)) == data


async def test_a_replica_of_a_cached_chunk_is_kept_in_its_own_file(tmp_path):
    # A peer's replica arrives for a chunk this node has only as a read cache (a buffer): pinning the
    # buffer made the replica one a kill -9 of this node loses, although it was asked into a file.
    area, pool = _area_and_pool(tmp_path)
    data, key, fetch = await _cached(pool)
    into = area.replica(key).range(0)
    await pool.store(key, data, into=into)
    assert pool.pinned(key) and into.entry is not None and into.entry.key == key
    assert content_key_of(into.file.path, 0, CHUNK_BYTES) == key
