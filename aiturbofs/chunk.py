"""Chunking and BLAKE3 hashing: the content addresses of file data.

A file is a sequence of fixed-size chunks (``CHUNK_BYTES``); chunk ``i``
covers bytes ``[i * CHUNK_BYTES, (i + 1) * CHUNK_BYTES)``.  A manifest is the
concatenation of the chunks' 32-byte BLAKE3 digests; ``HOLE`` (all zeros)
marks a chunk with no data (never written, or written as zeros: it reads as
zeros, and costs no memory, spill or backend space).  This module owns
that format, the integrity check and the rendezvous order replicas are
placed in without a plan; it does no I/O and imports no other
layer.
"""

import functools
from collections.abc import Iterator, Sequence

import blake3

from ._errors import IntegrityError
from ._limits import (
    CHUNK_BITS,
    CHUNK_BYTES,
    HASH_BYTES,
    ZERO_BLOCK_BYTES,
    ZERO_DIGESTS_CACHED,
    ZERO_SAMPLE_STRIDE_BYTES,
)

HOLE = bytes(HASH_BYTES)
ZERO_BLOCK = bytes(ZERO_BLOCK_BYTES)  # shared, never written: calloc'd zero pages


def digest(data) -> bytes:
    """BLAKE3 of ``data`` (bytes-like).  Releases the GIL for large inputs."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO if len(data) >= (1 << 20) else 1).digest()


def content_key(data) -> bytes:
    """The manifest entry of a chunk's bytes: ``HOLE`` if they are all zeros, else their BLAKE3.

    A chunk written as zeros (``dd if=/dev/zero``) is then a hole like one
    never written.  Cheap for data: the all-zeros test runs only when every
    byte at ZERO_SAMPLE_STRIDE_BYTES is zero, and compares digests.
    """
    key = digest(data)
    view = memoryview(data).cast("B")
    if len(view) and not view[-1] and not any(view[::ZERO_SAMPLE_STRIDE_BYTES]):
        return entry_of(key, len(view))
    return key


def entry_of(key: bytes, length: int) -> bytes:
    """The manifest entry of ``length`` bytes whose BLAKE3 is ``key``: ``HOLE`` if they are zeros."""
    return HOLE if key == zero_digest(length) else key


@functools.lru_cache(maxsize=ZERO_DIGESTS_CACHED)
def zero_digest(length: int) -> bytes:
    """BLAKE3 of ``length`` zero bytes (hashed piecewise: no buffer of that size)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO if length >= (1 << 20) else 1)
    for start in range(0, length, ZERO_BLOCK_BYTES):
        h.update(memoryview(ZERO_BLOCK)[: min(ZERO_BLOCK_BYTES, length - start)])
    return h.digest()


def verify(data, expected: bytes, what: str) -> None:
    """Raise IntegrityError unless ``data`` hashes to ``expected``.

    ``what`` names the chunk's origin for the log line (a path, a spill file).
    """
    actual = digest(data)
    if actual != expected:
        raise IntegrityError(
            f"BLAKE3 mismatch for {what}: expected {expected.hex()[:16]}…, got {actual.hex()[:16]}…"
        )


def chunk_count(size: int) -> int:
    """Number of chunks a file of ``size`` bytes spans."""
    return (size + CHUNK_BYTES - 1) >> CHUNK_BITS


def chunk_length(size: int, index: int) -> int:
    """Bytes of chunk ``index`` that lie inside a file of ``size`` bytes."""
    return max(0, min(CHUNK_BYTES, size - (index << CHUNK_BITS)))


def spans(offset: int, length: int) -> Iterator[tuple[int, int, int, int]]:
    """Split ``[offset, offset+length)`` at chunk borders.

    Yields ``(chunk_index, offset_in_chunk, count, offset_in_request)``.
    """
    done = 0
    while done < length:
        pos = offset + done
        index = pos >> CHUNK_BITS
        start = pos - (index << CHUNK_BITS)
        count = min(CHUNK_BYTES - start, length - done)
        yield index, start, count, done
        done += count


def pack_manifest(hashes: Sequence[bytes]) -> bytes:
    """Join chunk digests (``HOLE`` for holes) into the manifest format."""
    for h in hashes:
        assert len(h) == HASH_BYTES, "chunk digests are 32 bytes"
    return b"".join(hashes)


def unpack_manifest(manifest: bytes) -> list[bytes]:
    """Split a manifest into its chunk digests."""
    assert len(manifest) % HASH_BYTES == 0, "manifest length is a multiple of 32"
    return [manifest[i : i + HASH_BYTES] for i in range(0, len(manifest), HASH_BYTES)]


def rendezvous_order(ino: int, names) -> list[str]:
    """``names`` (nodes) in the rendezvous-hash order of inode ``ino``.

    Where a file's replicas go without a round plan: a node placing its own
    file and the controller topping up replicas in ``--plan dedup`` rounds
    rank nodes the same way, so they agree without talking; stable while
    membership holds, spread over files.
    """
    return sorted(names, key=lambda n: blake3.blake3(f"{ino}/{n}".encode()).digest())
