"""The pool's byte budget, and how room is made under it.

``Budget`` counts what the pool's memory holds (``used_bytes`` against
``budget_bytes``): reserved ranges, entries' charges, recycled buffers.  It
files every entry by its state (``place``) in the indices that say what may
go under pressure, and makes room for a writer: evicts clean entries, spills
pinned ones (``-o spill``: at once, and in the background with
``run_spiller``), then waits, or fails with ENOSPC after ``refuse_waits``.
Leases (``let_go``) keep an entry from being evicted or recycled.

It owns no entry: the pool's entries by key are shared with it (``place``
drops an entry that has nothing left), and it asks the pool for one thing,
``copy``: an entry's bytes checked to be its key's (``StagingPool._copy``),
which is what a spill writes.  It runs on the trio thread only.
"""

import collections
from collections.abc import Callable
from typing import Literal, overload

import trio

from .._errors import NoSpace
from .._limits import CHUNK_BYTES, FREE_BUFFERS_KEPT_MAX, SPILL_WAIT_S
from ._entry import Entry, log, punch
from ._spill import SpillStore

# An entry's bytes for a reader elsewhere, or None if they are not its key's any more (``StagingPool._copy``).
Copy = Callable[[Entry], memoryview | bytes | None]


class Budget:
    """Bytes counted against ``budget_bytes``; eviction, spilling and waiting writers (see module doc)."""

    def __init__(self, budget_bytes: int, spill: SpillStore, *, eager_spill: bool, entries: dict[bytes, Entry],
                 copy: Copy):
        self.budget_bytes = budget_bytes
        self.spill = spill
        self.eager_spill = eager_spill
        self.used_bytes = 0
        self._entries = entries  # the pool's
        self._copy = copy
        # In-memory entries that may be dropped (unpinned, or safely spilled), LRU first.
        self._evictable: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        # Their charges as filed (every change of a charge files the entry again: ``place``), and the sum:
        # ``free_fraction`` is asked at every open and every persist job, and summing over every
        # clean chunk cached made those O(chunks cached).
        self._evictable_charges: dict[bytes, int] = {}
        self._evictable_bytes = 0
        # In-memory pinned entries with no copy on disk yet, oldest first.
        self._unspilled: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        # Unpinned steady entries in ranges of backing files on disk (a cache costing no budget), LRU first,
        # and the bytes they hold: trimmed to budget_bytes.
        self._on_disk: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self._on_disk_bytes = 0
        # Pinned steady entries there (files the kernel wrote, not yet durable), and their bytes.
        self._on_disk_pinned: dict[bytes, Entry] = {}
        self._on_disk_pinned_bytes = 0
        self.free: list[bytearray] = []  # recycled full-size buffers (counted in used_bytes)
        self._freed = trio.Event()
        # A writer waited SPILL_WAIT_S for persist to free memory, and nothing was freed since: spill at once.
        self._persist_stalled = False
        self._spill_wanted = trio.Event()
        self._lease_returned = trio.Event()
        self.waiting_writers = 0
        self._spill_failed_logged = False
        self._refusal: str | None = None  # why writers that must wait fail instead (refuse_waits)

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
        if capacity == CHUNK_BYTES and self.free:
            return self.free.pop()
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
        self.waiting_writers += 1
        try:
            while True:
                if self.used_bytes + capacity <= self.budget_bytes:
                    self.used_bytes += capacity
                    return True
                if self.evict_one():
                    continue
                if self.free:
                    self.free.pop()
                    self.used_bytes -= CHUNK_BYTES
                    continue
                if not wait:
                    return False
                if (self.eager_spill or self._persist_stalled or waited_s >= SPILL_WAIT_S) and await self._spill_one():
                    continue
                if self._refusal is not None:
                    raise NoSpace(self._refusal)
                if self.eager_spill:
                    self._spill_wanted.set()
                with trio.move_on_after(0.1 if self.eager_spill else SPILL_WAIT_S) as scope:
                    await self._freed.wait()
                if scope.cancelled_caught:
                    waited_s += 0.1 if self.eager_spill else SPILL_WAIT_S
                    # Nothing freed in that time: what is pinned is the open files' own (persist starts at
                    # close).  The writers after this one spill at once instead of waiting again for each
                    # chunk, until persist frees a chunk (``note_unpinned``).
                    self._persist_stalled = True
        finally:
            self.waiting_writers -= 1

    def note_unpinned(self) -> None:
        """A chunk lost its last pin (its bytes are durable): persist frees memory, writers wait for it again."""
        self._persist_stalled = False

    def unreserve(self, charge: int) -> None:
        """Give back bytes counted by ``reserve``."""
        if charge:
            self.used_bytes -= charge
            self.notify_freed()

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
        self.notify_freed()

    def accept_waits(self) -> None:
        """Undo ``refuse_waits``: writers wait for memory again."""
        if self._refusal is not None:
            log.info("the backend takes data again: writers wait for memory again instead of ENOSPC")
        self._refusal = None

    def release(self, buf: bytearray) -> None:
        """Give back a buffer from ``alloc`` that was not adopted."""
        if len(buf) == CHUNK_BYTES and len(self.free) < FREE_BUFFERS_KEPT_MAX:
            self.free.append(buf)
        else:
            self.used_bytes -= len(buf)
        self.notify_freed()

    def notify_freed(self) -> None:
        """Wake the writers waiting for memory: they look again."""
        self._freed.set()
        self._freed = trio.Event()

    # ------------------------------------------------ bytes already there
    def charge_present(self, charge: int) -> None:
        """Count bytes that are there already (written by the kernel, or left by a previous run), even past
        the budget; clean entries make room at once and the spiller is woken for the rest."""
        self.used_bytes += charge
        while self.used_bytes > self.budget_bytes and self.evict_one():
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
        return max(0.0, self.budget_bytes - self.used_bytes + self._evictable_bytes) / self.budget_bytes

    def count_recovered(self, charge: int) -> None:
        """Count a range a previous run left (recovery), even past the budget: its bytes are there."""
        self.used_bytes += charge

    # ---------------------------------------------------------------- leases
    async def unleased(self, e: Entry) -> None:
        """Wait until no one holds a lease of ``e``."""
        while e.leases:
            await self._lease_returned.wait()

    def let_go(self, e: Entry) -> None:
        """End one lease of ``e``."""
        e.leases -= 1
        if not e.leases:
            for buf in e.lent:
                self.release(buf)  # (a copy the entry no longer counts on)
            e.lent.clear()
            self._lease_returned.set()
            self._lease_returned = trio.Event()
            self.notify_freed()  # it may be evicted now: a waiting writer looks again

    # ---------------------------------------------------------------- indices
    def unindex(self, e: Entry) -> None:
        """Take ``e`` out of every index (``place`` files it again)."""
        if self._evictable.get(e.key) is e:
            del self._evictable[e.key]
            self._evictable_bytes -= self._evictable_charges.pop(e.key)
        if self._unspilled.get(e.key) is e:
            del self._unspilled[e.key]
        if self._on_disk.get(e.key) is e:
            del self._on_disk[e.key]
            self._on_disk_bytes -= e.length
        if self._on_disk_pinned.get(e.key) is e:
            del self._on_disk_pinned[e.key]
            self._on_disk_pinned_bytes -= e.length

    def place(self, e: Entry) -> None:
        """File ``e`` in the right index after any change of its state.

        An entry that left the pool while a task held it (a spill write in
        flight when the kernel changed its range and its last pin went) is
        not filed again, and never takes with it a newer entry of its key.
        """
        self.unindex(e)
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
            self._evictable_bytes += e.charge - self._evictable_charges.get(e.key, 0)
            self._evictable_charges[e.key] = e.charge
        else:
            self._unspilled[e.key] = e
            self._spill_wanted.set()

    def touch(self, key: bytes) -> None:
        """A clean entry was read: last in its LRU."""
        if key in self._evictable:
            self._evictable.move_to_end(key)
        elif key in self._on_disk:
            self._on_disk.move_to_end(key)

    # ---------------------------------------------------------------- eviction
    def evict_one(self) -> bool:
        """Drop the memory of the least recently used evictable entry; False if none may go."""
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
        self.place(e)
        if buf is not None:
            self.release(buf)
        elif rng is not None:
            rng.entry = None
            punch(rng)
            self.unreserve(charge)

    def drop_clean(self) -> int:
        """Evict every evictable entry (``aiturbo drop-cache``); returns bytes freed."""
        self._trim_on_disk(limit=0)
        freed = 0
        while True:
            # used_bytes counts the recycled buffers too: what entries held is the rest
            before = self.used_bytes - len(self.free) * CHUNK_BYTES
            if not self.evict_one():
                break
            freed += before - (self.used_bytes - len(self.free) * CHUNK_BYTES)
        while self.free:
            self.free.pop()
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
        if not await self.spill_entry(e):
            return False
        return self.evict_one()

    async def spill_entry(self, e: Entry) -> bool:
        """Write ``e``'s bytes to the spill store (a pinned one is ``spilled`` then); False if that failed."""
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
            self.let_go(e)
        if e.pins:
            e.spilled = True
        elif not self._pinned(e.key):  # (a newer entry of the key, pinned, may count on the file)
            self.spill.discard(e.key)  # became durable while we wrote it, or left the pool
        self.place(e)
        return True

    def _pinned(self, key: bytes) -> bool:
        e = self._entries.get(key)
        return e is not None and e.pins > 0

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
                    done = await self.spill_entry(next(iter(self._unspilled.values())))
                else:
                    done = await self._spill_one()
                if not done:
                    await trio.sleep(1.0)
                    break
                self.notify_freed()
