"""A pool entry (one sealed chunk) and the small helpers every part of the pool uses on entries and ranges."""

import logging

from .._limits import CHUNK_BYTES
from ._backing import Range

# The pool's logger: its parts (``_pool``, ``_budget``, ``_reads``) log under one name, as when they were one module.
log = logging.getLogger("aiturbofs.staging._pool")


class Entry:
    """One sealed chunk, in memory as ``buf[:length]`` or as a backing file's range ``rng``."""

    __slots__ = ("key", "buf", "rng", "length", "charge", "pins", "leases", "lent", "spilled", "volatile", "sealed_as")

    def __init__(self, key: bytes, buf: bytearray | None, length: int):
        self.key = key
        self.buf = buf
        self.rng: Range | None = None  # the chunk's range of a file's backing file
        self.length = length
        self.charge = len(buf) if buf is not None else 0  # budget bytes its memory counts for
        self.pins = 0  # not-yet-durable references: the bytes must not be lost
        self.leases = 0  # readers working outside the trio thread: do not recycle
        # Buffers that were the chunk's copy until a range became its home while readers held them
        # (``StagingPool.adopt_range``): given back to the pool when the last lease ends.
        self.lent: list[bytearray] = []
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


def charge_of(n: int) -> int:
    """The budget a sealed chunk of ``n`` bytes counts for: a full chunk, or a small one's power of two."""
    return CHUNK_BYTES if n > CHUNK_BYTES // 2 else max(4096, 1 << max(0, n - 1).bit_length())


def punch(rng: Range) -> None:
    """Hole-punch ``rng`` (its memory goes back), then let its backing file go if nothing uses it any more."""
    try:
        rng.punch()
    except OSError as exc:
        log.warning("could not free chunk %d of %s: %s", rng.index, rng.file.path, exc)
    rng.file.area.release(rng.file)
