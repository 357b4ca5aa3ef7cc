"""Chunks of objects imported without a manifest: their names, their BLAKE3 once read, the manifest once whole.

An object another tool put into the bucket has no manifest: nothing says
what its chunks hash to.  Chunk ``i`` of such an object is *named* by the
object's identity, ``external_key(row, i)``, a digest of (backend key,
etag, i): the pool caches it under that name and grouped reads chain it
under that name.  The node that fetches a named chunk from the backend
hashes it (BLAKE3, in a worker thread), and a chain passes that hash along
with the bytes, so every receiver verifies them (``fabric``: the reply's key
is the content hash).  A backend read of a named chunk asks for the etag the
name carries (``if_etag``): an object overwritten in the bucket answers
``SourceChanged`` (ESTALE), never other bytes under an old name, and its new
version has new names.

Once every chunk of an object version has its hash on this node, the
manifest is recorded (compare-and-set: only while the row still has that
etag and no manifest), the chunks become dedup sources (cluster), and the
pool's copies take their content keys: later opens, rounds and dedup see
an ordinary file, and a warm pool serves it without a backend read.

It never decides what to read: the Filesystem calls ``fetch`` for a named
chunk it misses and ``adopt`` when a row gains a manifest.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import trio

from .. import chunk
from .._errors import AiturboError, BrokenFile, SourceChanged
from .._limits import CHUNK_BYTES, OBJECT_CHUNK_HASHES_MAX, OBJECT_FILES_TRACKED_MAX
from .._threads import background
from ..meta import InodeRow
from ._content import Slot

if TYPE_CHECKING:
    from ..cluster import ClusterPort
    from ..meta import MetaStore
    from ..persist import Persister
    from ..staging import StagingPool
    from ._fetch import ChunkFetcher
    from ._inodes import Inode

log = logging.getLogger(__name__)


class ObjectsHost(Protocol):
    """What the named chunks need of the filesystem."""

    meta: MetaStore
    cluster: ClusterPort
    fetcher: ChunkFetcher
    persister: Persister
    pool: StagingPool

    def spawn(self, fn: Callable[..., Awaitable[None]], *args) -> bool:
        """Run ``fn(*args)`` in the background; False before the filesystem started."""
        ...

    def record_error(self, message: str, event: str | None = None) -> None:
        """An operating error, for the log and ``aiturbo status``."""


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


class ObjectChunks:
    """Named chunks of imported objects on this node (see module doc)."""

    def __init__(self, fs: ObjectsHost):
        self.fs = fs
        # name -> BLAKE3 of the chunk's bytes, least recently used first; bounded (a pool's worth and more)
        self._hashes: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        # (ino, etag) -> chunk index -> BLAKE3, until the object is whole here
        self._files: collections.OrderedDict[tuple[int, str], dict[int, bytes]] = collections.OrderedDict()
        self.manifests_recorded = 0  # objects whose manifest this node recorded (status)

    def content_key(self, name: bytes) -> bytes | None:
        """The BLAKE3 of the named chunk's bytes, if this node has read it."""
        return self._hashes.get(name)

    async def fetch(self, node: Inode, index: int, length: int) -> bytes:
        """Named chunk ``index`` of ``node``'s object: from its read chain's predecessor, else the backend.

        Verified against the hash the chain carried, or hashed here; raises
        ``SourceChanged`` when the object is no longer the version imported.
        """
        fs = self.fs
        row = node.row
        name = external_key(row, index)
        got = await fs.cluster.round_fetch_named(node.ino, name)
        if got is not None:
            digest, data = got
        else:
            keys = row.backend_keys
            if not keys:
                raise BrokenFile(f"inode {node.ino} has no data in the backend")
            try:
                data = await fs.fetcher.read_range(keys[0], index * CHUNK_BYTES, length, if_etag=row.backend_etag)
            except SourceChanged as exc:
                fs.record_error(f"{keys[0]} changed in the backend since it was imported: {exc}")
                raise
            if len(data) != length:
                raise BrokenFile(f"{keys[0]} is shorter than expected (changed in the backend?)")
            fs.fetcher.bytes_fetched += length
            digest = await trio.to_thread.run_sync(background, chunk.digest, data)
        self._learned(node, row, index, name, digest)
        return data

    def _learned(self, node: Inode, row: InodeRow, index: int, name: bytes, digest: bytes) -> None:
        self._hashes[name] = digest
        self._hashes.move_to_end(name)
        while len(self._hashes) > OBJECT_CHUNK_HASHES_MAX:
            self._hashes.popitem(last=False)
        etag = row.backend_etag
        if etag is None or row.manifest is not None:
            return
        file_key = (node.ino, etag)
        known = self._files.setdefault(file_key, {})
        self._files.move_to_end(file_key)
        while len(self._files) > OBJECT_FILES_TRACKED_MAX:
            self._files.popitem(last=False)
        known[index] = digest
        count = chunk.chunk_count(row.size)
        if len(known) < count:
            return
        del self._files[file_key]
        entries = [chunk.entry_of(known[i], chunk.chunk_length(row.size, i)) for i in range(count)]
        # after the caller's fetch is done and its bytes are in the pool under their name, for ``adopt``
        self.fs.spawn(self._record, node, row, chunk.pack_manifest(entries))

    async def _record(self, node: Inode, row: InodeRow, manifest: bytes) -> None:
        """The object is whole here: record its manifest (unless its row moved on) and adopt it."""
        try:
            await self._record_and_adopt(node, row, manifest)
        except AiturboError as exc:  # the metadata engine: the next whole read tries again
            log.warning("manifest of inode %d not recorded: %s", node.ino, exc)

    async def _record_and_adopt(self, node: Inode, row: InodeRow, manifest: bytes) -> None:
        fs = self.fs
        etag = row.backend_etag
        assert etag is not None  # see _learned
        if await fs.meta.set_manifest_if(node.ino, manifest, etag=etag):
            self.manifests_recorded += 1
            log.info("object_hashed key=%s etag=%s chunks=%d (manifest recorded)",
                     row.backend_keys[0] if row.backend_keys else "", etag, chunk.chunk_count(row.size))
            if fs.cluster.shared and row.backend_keys:
                recorded = dataclasses.replace(row, manifest=manifest)
                await fs.persister.uploads.record_sources(recorded, row.backend_keys[0], etag)
        latest = await fs.meta.get_inode(node.ino)
        if latest.manifest == manifest and latest.backend_etag == etag:
            self.adopt(node, latest)  # recorded here or by another reader of the same version

    def adopt(self, node: Inode, latest: InodeRow) -> None:
        """``latest`` gave the object version ``node`` holds a manifest: its slots and pool copies take the content keys.

        Called by the node that recorded it (or found it recorded), and by
        ``open`` on a node whose content is still the named one.
        """
        assert latest.manifest is not None and latest.backend_etag is not None
        keys = chunk.unpack_manifest(latest.manifest)
        pool = self.fs.pool
        content = node.content
        slots = content.slots if content is not None and not content.dirty and content.size == latest.size else []
        for i, key in enumerate(keys):
            name = external_key(latest, i)  # the names this version's chunks were read under
            if key != chunk.HOLE and not pool.rename(name, key) and pool.has(name) and not pool.has(key):
                continue  # its copy could not move (a fetch of it is in flight): the slot keeps reading it by name
            slot = slots[i] if i < len(slots) else None
            if slot is not None and slot.is_external:
                slots[i] = None if key == chunk.HOLE else Slot(key=key)
        row = node.row
        if row.manifest is None and row.backend_etag == latest.backend_etag and row.size == latest.size:
            row.manifest = latest.manifest
