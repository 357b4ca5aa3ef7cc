"""Names of the chunks of objects imported without a manifest, and what their bytes hash to.

An object another tool put into the bucket has no manifest: nothing says
what its chunks hash to.  Chunk ``i`` of such an object is *named* by the
object's identity, ``external_key(row, i)``, a digest of (backend key,
etag, i): the pool caches it under that name and grouped reads chain it
under that name.  A backend read of a named chunk asks for the etag the name
carries (``if_etag``): an object overwritten in the bucket answers
``SourceChanged`` (ESTALE), never other bytes under an old name, and its
new version has new names.  The node that fetches a named chunk hashes it;
``NamedHashes`` remembers those hashes (bounded, least recently used out).
"""

import collections

from .. import chunk
from .._limits import OBJECT_CHUNK_HASHES_MAX
from ..meta import InodeRow


def external_key(row: InodeRow, index: int) -> bytes:
    """The name of chunk ``index`` of an object imported without a manifest (its backend key, etag and index)."""
    keys = row.backend_keys
    etag = (row.backend_etag or "").encode()
    # surrogateescape: keys of non-UTF-8 names hold lone surrogates
    key = (keys[0] if keys else "").encode("utf-8", "surrogateescape")
    return chunk.digest(b"external\0" + key + b"\0" + etag + b"\0" + str(index).encode())


def external_keys(row: InodeRow) -> list[bytes]:
    """The names of every chunk of ``row``'s object, in order."""
    return [external_key(row, i) for i in range(chunk.chunk_count(row.size))]


class NamedHashes:
    """Name -> BLAKE3 of the chunk's bytes, least recently learned first; at most OBJECT_CHUNK_HASHES_MAX."""

    def __init__(self):
        self._hashes: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()

    def get(self, name: bytes) -> bytes | None:
        return self._hashes.get(name)

    def learn(self, name: bytes, digest: bytes) -> None:
        self._hashes[name] = digest
        self._hashes.move_to_end(name)
        while len(self._hashes) > OBJECT_CHUNK_HASHES_MAX:
            self._hashes.popitem(last=False)
