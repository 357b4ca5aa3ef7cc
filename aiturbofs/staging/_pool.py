"""The DRAM staging pool: a content-addressed chunk store under a byte budget.

The pool owns every large buffer of the daemon:

* *open* buffers, handed out by ``alloc`` to writers filling a chunk;
* *entries*, sealed chunks keyed by their BLAKE3 digest.  An entry is
  **pinned** while some not-yet-durable file references it (dirty data: it may
  be spilled to disk but never dropped) and **clean** otherwise (an LRU read
  cache, evicted first under pressure).  Identical chunks of different files
  share one entry, which is dedup inside one node;
* recycled full-size buffers kept warm, because first-touch page faults halve
  write throughput on these machines.

All of them count against ``budget_bytes``.  When a writer needs memory and
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

from .._errors import NoSpace
from .._limits import CHUNK_BYTES, FREE_BUFFERS_KEPT_MAX, SPILL_WAIT_S, WARM_BUFFERS_TARGET
from .._threads import background
from ._spill import SpillStore

log = logging.getLogger(__name__)

Fetch = Callable[[], Awaitable[bytes]]


class Entry:
    """One sealed chunk: ``buf[:length]`` holds the bytes while in memory."""

    __slots__ = ("key", "buf", "length", "pins", "leases", "spilled")

    def __init__(self, key: bytes, buf: bytearray | None, length: int):
        self.key = key
        self.buf = buf
        self.length = length
        self.pins = 0  # not-yet-durable references: the bytes must not be lost
        self.leases = 0  # readers working outside the trio thread: do not recycle
        self.spilled = False  # a verified copy is in the spill store


@dataclass
class PoolStats:
    budget_bytes: int
    used_bytes: int
    dirty_bytes: int  # pinned entries in memory
    clean_bytes: int  # unpinned entries in memory (read cache)
    open_bytes: int  # buffers of chunks being written
    free_bytes: int  # recycled buffers kept warm
    spilled_bytes: int  # on the spill disk
    pinned_chunks: int
    waiting_writers: int


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
        self._free: list[bytearray] = []
        self._freed = trio.Event()
        self._spill_wanted = trio.Event()
        self._inflight: dict[bytes, trio.Event] = {}
        self._waiting_writers = 0
        self._spill_failed_logged = False
        self._want_warm = trio.Event()
        self._refusal: str | None = None  # why writers that must wait fail instead (refuse_waits)

    # ------------------------------------------------------------------ stats
    def stats(self) -> PoolStats:
        dirty = clean = 0
        for e in self._entries.values():
            if e.buf is not None:
                if e.pins:
                    dirty += len(e.buf)
                else:
                    clean += len(e.buf)
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
        assert 0 < capacity <= CHUNK_BYTES
        waited_s = 0.0
        self._waiting_writers += 1
        try:
            while True:
                if capacity == CHUNK_BYTES and self._free:
                    self._want_warm.set()
                    return self._free.pop()
                if self.used_bytes + capacity <= self.budget_bytes:
                    self.used_bytes += capacity
                    return bytearray(capacity)
                if self._evict_one():
                    continue
                if self._free:
                    self._free.pop()
                    self.used_bytes -= CHUNK_BYTES
                    continue
                if not wait:
                    return None
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

    async def store(self, key: bytes, data) -> None:
        """Keep a copy of a verified chunk from elsewhere (a peer's replica), pinned like ``adopt``.

        Waits for memory like a writer does: a replica is dirty data too.
        """
        e = self._entries.get(key)
        if e is not None and (e.buf is not None or e.spilled):
            self.pin(key)
            return
        n = len(data)
        cap = CHUNK_BYTES if n > CHUNK_BYTES // 2 else max(4096, 1 << max(0, n - 1).bit_length())
        buf = await self.alloc(cap)
        buf[:n] = data
        self.adopt(key, buf, n)

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

    def _place(self, e: Entry) -> None:
        """File ``e`` in the right index after any change of its state."""
        self._evictable.pop(e.key, None)
        self._unspilled.pop(e.key, None)
        if e.buf is None:
            if e.pins == 0 and not e.spilled:
                del self._entries[e.key]
            return
        if e.pins == 0 or e.spilled:
            self._evictable[e.key] = e
        else:
            self._unspilled[e.key] = e
            self._spill_wanted.set()

    def _evict_one(self) -> bool:
        for _key, e in self._evictable.items():
            if e.leases == 0:
                buf, e.buf = e.buf, None
                assert buf is not None  # evictable entries are in memory
                self._place(e)
                self.release(buf)
                return True
        return False

    def drop_clean(self) -> int:
        """Evict every evictable entry (``aiturbo drop-cache``); returns bytes freed."""
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

    # ----------------------------------------------------------------- warmer
    @staticmethod
    def _touched_buffer() -> bytearray:
        buf = bytearray(CHUNK_BYTES)
        buf[::4096] = bytes(CHUNK_BYTES // 4096)  # fault every page in now
        return buf

    async def run_warmer(self) -> None:
        """Keep a few full-size buffers faulted in ahead of the writers.

        First-touch page faults halve write throughput on these machines;
        taking them in a worker thread, while the trio thread serves writes,
        moves that cost off the write path.  Only memory that is free under
        the budget is warmed: warming never evicts or waits.
        """
        while True:
            while (
                len(self._free) < WARM_BUFFERS_TARGET
                and self.used_bytes + CHUNK_BYTES <= self.budget_bytes
                and not self._waiting_writers
            ):
                self.used_bytes += CHUNK_BYTES
                try:
                    buf = await trio.to_thread.run_sync(background, self._touched_buffer)
                except BaseException:
                    self.used_bytes -= CHUNK_BYTES
                    raise
                self._free.append(buf)
            self._want_warm = trio.Event()
            await self._want_warm.wait()

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
        assert e.buf is not None  # only entries in memory are spilled
        e.leases += 1
        try:
            await self.spill.write(e.key, memoryview(e.buf)[: e.length])
        except OSError as exc:
            if not self._spill_failed_logged:
                log.warning("spill to %s failed (%s); writers wait for persist instead", self.spill.directory, exc)
                self._spill_failed_logged = True
            return False
        finally:
            e.leases -= 1
        if e.pins:
            e.spilled = True
        else:
            self.spill.discard(e.key)  # became durable while we wrote it
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
            while self.eager_spill and self._unspilled:
                e = next(iter(self._unspilled.values()))
                if not await self._spill_entry(e):
                    await trio.sleep(1.0)
                    break
                self._notify_freed()

    # ------------------------------------------------------------------ reads
    def view(self, key: bytes) -> memoryview | None:
        """The chunk's bytes if in memory (valid until the next await)."""
        e = self._entries.get(key)
        if e is None or e.buf is None:
            return None
        if key in self._evictable:
            self._evictable.move_to_end(key)
        return memoryview(e.buf)[: e.length]

    async def read(self, key: bytes, fetch: Fetch) -> memoryview:
        """The chunk's bytes from memory, the spill store, or ``fetch()``.

        ``fetch`` must return verified bytes (or raise).  Concurrent misses on
        one key are merged into one fetch.  The result is cached as a clean
        entry if memory is free without waiting.  The returned view is valid
        until the next await; use ``lease`` to hold it longer.
        """
        while True:
            v = self.view(key)
            if v is not None:
                return v
            pending = self._inflight.get(key)
            if pending is None:
                break
            await pending.wait()
        done = self._inflight[key] = trio.Event()
        try:
            if key in self.spill:
                data = await self.spill.read(key)
            else:
                data = await fetch()
            self._cache(key, data)
            return memoryview(data)
        finally:
            del self._inflight[key]
            done.set()

    def _cache(self, key: bytes, data: bytes) -> None:
        cap = CHUNK_BYTES if len(data) > CHUNK_BYTES // 2 else max(4096, 1 << (len(data) - 1).bit_length())
        if self.used_bytes + cap > self.budget_bytes and not (cap == CHUNK_BYTES and self._free):
            if not self._evict_one():
                return
        if cap == CHUNK_BYTES and self._free:
            buf = self._free.pop()
        elif self.used_bytes + cap <= self.budget_bytes:
            self.used_bytes += cap
            buf = bytearray(cap)
        else:
            return
        buf[: len(data)] = data
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry(key, buf, len(data))
        else:
            e.buf, e.length = buf, len(data)
        self._place(e)

    @asynccontextmanager
    async def lease(self, key: bytes, fetch: Fetch):
        """Like ``read`` but the view stays valid inside the ``async with``."""
        view = await self.read(key, fetch)
        e = self._entries.get(key)
        held = e if e is not None and e.buf is not None and view.obj is e.buf else None
        if held is not None:
            held.leases += 1
        try:
            yield view
        finally:
            if held is not None:
                held.leases -= 1
