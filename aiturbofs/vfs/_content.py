"""The content of one regular file: its chunk slots and its backing file.

Chunk ``i``'s bytes, when they are on this node, are range ``i`` of the
file's backing file (``staging._backing``).  A slot is in one of three forms:

* **open** — the range holds the chunk being written; ``charge`` bytes of the
  pool's budget are reserved for it; ``filled`` bytes are initialised and the
  rest reads as zeros (the range past ``filled`` is a hole); ``key`` is None;
* **sealed** — ``key`` is the chunk's BLAKE3 digest and the bytes are the
  pool's entry of that key (in this file's range, another file's, a buffer,
  spill, or only the backend); ``pinned`` says whether this slot holds one of
  the pool's not-yet-durable references: a chunk sealed since the last
  commit.  A commit hands those pins to the version's ``VersionPins``;
* **external** — imported from the backend without a manifest (``key`` None,
  not open): read by its chunk's name (``_objects``), hashed when fetched;
  the slot becomes sealed once the object's manifest is recorded (or when
  the file is first written).

A ``None`` slot is a hole: it reads as zeros.  This module is data, and the
three steps on a content's backing file every layer above uses; the writer
drives every transition and the pool bookkeeping.
"""

import logging

import trio

from .. import chunk
from .._limits import CHUNK_BITS
from ..staging import BackingArea, BackingFile, Pins, Range

log = logging.getLogger(__name__)


class VersionPins:
    """The pool pins of one committed version: released once, when a version at
    least as new is durable, or this one is broken, or the file is dropped.

    The persister may be uploading that version, so its chunks must stay in
    memory (or spill) until then, even if the file's slots are written again.
    """

    __slots__ = ("version", "pins")

    def __init__(self, version: int, pins: Pins):
        self.version = version
        self.pins = pins


class Slot:
    __slots__ = ("charge", "filled", "key", "pinned", "seq")

    def __init__(self, *, key: bytes | None = None, pinned: bool = False, charge: int = 0):
        self.charge = charge
        self.filled = 0
        self.key = key
        self.pinned = pinned
        self.seq = 0  # bumped by every write into the slot

    @property
    def is_open(self) -> bool:
        return self.charge > 0

    @property
    def is_external(self) -> bool:
        return self.charge == 0 and self.key is None


class FileContent:
    """The chunk slots and size of one file, plus its change counters."""

    __slots__ = ("slots", "size", "seq", "committed_seq", "lock", "broken", "backing", "committing", "absorbed",
                 "kernel_charged", "kernel_rdwr", "kernel_behind")

    def __init__(self, size: int = 0):
        self.slots: list[Slot | None] = []
        # While a commit is in flight: pins of sealed slots freed meanwhile,
        # which the manifest being committed may name (they join its VersionPins).
        self.committing: list[bytes] | None = None
        self.backing: BackingFile | None = None  # set by the Filesystem on first use
        self.size = size
        self.seq = 0  # bumped by every modification
        self.committed_seq = 0  # ``seq`` covered by the last manifest commit
        self.lock = trio.Lock()  # serialises slot replacement (alloc, CoW)
        self.broken = False
        # (size, mtime, ctime) of the backing file when the kernel's writes were last taken in (_kernel_io):
        # while it is the same, getattr answers the row's mtime (a utimensat since then stands)
        self.absorbed: tuple[int, int, int] | None = None
        self.kernel_charged = 0  # pool bytes counted for what the kernel wrote and no slot counts yet
        # a passthrough writer opened O_RDWR since the last check (it may have written through a shared
        # mapping, which changes no time stamp; O_WRONLY and O_RDONLY opens cannot map for writing), or
        # two at once: the release then hashes every chunk again
        self.kernel_rdwr = False
        # the content of a newer version than the bytes of its backing file, which the kernel serves to
        # descriptors open on the older one: they are put there before another open joins them (_kernel_io)
        self.kernel_behind = False

    @property
    def dirty(self) -> bool:
        return self.seq != self.committed_seq

    @classmethod
    def from_manifest(cls, size: int, manifest: bytes | None) -> "FileContent":
        """Slots for a committed file (they hold no pins); ``manifest`` None means external chunks."""
        content = cls(size)
        n = chunk.chunk_count(size)
        if manifest is None:
            content.slots = [Slot() for _ in range(n)]
            return content
        keys = chunk.unpack_manifest(manifest)
        assert len(keys) >= n, "manifest covers the file"
        content.slots = [None if k == chunk.HOLE else Slot(key=k) for k in keys[:n]]
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

    def range(self, index: int) -> Range:
        """Chunk ``index``'s range of the backing file (the Filesystem sets ``backing`` first)."""
        assert self.backing is not None, "content without a backing file"
        return self.backing.range(index)


def backing_of(staging: BackingArea, ino: int, content: FileContent) -> BackingFile:
    """The content's backing file (inode ``ino``'s current one, taken on first use)."""
    if content.backing is None:
        content.backing = staging.current(ino)
        content.backing.users += 1
    return content.backing


def let_go(staging: BackingArea, content: FileContent) -> None:
    """The content no longer uses its backing file (the pool's entries there may)."""
    backing, content.backing = content.backing, None
    if backing is not None:
        backing.users -= 1
        staging.release(backing)


def punch(rng: Range) -> None:
    """Free a range's memory; a failure is logged (the bytes there are no one's)."""
    try:
        rng.punch()
    except OSError as exc:
        log.warning("could not free chunk %d of %s: %s", rng.index, rng.file.path, exc)
