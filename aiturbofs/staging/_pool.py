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
(at once with ``-o spill``, after ``SPILL_WAIT_S`` of waiting for persist
otherwise), then waits.  A write therefore never fails because the pool is
full, and a pinned chunk is only ever released after it is on disk.

The pool knows nothing of files, paths or backends: callers pass a ``fetch``
coroutine for chunks it does not hold.  It runs on the trio thread only.
"""

import collections
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, overload

import trio

from .. import chunk
from .._errors import NoSpace
from .._limits import CHECK_INVARIANTS, CHUNK_BYTES, FREE_BUFFERS_KEPT_MAX, SMALL_BUFFER_BYTES, SPILL_WAIT_S
from ._backing import Range
from ._spill import SpillStore

log = logging.getLogger(__name__)

Fetch = Callable[[], Awaitable[bytes]]


def room(want: int, index: int) -> int:
    """The budget an open chunk holding ``want`` bytes counts for: a small file's first chunk counts what it uses."""
    return CHUNK_BYTES if (want > SMALL_BUFFER_BYTES or index > 0) else _charge_of(want)


def room_in(rng: Range, want: int) -> int:
    """``room`` of ``want`` bytes in ``rng``: nothing in a backing file on disk (the page cache holds it)."""
    return 0 if rng.file.on_disk else room(want, rng.index)


class Entry:
    """One sealed chunk, in memory as ``buf[:length]`` or as a backing file's range ``rng``."""

    __slots__ = ("key", "buf", "rng", "length", "charge", "pins", "leases", "spilled", "volatile", "sealed_as")

    def __init__(self, key: bytes, buf: bytearray | None, length: int):
        self.key = key
        self.buf = buf
        self.rng: Range | None = None  # the chunk's range of a file's backing file
        self.length = length
        self.charge = len(buf) if buf is not None else 0  # budget bytes its memory counts for
        self.pins = 0  # not-yet-durable references: the bytes must not be lost
        self.leases = 0  # readers working outside the trio thread: do not recycle
        self.spilled = False  # a verified copy is in the spill store
        # In a range the kernel may still write (its file is open in passthrough mode for writing):
        # read only after hashing it again, never evicted or spilled, until ``steady``.
        self.volatile = False
        # With CHECK_INVARIANTS: the content key of the bytes its range held when it became their home
        # (or was trusted again), which every copy out of the range is checked against.  (Not ``key``:
        # an imported object's chunk is cached under a name, not a hash.)
        self.sealed_as: bytes | None = None

    @property
    def resident(self) -> bool:
        return self.buf is not None or self.rng is not None

    def bytes(self, start: int = 0, count: int | None = None):
        """``count`` bytes from ``start`` (all with None): a view of ``buf`` or a copy of the range."""
        stop = self.length if count is None else min(self.length, start + count)
        if self.buf is not None:
            return memoryview(self.buf)[start:stop]
        assert self.rng is not None  # resident
        return self.rng.pread(start, max(0, stop - start))


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
        self.budget_bytes = budget_bytes
        self.spill = spill
        self.eager_spill = eager_spill
        self.used_bytes = 0
        self._entries: dict[bytes, Entry] = {}
        # In-memory entries that may be dropped (unpinned, or safely spilled), LRU first.
        self._evictable: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        # In-memory pinned entries with no copy on disk yet, oldest first.
        self._unspilled: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        # Unpinned steady entries in ranges of backing files on disk (a cache costing no budget), LRU first,
        # and the bytes they hold: trimmed to budget_bytes.
        self._on_disk: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self._on_disk_bytes = 0
        # Pinned steady entries there (files the kernel wrote, not yet durable), and their bytes.
        self._on_disk_pinned: dict[bytes, Entry] = {}
        self._on_disk_pinned_bytes = 0
        self._free: list[bytearray] = []
        self._freed = trio.Event()
        self._spill_wanted = trio.Event()
        self._inflight: dict[bytes, _Flight] = {}
        self._lease_returned = trio.Event()
        self._waiting_writers = 0
        self._spill_failed_logged = False
        self._refusal: str | None = None  # why writers that must wait fail instead (refuse_waits)

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
        free = len(self._free) * CHUNK_BYTES
        return PoolStats(
            budget_bytes=self.budget_bytes,
            used_bytes=self.used_bytes,
            dirty_bytes=dirty,
            clean_bytes=clean,
            open_bytes=self.used_bytes - dirty - clean - free,
            free_bytes=free,
            spilled_bytes=self.spill.bytes_used,
            pinned_chunks=sum(1 for e in self._entries.values() if e.pins),
            waiting_writers=self._waiting_writers,
            disk_dirty_bytes=disk_dirty,
            disk_clean_bytes=disk_clean,
        )

    # ---------------------------------------------------------------- buffers
    @overload
    async def alloc(self, capacity: int, *, wait: Literal[True] = True) -> bytearray: ...

    @overload
    async def alloc(self, capacity: int, *, wait: bool) -> bytearray | None: ...

    async def alloc(self, capacity: int, *, wait: bool = True) -> bytearray | None:
        """A zero-initialised-or-recycled buffer of ``capacity`` bytes.

        Callers must overwrite what they expose: a recycled buffer holds old
        bytes.  With ``wait`` the call blocks until memory is free (never
        fails); without it, returns None when memory cannot be had at once.
        """
        if capacity == CHUNK_BYTES and self._free:
            return self._free.pop()
        if not await self.reserve(capacity, wait=wait):
            return None
        return bytearray(capacity)

    async def reserve(self, capacity: int, *, wait: bool = True) -> bool:
        """Count ``capacity`` bytes against the budget (a backing file's range about to be written).

        Makes room as ``alloc`` does: evicts clean chunks, spills pinned
        ones, waits.  Without ``wait``, False when room cannot be had at
        once.  ``unreserve`` gives the bytes back.
        """
        assert 0 < capacity <= CHUNK_BYTES
        waited_s = 0.0
        self._waiting_writers += 1
        try:
            while True:
                if self.used_bytes + capacity <= self.budget_bytes:
                    self.used_bytes += capacity
                    return True
                if self._evict_one():
                    continue
                if self._free:
                    self._free.pop()
                    self.used_bytes -= CHUNK_BYTES
                    continue
                if not wait:
                    return False
                if (self.eager_spill or waited_s >= SPILL_WAIT_S) and await self._spill_one():
                    continue
                if self._refusal is not None:
                    raise NoSpace(self._refusal)
                if self.eager_spill:
                    self._spill_wanted.set()
                with trio.move_on_after(0.1 if self.eager_spill else SPILL_WAIT_S) as scope:
                    await self._freed.wait()
                if scope.cancelled_caught:
                    waited_s += 0.1 if self.eager_spill else SPILL_WAIT_S
        finally:
            self._waiting_writers -= 1

    def unreserve(self, charge: int) -> None:
        """Give back bytes counted by ``reserve``."""
        if charge:
            self.used_bytes -= charge
            self._notify_freed()

    def refuse_waits(self, reason: str) -> None:
        """From now on a writer that would wait for memory fails with ENOSPC (``reason``).

        For a backend that says it is full: staged memory frees only when
        files become durable, so waiting would last as long as the backend
        stays full.  Writers already waiting wake and fail; memory that is
        free, evictable or spillable is still handed out.
        """
        if self._refusal is None:
            log.error("writers that need memory now get ENOSPC: %s", reason)
        self._refusal = reason
        self._notify_freed()

    def accept_waits(self) -> None:
        """Undo ``refuse_waits``: writers wait for memory again."""
        if self._refusal is not None:
            log.info("the backend takes data again: writers wait for memory again instead of ENOSPC")
        self._refusal = None

    def release(self, buf: bytearray) -> None:
        """Give back a buffer from ``alloc`` that was not adopted."""
        if len(buf) == CHUNK_BYTES and len(self._free) < FREE_BUFFERS_KEPT_MAX:
            self._free.append(buf)
        else:
            self.used_bytes -= len(buf)
        self._notify_freed()

    def _notify_freed(self) -> None:
        self._freed.set()
        self._freed = trio.Event()

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
        self._place(e)

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
        if e is not None and not e.leases and (e.buf is not None or _unused(e.rng)):
            # The chunk's bytes arrive in a file's range while its copy is a buffer, or a range of a
            # file nobody uses any more (a cache of a removed file): the file's own range is where it
            # lives now (whole in its backing file, the kernel may serve it), the other copy goes.
            if e.buf is not None:
                buf, e.buf = e.buf, None
                self.release(buf)
            else:
                old, e.rng = e.rng, None
                assert old is not None
                old.entry = None
                self._punch(old)
                self.unreserve(e.charge)
            e.charge = 0
        if e is not None and e.resident:
            if not rng.file.kernel_opens:  # else the bytes stay: the kernel serves them from there
                self._punch(rng)
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
        self._place(e)

    # ------------------------------------------------ ranges the kernel writes (FUSE passthrough)
    def charge_present(self, charge: int) -> None:
        """Count bytes that are there already (written by the kernel, or left by a previous run), even past
        the budget; clean entries make room at once and the spiller is woken for the rest."""
        self.used_bytes += charge
        while self.used_bytes > self.budget_bytes and self._evict_one():
            pass
        if self.used_bytes > self.budget_bytes:
            self._spill_wanted.set()

    def may_stage_on_disk(self) -> bool:
        """Whether a new file the kernel writes may stage its bytes on disk: no backend known to be full, and
        less than ``budget_bytes`` of such files not yet durable there (else new files are written through
        requests, which wait for persist like any writer: staged data stays bounded)."""
        return self._refusal is None and self._on_disk_pinned_bytes < self.budget_bytes

    def free_fraction(self) -> float:
        """The part of the budget neither used nor taken by pinned chunks (clean ones can be evicted)."""
        clean = sum(e.charge for e in self._evictable.values())
        return max(0.0, self.budget_bytes - self.used_bytes + clean) / self.budget_bytes

    def disown_range(self, rng: Range) -> int:
        """The kernel changed ``rng``: its entry no longer has its bytes there.  Returns the charge it held
        (now the caller's).  The bytes stay (no punch); the entry keeps any other copy (spill)."""
        e = rng.entry
        if e is None:
            return 0
        charge, e.charge = e.charge, 0
        e.rng = rng.entry = None
        e.volatile = False
        self._place(e)
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
            self._place(e)

    def steady(self, rng: Range) -> None:
        """``rng``'s file has no passthrough writer any more, and its entry there was checked: trust it again."""
        e = rng.entry
        if e is not None and e.volatile:
            e.volatile = False
            self._note_sealed(e)
            self._place(e)

    @staticmethod
    def _note_sealed(e: Entry) -> None:
        """With CHECK_INVARIANTS: remember what a sealed range holds (``_range_copy`` checks it)."""
        if CHECK_INVARIANTS and not e.volatile and e.rng is not None:
            e.sealed_as = chunk.content_key(e.rng.pread(0, e.length))

    def recover_replica(self, key: bytes, rng: Range, length: int) -> None:
        """After a restart: a replica's backing file (checked to hold ``key``) is the chunk again, pinned once."""
        charge = _charge_of(length)
        e = self._entries.get(key)
        if e is not None and (e.resident or e.spilled):
            self.pin(key)
            return
        self.count_recovered(charge)
        self.adopt_range(key, rng, length, charge)

    def count_recovered(self, charge: int) -> None:
        """Count a range a previous run left (recovery), even past the budget: its bytes are there."""
        self.used_bytes += charge

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
                await self._unleased(e)  # a reader maps the range: it must not change under it
                continue
            if e.pins and not e.spilled:
                e.leases += 1  # not evicted (punched) while we wait for the buffer
                try:
                    buf = await self.alloc(_charge_of(e.length))
                finally:
                    self._let_go(e)
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
            self._place(e)
            if e.buf is not None and e.pins and not e.spilled:
                await self._spill_entry(e)  # (a failure is logged there: the buffer still has the bytes)
            return charge, e.key, e.length

    async def _unleased(self, e: Entry) -> None:
        while e.leases:
            await self._lease_returned.wait()

    def _let_go(self, e: Entry) -> None:
        """End one lease of ``e``."""
        e.leases -= 1
        if not e.leases:
            self._lease_returned.set()
            self._lease_returned = trio.Event()
            self._notify_freed()  # it may be evicted now: a waiting writer looks again

    def _punch(self, rng: Range) -> None:
        try:
            rng.punch()
        except OSError as exc:
            log.warning("could not free chunk %d of %s: %s", rng.index, rng.file.path, exc)
        rng.file.area.release(rng.file)

    async def store(self, key: bytes, data, *, into: Range | None = None) -> None:
        """Keep a copy of a verified chunk from elsewhere (a peer's replica), pinned like ``adopt``.

        ``into``: the range of a backing file to keep it in (a replica's
        own file: it then survives a daemon crash), else a buffer.  Waits
        for memory like a writer does: a replica is dirty data too.
        """
        e = self._entries.get(key)
        if e is not None and (e.resident or e.spilled):
            self.pin(key)
            return
        n = len(data)
        charge = _charge_of(n)
        if into is None:
            buf = await self.alloc(charge)
            buf[:n] = data
            self.adopt(key, buf, n)
            return
        await self.reserve(charge)
        e = self._entries.get(key)
        if e is not None and (e.resident or e.spilled):  # the same chunk arrived while we waited
            self.unreserve(charge)
            self.pin(key)
            return
        try:
            into.pwrite(0, data)
        except BaseException:
            self.unreserve(charge)
            self._punch(into)
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
                or old in self._inflight or new in self._entries):
            return False
        self._unindex(e)
        del self._entries[old]
        e.key = new
        self._entries[new] = e
        self._place(e)
        return True

    def pin(self, key: bytes) -> None:
        """Add a not-yet-durable reference to a present chunk."""
        e = self._entries[key]
        e.pins += 1
        self._place(e)

    def unpin(self, key: bytes) -> None:
        """Drop a reference taken by ``adopt``/``pin``; at zero the chunk is clean."""
        e = self._entries.get(key)
        assert e is not None and e.pins > 0, "unpin without pin"
        e.pins -= 1
        if e.pins == 0 and e.spilled:
            self.spill.discard(key)  # durable now: the disk copy is no longer needed
            e.spilled = False
        self._place(e)

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

    def _unindex(self, e: Entry) -> None:
        for index in (self._evictable, self._unspilled):
            if index.get(e.key) is e:
                del index[e.key]
        if self._on_disk.get(e.key) is e:
            del self._on_disk[e.key]
            self._on_disk_bytes -= e.length
        if self._on_disk_pinned.get(e.key) is e:
            del self._on_disk_pinned[e.key]
            self._on_disk_pinned_bytes -= e.length

    def _place(self, e: Entry) -> None:
        """File ``e`` in the right index after any change of its state.

        An entry that left the pool while a task held it (a spill write in
        flight when the kernel changed its range and its last pin went) is
        not filed again, and never takes with it a newer entry of its key.
        """
        self._unindex(e)
        if self._entries.get(e.key) is not e:
            return
        if not e.resident:
            if e.pins == 0 and not e.spilled:
                del self._entries[e.key]
            return
        if e.volatile:
            return  # until steady: the kernel may still change it
        if e.rng is not None and e.rng.file.on_disk:
            assert not e.charge, "a chunk on disk costs no budget"  # (none could evict it to free it)
            # A pinned chunk there survives a daemon crash as it is; with -o spill it is copied to the spill
            # store too (fsynced: a host crash may lose the page cache).  It costs no budget: never evicted.
            if e.pins == 0:
                self._on_disk[e.key] = e
                self._on_disk_bytes += e.length
                self._trim_on_disk(keep=e)
                return
            self._on_disk_pinned[e.key] = e
            self._on_disk_pinned_bytes += e.length
            if self.eager_spill and not e.spilled:
                self._unspilled[e.key] = e
                self._spill_wanted.set()
            return
        if e.pins == 0 or e.spilled:
            self._evictable[e.key] = e
        else:
            self._unspilled[e.key] = e
            self._spill_wanted.set()

    def _evict_one(self) -> bool:
        for _key, e in self._evictable.items():
            # (a range the kernel serves from is its open file's bytes: never punched under it)
            if e.leases == 0 and not (e.rng is not None and e.rng.file.kernel_opens):
                self._drop_memory(e)
                return True
        return False

    def _trim_on_disk(self, keep: Entry | None = None, limit: int | None = None) -> None:
        """Drop the oldest clean chunks on disk while they hold more than ``limit`` (``budget_bytes``).  ``keep``
        (just placed, its caller may still use it), a leased one and one the kernel serves from stay."""
        limit = self.budget_bytes if limit is None else limit
        if self._on_disk_bytes <= limit:
            return
        for e in [e for e in self._on_disk.values()
                  if e is not keep and not e.leases and e.rng is not None and not e.rng.file.kernel_opens]:
            if self._on_disk_bytes <= limit:
                break
            self._drop_memory(e)

    def _drop_memory(self, e: Entry) -> None:
        """Free the memory of an evictable entry (its bytes are durable, or spilled)."""
        buf, rng = e.buf, e.rng
        e.buf = e.rng = None
        charge, e.charge = e.charge, 0
        self._place(e)
        if buf is not None:
            self.release(buf)
        elif rng is not None:
            rng.entry = None
            self._punch(rng)
            self.unreserve(charge)

    def drop_clean(self) -> int:
        """Evict every evictable entry (``aiturbo drop-cache``); returns bytes freed."""
        self._trim_on_disk(limit=0)
        freed = 0
        while True:
            # used_bytes counts the recycled buffers too: what entries held is the rest
            before = self.used_bytes - len(self._free) * CHUNK_BYTES
            if not self._evict_one():
                break
            freed += before - (self.used_bytes - len(self._free) * CHUNK_BYTES)
        while self._free:
            self._free.pop()
            self.used_bytes -= CHUNK_BYTES
        return freed

    # ------------------------------------------------------------------ spill
    async def _spill_one(self) -> bool:
        """Write the oldest unspilled pinned chunk to disk and drop its memory."""
        for _key, e in self._unspilled.items():
            if e.leases == 0:
                break
        else:
            return False
        if not await self._spill_entry(e):
            return False
        return self._evict_one()

    async def _spill_entry(self, e: Entry) -> bool:
        assert e.resident  # only entries in memory are spilled
        view = self._copy(e)
        if view is None:
            return False  # the kernel changed it (a volatile entry is not spilled; checked anyway)
        e.leases += 1
        try:
            await self.spill.write(e.key, view)
        except OSError as exc:
            if not self._spill_failed_logged:
                log.warning("spill to %s failed (%s); writers wait for persist instead", self.spill.directory, exc)
                self._spill_failed_logged = True
            return False
        finally:
            self._let_go(e)
        if e.pins:
            e.spilled = True
        elif not self.pinned(e.key):  # (a newer entry of the key, pinned, may count on the file)
            self.spill.discard(e.key)  # became durable while we wrote it, or left the pool
        self._place(e)
        return True

    async def run_spiller(self) -> None:
        """With ``-o spill``: copy every pinned chunk to disk in the background.

        That makes staged data survive a crash and lets pressure be relieved
        by dropping memory instead of writing under the writer's feet.
        """
        while True:
            await self._spill_wanted.wait()
            self._spill_wanted = trio.Event()
            # eagerly with a spill dir; otherwise while over the budget (bytes the kernel wrote
            # through passthrough are counted after they are there: charge_present)
            while self._unspilled and (self.eager_spill or self.used_bytes > self.budget_bytes):
                if self.eager_spill:
                    done = await self._spill_entry(next(iter(self._unspilled.values())))
                else:
                    done = await self._spill_one()
                if not done:
                    await trio.sleep(1.0)
                    break
                self._notify_freed()

    # ------------------------------------------------------------------ reads
    def has(self, key: bytes) -> bool:
        """Whether the chunk is in memory (no read of it)."""
        e = self._entries.get(key)
        return e is not None and e.resident

    def lends(self, key: bytes) -> bool:
        """Whether ``lease`` of the chunk lends memory the pool holds (a buffer), not a copy."""
        e = self._entries.get(key)
        return e is not None and e.buf is not None

    def view(self, key: bytes, start: int = 0, count: int | None = None):
        """The chunk's bytes ``[start, start + count)`` if in memory (valid until the next await)."""
        e = self._entries.get(key)
        if e is None or not e.resident:
            return None
        if e.rng is not None and (e.volatile or (CHECK_INVARIANTS and start == 0 and count is None)):
            data = self._range_copy(e)  # hashed whole: nothing else says the slice is the key's
            if data is None:
                return None
            v = _slice(data, start, count)
        else:
            v = e.bytes(start, count)  # a buffer's view, or a copy of a sealed range (pread)
        if key in self._evictable:
            self._evictable.move_to_end(key)
        elif key in self._on_disk:
            self._on_disk.move_to_end(key)
        return v

    async def read(self, key: bytes, fetch: Fetch, *, into: Range | None = None, start: int = 0, count: int | None = None):
        """The chunk's bytes ``[start, start + count)`` from memory, the spill store, or ``fetch()``.

        ``fetch`` must return verified bytes (or raise).  Concurrent misses on
        one key are merged into one fetch: every waiter gets its bytes, or
        its error.  The result is cached as a clean entry if memory is free
        without waiting: in ``into`` (the reading file's range) if given.
        The returned bytes are valid until the next await; use ``lease`` to
        hold them longer.
        """
        while True:
            v = self.view(key, start, count)
            if v is not None:
                return v
            pending = self._inflight.get(key)
            if pending is None:
                break
            await pending.done.wait()
            if pending.error is not None:
                raise pending.error
            if pending.data is not None and not self.has(key):
                return _slice(pending.data, start, count)
        flight = self._inflight[key] = _Flight()
        try:
            data = None
            if key in self.spill:
                try:
                    data = await self.spill.read(key)
                except FileNotFoundError:
                    pass  # discarded while we asked (the chunk went durable): from wherever fetch finds it
            if data is None:
                data = await fetch()
        except BaseException as exc:
            if isinstance(exc, Exception):
                flight.error = exc
            raise
        else:
            flight.data = data
            self._cache(key, data, into)
            return _slice(data, start, count)
        finally:
            del self._inflight[key]
            flight.done.set()

    def _cache(self, key: bytes, data, into: Range | None) -> None:
        n = len(data)
        e = self._entries.get(key)
        if e is not None and e.resident:
            return
        if into is not None and into.file.on_disk:
            # a file on disk caches its own chunk there, costing no budget (the on-disk LRU bounds it)
            if into.entry is None and not into.writing and not into.file.kernel_opens:
                try:
                    into.pwrite(0, data)
                except OSError as exc:
                    log.warning("could not cache a chunk in %s: %s", into.file.path, exc)
                    self._punch(into)
                    return
                self.adopt_range(key, into, n, 0, pin=False)
            return
        cap = _charge_of(n)
        if self.used_bytes + cap > self.budget_bytes and not self._evict_one() and not self._free:
            return
        if into is not None and into.entry is None and not into.writing and not into.file.kernel_opens:
            if self.used_bytes + cap > self.budget_bytes:
                if not self._free:
                    return
                self._free.pop()
                self.used_bytes -= CHUNK_BYTES
            self.used_bytes += cap
            try:
                into.pwrite(0, data)
            except OSError as exc:
                self.unreserve(cap)
                log.warning("could not cache a chunk in %s: %s", into.file.path, exc)
                return
            self.adopt_range(key, into, n, cap, pin=False)
            return
        if cap == CHUNK_BYTES and self._free:
            buf = self._free.pop()
        elif self.used_bytes + cap <= self.budget_bytes:
            self.used_bytes += cap
            buf = bytearray(cap)
        else:
            return
        buf[:n] = data
        if e is None:
            e = self._entries[key] = Entry(key, buf, n)
        else:
            e.buf, e.length = buf, n
        e.charge = len(buf)
        self._place(e)

    @asynccontextmanager
    async def lease(self, key: bytes, fetch: Fetch):
        """Like ``read`` but the bytes stay valid inside the ``async with``.

        A chunk in a buffer is lent without a copy (it is neither evicted
        nor recycled meanwhile); one in a range is a copy (``_copy``: the
        range may be punched or, while the kernel may write it, changed, and
        the copy is what hashes to the key).  One fetched but not cached is
        the fetched copy.
        """
        held, view = await self._lend(key, fetch)
        try:
            yield view
        finally:
            if held is not None:
                self._let_go(held)

    async def _lend(self, key: bytes, fetch: Fetch):
        """(the entry now leased, or None; its bytes) for ``lease``."""
        e = self._entries.get(key)
        if e is None or e.buf is None:
            data = await self.read(key, fetch)  # a range's bytes come as a copy; a fetch's as fetched
            e = self._entries.get(key)
            if e is None or e.buf is None:
                return None, data
        e.leases += 1  # a buffer: valid until let go
        return e, memoryview(e.buf)[: e.length]


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


class _Flight:
    """One fetch of a chunk that other readers wait for."""

    __slots__ = ("done", "data", "error")

    def __init__(self):
        self.done = trio.Event()
        self.data = None
        self.error: Exception | None = None


def _unused(rng: Range | None) -> bool:
    """A range of a backing file no file's content holds (and the kernel does not serve)."""
    return rng is not None and rng.file.users == 0 and not rng.file.kernel_opens and rng.file.ino is not None


def _charge_of(n: int) -> int:
    """The budget a sealed chunk of ``n`` bytes counts for: a full chunk, or a small one's power of two."""
    return CHUNK_BYTES if n > CHUNK_BYTES // 2 else max(4096, 1 << max(0, n - 1).bit_length())


def _slice(data, start: int, count: int | None):
    if start == 0 and (count is None or count >= len(data)):
        return memoryview(data)
    return memoryview(data)[start : len(data) if count is None else start + count]
