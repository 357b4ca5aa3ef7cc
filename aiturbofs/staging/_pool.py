"""The staging pool: a content-addressed chunk store under a byte budget.

The pool accounts for every byte of staged or cached data on the node:

* *ranges* of backing files (``_backing``) that writers fill: ``reserve``
  counts them before the first byte lands;
* *entries*, sealed chunks keyed by their BLAKE3 digest, whose bytes live in
  a backing file's range (a file written or read here) or in a buffer of
  their own (a replica from a peer, a chunk cached for another node, the
  old bytes of a range its file wrote again).  An entry is **pinned** while
  some not-yet-durable file references it (dirty data: it may be spilled to
  disk but never dropped) and **clean** otherwise (an LRU read cache,
  evicted first under pressure: a range is hole-punched, a buffer
  recycled).  Identical chunks of different files share one entry, which is
  dedup inside one node;
* a few recycled full-size buffers.

All of them count against ``budget_bytes``, except ranges of backing files
on disk (those of files the kernel writes, ``_backing``): the page cache
holds them and the kernel writes them back, so they count for nothing
(``room_in``).  A pinned chunk there outlives a daemon crash where it is
(with ``-o spill`` it is copied to the spill store as well, which is
fsynced); a clean one is kept in an LRU of its own, trimmed to
``budget_bytes`` of chunks.

When a writer needs memory and
the budget is spent, the pool evicts clean entries, then spills pinned ones
(at once with ``-o spill``; otherwise after ``SPILL_WAIT_S`` of waiting for
persist, and then at once until persist frees a chunk), then waits.  A
write therefore never fails because the pool is full, and a pinned chunk is
only ever released after it is on disk.

The pool knows nothing of files, paths or backends: callers pass a ``fetch``
coroutine for chunks it does not hold.  It runs on the trio thread only.

``StagingPool`` keeps the entries and what changes them (adopt, pin, take
back, the passthrough states, recovery); two parts it owns do the rest, and
its methods for them only hand over: ``_budget.Budget`` counts the budget and
makes room (buffers, reserve, eviction, spill, waiting writers), and
``_reads.Reads`` reads (view, read, lease, one fetch per missed key).  An
entry itself is ``_entry.Entry``.
"""

import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal, overload

from .. import chunk
from .._limits import CHECK_INVARIANTS, CHUNK_BYTES, SMALL_BUFFER_BYTES
from ._backing import Range
from ._budget import Budget
from ._entry import Entry, charge_of, punch
from ._reads import Fetch, Reads
from ._spill import SpillStore

log = logging.getLogger(__name__)


def room(want: int, index: int) -> int:
    """The budget an open chunk holding ``want`` bytes counts for: a small file's first chunk counts what it uses."""
    return CHUNK_BYTES if (want > SMALL_BUFFER_BYTES or index > 0) else charge_of(want)


def room_in(rng: Range, want: int) -> int:
    """``room`` of ``want`` bytes in ``rng``: nothing in a backing file on disk (the page cache holds it)."""
    return 0 if rng.file.on_disk else room(want, rng.index)


@dataclass
class PoolStats:
    budget_bytes: int
    used_bytes: int
    dirty_bytes: int  # pinned entries in memory
    clean_bytes: int  # unpinned entries in memory (read cache)
    open_bytes: int  # reserved ranges of chunks being written
    free_bytes: int  # recycled buffers kept for reuse
    spilled_bytes: int  # on the spill disk
    pinned_chunks: int
    waiting_writers: int
    disk_dirty_bytes: int = 0  # pinned entries in backing files on disk (files the kernel wrote; no budget)
    disk_clean_bytes: int = 0  # unpinned ones there (a cache trimmed to the budget)


class StagingPool:
    """Chunk buffers and sealed chunks under one byte budget (see module doc)."""

    def __init__(self, budget_bytes: int, spill: SpillStore, *, eager_spill: bool):
        self.spill = spill
        self.eager_spill = eager_spill
        self._entries: dict[bytes, Entry] = {}
        self._budget = Budget(budget_bytes, spill, eager_spill=eager_spill, entries=self._entries, copy=self._copy)
        self._reads = Reads(self._entries, self._budget, spill, range_copy=self._range_copy,
                            adopt_clean=lambda key, rng, length, charge: self.adopt_range(key, rng, length, charge,
                                                                                          pin=False))

    @property
    def budget_bytes(self) -> int:
        return self._budget.budget_bytes

    @property
    def used_bytes(self) -> int:
        return self._budget.used_bytes

    # ------------------------------------------------------------------ stats
    def stats(self) -> PoolStats:
        dirty = clean = disk_dirty = disk_clean = 0
        for e in self._entries.values():
            if e.rng is not None and e.rng.file.on_disk:
                if e.pins:
                    disk_dirty += e.length
                else:
                    disk_clean += e.length
            elif e.resident:
                if e.pins:
                    dirty += e.charge
                else:
                    clean += e.charge
        free = len(self._budget.free) * CHUNK_BYTES
        return PoolStats(
            budget_bytes=self.budget_bytes,
            used_bytes=self.used_bytes,
            dirty_bytes=dirty,
            clean_bytes=clean,
            open_bytes=self.used_bytes - dirty - clean - free,
            free_bytes=free,
            spilled_bytes=self.spill.bytes_used,
            pinned_chunks=sum(1 for e in self._entries.values() if e.pins),
            waiting_writers=self._budget.waiting_writers,
            disk_dirty_bytes=disk_dirty,
            disk_clean_bytes=disk_clean,
        )

    # ------------------------------------------------ the budget (``_budget``: room, eviction, spill)
    @overload
    async def alloc(self, capacity: int, *, wait: Literal[True] = True) -> bytearray: ...

    @overload
    async def alloc(self, capacity: int, *, wait: bool) -> bytearray | None: ...

    async def alloc(self, capacity: int, *, wait: bool = True) -> bytearray | None:
        """A zero-initialised-or-recycled buffer of ``capacity`` bytes (``Budget.alloc``: may wait for room)."""
        return await self._budget.alloc(capacity, wait=wait)

    async def reserve(self, capacity: int, *, wait: bool = True) -> bool:
        """Count ``capacity`` bytes against the budget (``Budget.reserve``: makes room, may wait)."""
        return await self._budget.reserve(capacity, wait=wait)

    def unreserve(self, charge: int) -> None:
        """Give back bytes counted by ``reserve``."""
        self._budget.unreserve(charge)

    def refuse_waits(self, reason: str) -> None:
        """From now on a writer that would wait for memory fails with ENOSPC (``Budget.refuse_waits``)."""
        self._budget.refuse_waits(reason)

    def accept_waits(self) -> None:
        """Undo ``refuse_waits``: writers wait for memory again."""
        self._budget.accept_waits()

    def release(self, buf: bytearray) -> None:
        """Give back a buffer from ``alloc`` that was not adopted."""
        self._budget.release(buf)

    def charge_present(self, charge: int) -> None:
        """Count bytes that are there already, even past the budget (``Budget.charge_present``)."""
        self._budget.charge_present(charge)

    def may_stage_on_disk(self) -> bool:
        """Whether a new file the kernel writes may stage its bytes on disk (``Budget.may_stage_on_disk``)."""
        return self._budget.may_stage_on_disk()

    @property
    def writers_waiting(self) -> int:
        """Writers waiting for room in the budget now."""
        return self._budget.waiting_writers

    def free_fraction(self) -> float:
        """The part of the budget neither used nor taken by pinned chunks (clean ones can be evicted)."""
        return self._budget.free_fraction()

    def count_recovered(self, charge: int) -> None:
        """Count a range a previous run left (recovery), even past the budget: its bytes are there."""
        self._budget.count_recovered(charge)

    def drop_clean(self) -> int:
        """Evict every evictable entry (``aiturbo drop-cache``); returns bytes freed."""
        return self._budget.drop_clean()

    async def run_spiller(self) -> None:
        """With ``-o spill``: copy every pinned chunk to disk in the background (``Budget.run_spiller``)."""
        await self._budget.run_spiller()

    # ------------------------------------------------------------------ reads (``_reads``)
    def has(self, key: bytes) -> bool:
        """Whether the chunk is in memory (no read of it)."""
        return self._reads.has(key)

    def lends(self, key: bytes) -> bool:
        """Whether ``lease`` of the chunk lends memory the pool holds (a buffer), not a copy."""
        return self._reads.lends(key)

    def view(self, key: bytes, start: int = 0, count: int | None = None):
        """The chunk's bytes ``[start, start + count)`` if in memory (valid until the next await)."""
        return self._reads.view(key, start, count)

    async def read(self, key: bytes, fetch: Fetch, *, into: Range | None = None, start: int = 0, count: int | None = None):
        """The chunk's bytes from memory, the spill store, or ``fetch()``: one fetch per missed key (``Reads.read``)."""
        return await self._reads.read(key, fetch, into=into, start=start, count=count)

    def lease(self, key: bytes, fetch: Fetch) -> AbstractAsyncContextManager:
        """Like ``read`` but the bytes stay valid inside the ``async with`` (``Reads.lease``)."""
        return self._reads.lease(key, fetch)

    # ---------------------------------------------------------------- entries
    def adopt(self, key: bytes, buf: bytearray, length: int) -> None:
        """Seal ``buf[:length]`` as chunk ``key`` and pin it once.

        The pool owns ``buf`` afterwards.  If the chunk is already present
        (dedup) the buffer is recycled and the existing entry pinned.
        """
        e = self._entries.get(key)
        if e is not None and e.volatile:
            self._leave_volatile(e)
            e = self._entries.get(key)  # gone if nothing pinned it (a durable chunk the kernel may change)
        if e is None:
            e = self._entries[key] = Entry(key, buf, length)
        elif e.buf is None:
            # A spilled-only entry gets its memory back; one recovered after a
            # restart did not know its length until now.
            e.buf, e.length = buf, length
        else:
            self.release(buf)
        self.pin(key)
        self._budget.place(e)

    def adopt_range(self, key: bytes, rng: Range, length: int, charge: int, *, pin: bool = True) -> None:
        """Seal the first ``length`` bytes of ``rng`` as chunk ``key`` and pin it once (unless not ``pin``).

        ``charge`` is what ``reserve`` counted for the range; the pool holds
        it from now on.  If the chunk is already in memory (dedup) the range
        is punched and its charge given back.
        """
        assert rng.entry is None, "a range holds one entry"
        rng.writing = False
        if charge and rng.file.on_disk:
            # (a chunk written there through requests: its room was reserved while open) sealed on disk, it
            # costs nothing; a charge kept there could never be evicted to free it
            self.unreserve(charge)
            charge = 0
        e = self._entries.get(key)
        if e is not None and e.volatile:
            self._leave_volatile(e)  # a copy the kernel may change: this range is the chunk now
            e = self._entries.get(key)  # gone if nothing pinned it (a durable chunk the kernel may change)
        if (e is not None and (e.buf is not None or (not e.leases and _unused(e.rng)))
                and not (e.pins and rng.file.kernel_writers)):
            # The chunk's bytes arrive in a file's range while its copy is a buffer, or a range of a
            # file nobody uses any more (a cache of a removed file): the file's own range is where it
            # lives now (whole in its backing file, where it outlives a daemon crash and the kernel may
            # serve it), the other copy goes.  Not into a range the kernel may write if another file's
            # version not yet durable counts on the chunk: the kernel's next write there would take its
            # only copy (that one outlives a crash already: a range, or a buffer spilled by take_range).
            # A buffer a reader holds moves too, and goes back once the last lease ends: left the
            # chunk's copy, it was the only one of a version this pins, which a kill -9 lost.
            if e.buf is not None:
                buf, e.buf = e.buf, None
                if e.leases:
                    e.lent.append(buf)
                else:
                    self.release(buf)
            else:
                old, e.rng = e.rng, None
                assert old is not None
                old.entry = None
                punch(old)
                self.unreserve(e.charge)
            e.charge = 0
        if e is not None and e.resident:
            if not rng.file.kernel_opens:  # else the bytes stay: the kernel serves them from there
                punch(rng)
            self.unreserve(charge)
        else:
            rng.ensure_length(length)  # (its file reaches the chunk's end: the kernel serves it whole)
            if e is None:
                e = self._entries[key] = Entry(key, None, length)
            e.rng, e.length, e.charge = rng, length, charge
            e.volatile = rng.file.kernel_writers > 0
            rng.entry = e
            self._note_sealed(e)
        if pin:
            self.pin(key)
        self._budget.place(e)

    # ------------------------------------------------ ranges the kernel writes (FUSE passthrough)
    def disown_range(self, rng: Range) -> int:
        """The kernel changed ``rng``: its entry no longer has its bytes there.  Returns the charge it held
        (now the caller's).  The bytes stay (no punch); the entry keeps any other copy (spill)."""
        e = rng.entry
        if e is None:
            return 0
        charge, e.charge = e.charge, 0
        e.rng = rng.entry = None
        e.volatile = False
        self._budget.place(e)
        return charge

    def _leave_volatile(self, e: Entry) -> None:
        """Another copy of ``e``'s chunk arrives: it replaces the one in a range the kernel may change."""
        assert e.rng is not None
        self.unreserve(self.disown_range(e.rng))  # that range's bytes are its file's, uncounted, until it closes

    def trusted(self, e: Entry) -> bool:
        """Whether ``e``'s bytes are still its key's where they are (a volatile entry is hashed again; let go
        if changed).  Only a hint for the range's own file: bytes handed to anyone else come from ``_copy``."""
        if not e.volatile or e.rng is None:
            return True
        return self._range_copy(e) is not None

    def _copy(self, e: Entry):
        """The bytes of resident entry ``e`` for a reader elsewhere, or None if they are not its key's any more.

        The one place the staging invariant is enforced (docs/design.md, "Staging"): a buffer
        entry's bytes are lent as they are (the caller holds a lease while it keeps them); a range's
        are copied with ``pread`` on this thread, never mapped (a map of a range that another task
        punches reads fresh pages, or raises SIGBUS on a full tmpfs), and a *volatile* range (its file
        open for the kernel to write) is hashed in that copy: what is handed out under a key is what
        hashes to it, whatever the kernel writes at the same moment.
        """
        if e.buf is not None:
            return memoryview(e.buf)[: e.length]
        return self._range_copy(e)

    def _range_copy(self, e: Entry) -> bytes | None:
        assert e.rng is not None
        data = e.rng.pread(0, e.length)
        if not e.volatile:
            if CHECK_INVARIANTS and e.sealed_as is not None and chunk.content_key(data) != e.sealed_as:
                # a sealed range changed in place: the invariant is broken (the tests run with the check on)
                raise AssertionError(f"staging invariant: chunk {e.key.hex()[:16]} in {e.rng.file.path} range "
                                     f"{e.rng.index} changed after it was sealed")
            return data
        if chunk.content_key(data) == e.key:
            return data
        log.info("chunk %s changed in %s by a passthrough writer: no longer served from there",
                 e.key.hex()[:16], e.rng.file.path)
        self.unreserve(self.disown_range(e.rng))
        return None

    def unsteady(self, rng: Range) -> None:
        """``rng``'s file is open for the kernel to write: its entry there is volatile until ``steady``."""
        e = rng.entry
        if e is not None and not e.volatile:
            e.volatile = True
            self._budget.place(e)

    def steady(self, rng: Range) -> None:
        """``rng``'s file has no passthrough writer any more, and its entry there was checked: trust it again."""
        e = rng.entry
        if e is not None and e.volatile:
            e.volatile = False
            self._note_sealed(e)
            self._budget.place(e)

    @staticmethod
    def _note_sealed(e: Entry) -> None:
        """With CHECK_INVARIANTS: remember what a sealed range holds (``_range_copy`` checks it)."""
        if CHECK_INVARIANTS and not e.volatile and e.rng is not None:
            e.sealed_as = chunk.content_key(e.rng.pread(0, e.length))

    def recover_replica(self, key: bytes, rng: Range, length: int) -> None:
        """After a restart: a replica's backing file (checked to hold ``key``) is the chunk again, pinned once."""
        charge = charge_of(length)
        e = self._entries.get(key)
        if e is not None and (e.resident or e.spilled):
            self.pin(key)
            return
        self.count_recovered(charge)
        self.adopt_range(key, rng, length, charge)

    def hold(self, key: bytes, delta: int) -> None:
        """Keep a present chunk from eviction (+1) or let it go again (-1): recovery's hold."""
        e = self._entries[key]
        e.leases += delta

    async def take_range(self, rng: Range) -> tuple[int, bytes | None, int]:
        """Move the entry out of ``rng`` so that its file may write there again.

        Returns the charge the caller now holds for the range (0 if no entry
        was there: reserve one), and the key and length of the bytes left
        there (None, 0: nothing to keep).  The bytes stay where they are.  An entry
        still pinned keeps its bytes elsewhere: in its spill file if it has
        one, else in a buffer of its own, which may wait for memory, and
        which is written to the spill store before this returns: another
        file may have deduplicated into the range, and a daemon crash must
        not lose its only copy (recovery finds it in the spill store).
        """
        while True:
            e = rng.entry
            if e is None:
                return 0, None, 0
            if not self.trusted(e):
                continue  # the kernel changed it: nothing of it to keep
            if e.leases:
                await self._budget.unleased(e)  # a reader maps the range: it must not change under it
                continue
            if e.pins and not e.spilled:
                e.leases += 1  # not evicted (punched) while we wait for the buffer
                try:
                    buf = await self.alloc(charge_of(e.length))
                finally:
                    self._budget.let_go(e)
                if rng.entry is not e or e.leases:
                    self.release(buf)
                    continue
                data = self._range_copy(e)
                if data is None:  # the kernel changed it meanwhile: nothing of it to keep
                    self.release(buf)
                    continue
                buf[: e.length] = data
                e.buf = buf
            charge, e.charge = e.charge, (len(e.buf) if e.buf is not None else 0)
            e.rng = rng.entry = None
            e.volatile = False  # (checked above) a buffer, or nowhere
            self._budget.place(e)
            if e.buf is not None and e.pins and not e.spilled:
                await self._budget.spill_entry(e)  # (a failure is logged there: the buffer still has the bytes)
            return charge, e.key, e.length

    async def store(self, key: bytes, data, *, into: Range | None = None) -> None:
        """Keep a copy of a verified chunk from elsewhere (a peer's replica), pinned like ``adopt``.

        ``into``: the range of a backing file to keep it in (a replica's
        own file: it then survives a daemon crash), else a buffer.  Waits
        for memory like a writer does: a replica is dirty data too.
        """
        e = self._entries.get(key)
        if e is not None and e.volatile:
            self._leave_volatile(e)  # a copy the kernel may change is no copy to count on: this one is
            e = self._entries.get(key)
        if e is not None and _kept(e, into):
            self.pin(key)
            return
        n = len(data)
        charge = charge_of(n)
        if into is None:
            buf = await self.alloc(charge)
            buf[:n] = data
            self.adopt(key, buf, n)
            return
        await self.reserve(charge)
        e = self._entries.get(key)
        if e is not None and _kept(e, into):  # the same chunk arrived while we waited
            self.unreserve(charge)
            self.pin(key)
            return
        try:
            into.pwrite(0, data)
        except BaseException:
            self.unreserve(charge)
            punch(into)
            raise
        self.adopt_range(key, into, n, charge)

    def rename(self, old: bytes, new: bytes) -> bool:
        """Give the clean chunk ``old`` the key ``new`` (an imported object's chunk once its hash is recorded).

        Only an unpinned, steady entry in memory with no copy under ``new``
        moves (a lease holds the entry itself, whatever its key); False leaves
        everything as it was (the entry stays an ordinary clean one under
        ``old`` until it is evicted).
        """
        e = self._entries.get(old)
        if (e is None or not e.resident or e.pins or e.spilled or e.volatile
                or self._reads.fetching(old) or new in self._entries):
            return False
        self._budget.unindex(e)
        del self._entries[old]
        e.key = new
        self._entries[new] = e
        self._budget.place(e)
        return True

    def pin(self, key: bytes) -> None:
        """Add a not-yet-durable reference to a present chunk."""
        e = self._entries[key]
        e.pins += 1
        self._budget.place(e)

    def unpin(self, key: bytes) -> None:
        """Drop a reference taken by ``adopt``/``pin``; at zero the chunk is clean."""
        e = self._entries.get(key)
        assert e is not None and e.pins > 0, "unpin without pin"
        e.pins -= 1
        if e.pins == 0:
            self._budget.note_unpinned()
            if e.spilled:
                self.spill.discard(key)  # durable now: the disk copy is no longer needed
                e.spilled = False
        self._budget.place(e)

    def pinned(self, key: bytes) -> bool:
        e = self._entries.get(key)
        return e is not None and e.pins > 0

    def recover_spilled(self, key: bytes) -> bool:
        """Pin a chunk found in the spill store after a restart; False if absent."""
        if key not in self.spill:
            return False
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry(key, None, 0)
            e.length = -1  # unknown until read back
        e.spilled = True
        self.pin(key)
        return True


class Pins:
    """Pool pins held for one owner: a committed version of a file, or a replica hold for a peer's file.

    Each key in ``keys`` is one pin (a key may repeat).  ``release`` gives
    them all back once; later calls do nothing, so the owner's several ways
    of ending (durable, superseded, broken, dropped) cannot unpin twice.
    """

    __slots__ = ("_pool", "keys", "released")

    def __init__(self, pool: "StagingPool", keys: list[bytes] | None = None):
        self._pool = pool
        self.keys: list[bytes] = keys if keys is not None else []  # pinned already, by whoever made them
        self.released = False

    def add(self, key: bytes) -> None:
        """Take one more pin of a present chunk ``key`` for this owner."""
        assert not self.released, "pins added after release"
        self._pool.pin(key)
        self.keys.append(key)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for key in self.keys:
            self._pool.unpin(key)


def _kept(e: Entry, into: Range | None) -> bool:
    """Whether ``e`` keeps a copy as lasting as ``store`` was asked for: in a range or the spill store
    where ``into`` names a range (a cached buffer would not outlive a crash: the range takes it over)."""
    return e.rng is not None or e.spilled or (into is None and e.buf is not None)


def _unused(rng: Range | None) -> bool:
    """A range of a backing file no file's content holds (and the kernel does not serve)."""
    return rng is not None and rng.file.users == 0 and not rng.file.kernel_opens and rng.file.ino is not None

