"""In-memory content of one regular file: its chunk slots.

A slot is in one of three forms:

* **open** — ``buf`` holds the chunk being written (``filled`` bytes are
  initialised; the rest reads as zeros), ``key`` is None;
* **sealed** — ``key`` is the chunk's BLAKE3 digest and the bytes live in the
  staging pool (or spill, or the backend); ``pinned`` says whether this slot
  holds one of the pool's not-yet-durable references;
* **external** — imported from the backend without a hash (``key`` None,
  ``buf`` None): read by range, never verified, hashed when first written.

A ``None`` slot is a hole: it reads as zeros.  This module is pure data: the
Filesystem drives every transition and the pool bookkeeping.
"""

import trio

from .. import chunk
from .._limits import CHUNK_BITS


class Slot:
    __slots__ = ("buf", "filled", "key", "pinned", "seq")

    def __init__(self, *, buf: bytearray | None = None, key: bytes | None = None, pinned: bool = False):
        self.buf = buf
        self.filled = 0
        self.key = key
        self.pinned = pinned
        self.seq = 0  # bumped by every write into the slot

    @property
    def is_open(self) -> bool:
        return self.buf is not None

    @property
    def is_external(self) -> bool:
        return self.buf is None and self.key is None


class FileContent:
    """The chunk slots and size of one file, plus its change counters."""

    __slots__ = ("slots", "size", "seq", "committed_seq", "lock", "broken")

    def __init__(self, size: int = 0):
        self.slots: list[Slot | None] = []
        self.size = size
        self.seq = 0  # bumped by every modification
        self.committed_seq = 0  # ``seq`` covered by the last manifest commit
        self.lock = trio.Lock()  # serialises slot replacement (alloc, CoW)
        self.broken = False

    @property
    def dirty(self) -> bool:
        return self.seq != self.committed_seq

    @classmethod
    def from_manifest(cls, size: int, manifest: bytes | None, *, pinned: bool) -> "FileContent":
        """Slots for a committed file; ``manifest`` None means external chunks."""
        content = cls(size)
        n = chunk.chunk_count(size)
        if manifest is None:
            content.slots = [Slot() for _ in range(n)]
            return content
        keys = chunk.unpack_manifest(manifest)
        assert len(keys) >= n, "manifest covers the file"
        content.slots = [None if k == chunk.HOLE else Slot(key=k, pinned=pinned) for k in keys[:n]]
        return content

    def manifest(self) -> bytes:
        """The manifest of a fully sealed content (no open slots)."""
        keys = []
        for i in range(chunk.chunk_count(self.size)):
            slot = self.slots[i] if i < len(self.slots) else None
            if slot is None:
                keys.append(chunk.HOLE)
            else:
                assert slot.key is not None, "manifest() needs every slot sealed"
                keys.append(slot.key)
        return chunk.pack_manifest(keys)

    def slot_at(self, index: int) -> Slot | None:
        return self.slots[index] if index < len(self.slots) else None

    def ensure_slots(self, index: int) -> None:
        if index >= len(self.slots):
            self.slots.extend([None] * (index + 1 - len(self.slots)))

    def chunk_start(self, index: int) -> int:
        return index << CHUNK_BITS
