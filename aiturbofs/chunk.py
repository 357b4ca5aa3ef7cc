"""Chunking and BLAKE3 hashing: the content addresses of file data.

A file is a sequence of fixed-size chunks (``CHUNK_BYTES``); chunk ``i``
covers bytes ``[i * CHUNK_BYTES, (i + 1) * CHUNK_BYTES)``.  A manifest is the
concatenation of the chunks' 32-byte BLAKE3 digests; ``HOLE`` (all zeros)
marks a chunk that was never written (it reads as zeros).  This module owns
that format, the integrity check and the rendezvous order replicas are
placed in without a plan; it does no I/O and imports no other
layer.
"""

from collections.abc import Iterator, Sequence

import blake3

from ._errors import IntegrityError
from ._limits import CHUNK_BITS, CHUNK_BYTES, HASH_BYTES

HOLE = bytes(HASH_BYTES)


def digest(data) -> bytes:
    """BLAKE3 of ``data`` (bytes-like).  Releases the GIL for large inputs."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO if len(data) >= (1 << 20) else 1).digest()


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
