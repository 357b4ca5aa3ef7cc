"""Objects imported without a manifest: their manifest once every chunk was read here, and its adoption.

The store reads an imported object's chunks by their names and hashes
them (``store._named``: names, ``ChunkStore.read_named``).  Once every
chunk of an object version has its hash on this node, the manifest is
recorded (compare-and-set: only while the row still has that etag and no
manifest), the chunks become dedup sources (cluster), and the pool's
copies take their content keys: later opens, rounds and dedup see an
ordinary file, and a warm pool serves it without a backend read.

It never reads: the reader tells it what a read hashed (``learned``), and
the Filesystem calls ``adopt`` when a row gains a manifest.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from .. import chunk
from .._errors import AiturboError
from .._limits import OBJECT_FILES_TRACKED_MAX
from ..meta import InodeRow
from ..store import external_key
from ._content import Slot

if TYPE_CHECKING:
    from ..cluster import ClusterPort
    from ..meta import MetaStore
    from ..persist import Persister
    from ..staging import StagingPool
    from ._inodes import Inode

log = logging.getLogger(__name__)


class ObjectsHost(Protocol):
    """What the named chunks need of the filesystem."""

    meta: MetaStore
    cluster: ClusterPort
    persister: Persister
    pool: StagingPool

    def spawn(self, fn: Callable[..., Awaitable[None]], *args) -> bool:
        """Run ``fn(*args)`` in the background; False before the filesystem started."""
        ...


class ObjectChunks:
    """Named chunks of imported objects on this node (see module doc)."""

    def __init__(self, fs: ObjectsHost):
        self.fs = fs
        # (ino, etag) -> chunk index -> BLAKE3, until the object is whole here
        self._files: collections.OrderedDict[tuple[int, str], dict[int, bytes]] = collections.OrderedDict()
        self.manifests_recorded = 0  # objects whose manifest this node recorded (status)

    def learned(self, node: Inode, row: InodeRow, index: int, digest: bytes) -> None:
        """A read fetched named chunk ``index`` of ``row``'s object (now in the pool) and hashed it to ``digest``."""
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
        # the caller's bytes are in the pool under their name, for ``adopt``
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
