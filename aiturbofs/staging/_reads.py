"""Reads of the pool's chunks: views, leases, and one fetch per missed key.

``Reads`` answers a read from the pool's entries, else the spill store,
else the caller's ``fetch`` coroutine; concurrent misses of one key wait for
one fetch (a ``_Flight``), and what was fetched is cached as a clean entry if
memory is free without waiting.  It asks the pool for two things: a range
entry's bytes checked to be its key's (``StagingPool._range_copy``), and a
range adopted as a clean entry (``StagingPool.adopt_range``); memory comes
from the ``Budget``.  It runs on the trio thread only.
"""

from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

import trio

from .._limits import CHECK_INVARIANTS, CHUNK_BYTES
from ._backing import Range
from ._budget import Budget
from ._entry import Entry, charge_of, log, punch
from ._spill import SpillStore

Fetch = Callable[[], Awaitable[bytes]]
# A range entry's bytes, or None if they are not its key's any more (``StagingPool._range_copy``).
RangeCopy = Callable[[Entry], bytes | None]
# Seal a range's first ``length`` bytes as the clean entry ``key`` with ``charge`` (``StagingPool.adopt_range``).
AdoptClean = Callable[[bytes, Range, int, int], None]


class Reads:
    """The pool's read path: ``view``, ``read`` and ``lease`` (see module doc)."""

    def __init__(self, entries: dict[bytes, Entry], budget: Budget, spill: SpillStore, *,
                 range_copy: RangeCopy, adopt_clean: AdoptClean):
        self._entries = entries  # the pool's
        self._budget = budget
        self.spill = spill
        self._range_copy = range_copy
        self._adopt_clean = adopt_clean
        self._inflight: dict[bytes, _Flight] = {}

    def fetching(self, key: bytes) -> bool:
        """Whether a fetch of ``key`` is in flight."""
        return key in self._inflight

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
        self._budget.touch(key)
        return v

    async def read(self, key: bytes, fetch: Fetch, *, into: Range | None = None, start: int = 0, count: int | None = None):
        """The chunk's bytes ``[start, start + count)`` from memory, the spill store, or ``fetch()``.

        ``fetch`` must return verified bytes (or raise).  Concurrent misses on
        one key are merged into one fetch: every waiter gets its bytes; if it
        fails, each waiter runs its own ``fetch`` (each caller's names its own
        source: one caller's error says nothing of another's).  The result is cached as a clean entry if memory is free
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
            if pending.data is None:
                # That fetch failed, and its error was its caller's (its source, its slot): this
                # caller tries its own, beside the other waiters (not one after another).
                data = await self._load(key, fetch)
                self._cache(key, data, into)
                return _slice(data, start, count)
            if not self.has(key):
                return _slice(pending.data, start, count)
        flight = self._inflight[key] = _Flight()
        try:
            data = flight.data = await self._load(key, fetch)
            self._cache(key, data, into)
        finally:
            del self._inflight[key]
            flight.done.set()
        return _slice(data, start, count)

    async def _load(self, key: bytes, fetch: Fetch):
        """The chunk from the spill store, else ``fetch()``."""
        if key in self.spill:
            try:
                return await self.spill.read(key)
            except FileNotFoundError:
                pass  # discarded while we asked (the chunk went durable): from wherever fetch finds it
        return await fetch()

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
                    punch(into)
                    return
                self._adopt_clean(key, into, n, 0)
            return
        budget = self._budget
        cap = charge_of(n)
        if budget.used_bytes + cap > budget.budget_bytes and not budget.evict_one() and not budget.free:
            return
        if into is not None and into.entry is None and not into.writing and not into.file.kernel_opens:
            if budget.used_bytes + cap > budget.budget_bytes:
                if not budget.free:
                    return
                budget.free.pop()
                budget.used_bytes -= CHUNK_BYTES
            budget.used_bytes += cap
            try:
                into.pwrite(0, data)
            except OSError as exc:
                budget.unreserve(cap)
                log.warning("could not cache a chunk in %s: %s", into.file.path, exc)
                return
            self._adopt_clean(key, into, n, cap)
            return
        if cap == CHUNK_BYTES and budget.free:
            buf = budget.free.pop()
        elif budget.used_bytes + cap <= budget.budget_bytes:
            budget.used_bytes += cap
            buf = bytearray(cap)
        else:
            return
        buf[:n] = data
        if e is None:
            e = self._entries[key] = Entry(key, buf, n)
        else:
            e.buf, e.length = buf, n
        e.charge = len(buf)
        budget.place(e)

    @asynccontextmanager
    async def lease(self, key: bytes, fetch: Fetch):
        """Like ``read`` but the bytes stay valid inside the ``async with``.

        A chunk in a buffer is lent without a copy (it is neither evicted
        nor recycled meanwhile); one in a range is a copy (``StagingPool._copy``: the
        range may be punched or, while the kernel may write it, changed, and
        the copy is what hashes to the key).  One fetched but not cached is
        the fetched copy.
        """
        held, view = await self._lend(key, fetch)
        try:
            yield view
        finally:
            if held is not None:
                self._budget.let_go(held)

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


class _Flight:
    """One fetch of a chunk that other readers wait for (``data`` stays None if it failed)."""

    __slots__ = ("done", "data")

    def __init__(self):
        self.done = trio.Event()
        self.data = None


def _slice(data, start: int, count: int | None):
    if start == 0 and (count is None or count >= len(data)):
        return memoryview(data)
    return memoryview(data)[start : len(data) if count is None else start + count]
