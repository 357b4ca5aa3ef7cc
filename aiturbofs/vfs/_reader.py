"""The read path: a file's bytes from its slots, the pool, peers or the backend.

A read walks open slot -> the chunk store (``store``: the pool's backing
files, buffers and spill, then its read round's chain predecessor, the
holders' DRAM, the backend, verified against the chunk hash), and keeps
what it fetched in the reading file's backing file.  A sequential reader
gets the next chunks fetched ahead of it.  Files imported from the backend
without a manifest are read by the names of their chunks (``store._named``),
and what those hash to goes to ``_objects``.
"""

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import replace

from .. import chunk
from .._errors import AiturboError, BackendUnavailable, BrokenFile, NoDataAfter, TransientBackendError
from .._limits import AUTOGROUP_BYTES_MIN, CHUNK_BITS, CHUNK_BYTES, PREFETCH_TASKS_MAX, READ_AHEAD_CHUNKS
from ..cluster import ClusterPort, ReadRequest
from ..meta import STATE_BROKEN, STATE_DURABLE, InodeRow, MetaStore
from ..staging import BackingArea, Range
from ..store import ChunkStore, external_key, external_keys
from ._content import FileContent, Slot, backing_of
from ._inodes import Handle, Inode, InodeTable
from ._kernel_io import kernel_attrs
from ._objects import ObjectChunks
from ._options import VfsOptions

log = logging.getLogger(__name__)


class Reader:
    """Reads of open files, read-ahead, and chunks asked for by the cluster (see module doc)."""

    def __init__(self, table: InodeTable, meta: MetaStore, store: ChunkStore, staging: BackingArea,
                 cluster: ClusterPort, options: VfsOptions, objects: ObjectChunks, *,
                 spawn: Callable[..., bool], record_error: Callable[[str], None]):
        self._table = table
        self._meta = meta
        self._store = store
        self._staging = staging
        self._cluster = cluster
        self._options = options
        self._objects = objects
        self._spawn = spawn
        self._record_error = record_error
        self._prefetching: set[bytes] = set()

    async def read(self, handle: Handle, offset: int, size: int):
        node = handle.inode
        content = node.file
        if node.row.state == STATE_BROKEN and not content.dirty:
            raise BrokenFile(f"inode {node.ino} is broken")
        end = min(offset + size, content.size)
        if offset >= end:
            return b""
        if offset == handle.next_offset and not content.dirty:
            self._read_ahead(node, content, (end - 1) // CHUNK_BYTES)
        handle.next_offset = end
        spans = list(chunk.spans(offset, end - offset))
        if len(spans) == 1:  # the view goes to the kernel before anything else runs: no copy
            return await self._read_span(node, content, *spans[0][:3])
        # A span's view is valid only until the next await: the next span's fetch
        # may evict its chunk and reuse the buffer (or a truncate free an open
        # one), so each span is copied out before the next one is read.
        out = bytearray(end - offset)
        at = 0
        for index, start, count, _ in spans:
            out[at : at + count] = await self._read_span(node, content, index, start, count)
            at += count
        return out

    async def _read_span(self, node: Inode, content: FileContent, index: int, start: int, count: int):
        """Bytes ``start:start+count`` of chunk ``index``; valid until the next await."""
        slot = content.slot_at(index)
        if slot is None:
            return bytes(count)
        if slot.is_open:
            return content.range(index).pread(start, count)  # past ``filled`` the range is a hole: zeros
        return await self.read_slot(node, index, slot, chunk.chunk_length(content.size, index), start=start, count=count,
                                    content=content)

    def _read_ahead(self, node: Inode, content: FileContent, last: int) -> None:
        """A sequential reader: fetch the next chunks into the pool while it reads this one."""
        for index in range(last + 1, min(last + 1 + READ_AHEAD_CHUNKS, chunk.chunk_count(content.size))):
            slot = content.slot_at(index)
            if slot is None or slot.is_open:
                continue
            key = self.cache_key(node, index, slot)
            if key in self._prefetching or self._store.pool.has(key) or len(self._prefetching) >= PREFETCH_TASKS_MAX:
                continue
            self._prefetching.add(key)
            if not self._spawn(self._prefetch, node, content, index, slot.key is None, key,
                               chunk.chunk_length(content.size, index)):
                self._prefetching.discard(key)  # not started yet: the reader fetches it itself

    async def read_chunk(self, ino: int, index: int, key: bytes, length: int) -> bytes:
        """Chunk ``key`` (chunk ``index`` of ``ino``) for the cluster: a read round's prefetch, a chain successor.

        Fetched as a reader fetches it, and kept in the file's backing file
        while the file is open here with that chunk (else in a pool buffer).
        ``key`` may be the name of an imported object's chunk (``_objects``).
        """
        node = self._table.get(ino)
        content = node.content if node is not None else None
        slot = content.slot_at(index) if content is not None else None
        if (node is not None and content is not None and slot is not None and node.row.backend_etag is not None
                and external_key(node.row, index) == key):
            if slot.is_external:
                named_into = backing_of(self._staging, ino, content).range(index)
                return bytes(await self.read_external(node, index, length, into=named_into))
            if slot.key is not None:
                key = slot.key  # hashed meanwhile (``_objects.adopt``): the same bytes, under their content key
        into = backing_of(self._staging, ino, content).range(index) if node and content and slot and slot.key == key \
            else None
        row = node.row if node is not None else None
        data = await self._store.read(ino, index, key, length, row, into=into)
        return bytes(data)

    async def _prefetch(self, node: Inode, content: FileContent, index: int, named: bool, key: bytes, length: int) -> None:
        try:
            into = backing_of(self._staging, node.ino, content).range(index) if node.content is content else None
            if named:  # an imported object's chunk (``_objects``)
                await self._read_named(node, index, length, into=into, count=0)
            else:
                await self._store.read(node.ino, index, key, length, node.row, into=into, count=0)
        except AiturboError as exc:  # the reader will fetch (and report) it itself
            log.debug("read-ahead of inode %d chunk %d: %s", node.ino, index, exc)
        finally:
            self._prefetching.discard(key)

    async def read_slot(self, node: Inode, index: int, slot: Slot, length: int, *, start: int = 0,
                        count: int | None = None, cache: bool = True, content: FileContent | None = None):
        """Bytes ``start:start+count`` of a sealed or external slot (valid until the next await).

        ``content``: the content the slot is of (default: the node's).  With
        ``cache`` a chunk fetched from elsewhere is kept in the file's range
        (a clean entry the pool may evict), unless that content has been
        replaced by a newer version meanwhile.
        """
        if content is None:
            content = node.content
        into = backing_of(self._staging, node.ino, content).range(index) if cache and content is not None \
            and content is node.content else None
        if slot.key is None:
            return await self.read_external(node, index, length, into=into, start=start, count=count)
        try:
            return await self._store.read(node.ino, index, slot.key, length, node.row, into=into, start=start,
                                          count=count)
        except AiturboError as exc:
            why = await self._why_gone(node, content)
            self._record_error(f"read of inode {node.ino} chunk {index} failed: {exc}{why}")
            raise BrokenFile(f"{exc}{why}") from exc

    async def _why_gone(self, node: Inode, content: FileContent | None) -> str:
        """Why a chunk is nowhere, when the reason is a newer version: its version was replaced on another node
        (its chunks were let go there, its object overwritten) while a descriptor here still reads it."""
        if content is not None and content is not node.content:
            return "; the file took a newer version while this read ran"
        if content is None or content.dirty:
            return ""
        try:
            latest = await self._meta.get_inode(node.ino)
        except AiturboError:
            return ""
        if latest.version <= node.row.version:
            return ""
        return (f"; version {node.row.version}, which a descriptor open here reads, was replaced by version "
                f"{latest.version} on another node and its chunks are gone (a fresh open reads the new version)")

    def cache_key(self, node: Inode, index: int, slot: Slot) -> bytes:
        """The pool key of a sealed or external slot's bytes."""
        return slot.key if slot.key is not None else external_key(node.row, index)

    async def read_external(self, node: Inode, index: int, length: int, *, into: Range | None = None,
                            start: int = 0, count: int | None = None):
        try:
            return await self._read_named(node, index, length, into=into, start=start, count=count)
        except TransientBackendError as exc:
            self._record_error(f"read of {node.row.backend_keys[:1]} chunk {index} failed: {exc}")
            raise BackendUnavailable(str(exc)) from exc

    async def _read_named(self, node: Inode, index: int, length: int, *, into: Range | None = None,
                          start: int = 0, count: int | None = None):
        """Named chunk ``index`` of an imported object (valid until the next await); a fetch's hash goes to ``_objects``."""
        row = node.row
        data, digest = await self._store.read_named(row, index, length, into=into, start=start, count=count)
        if digest is not None:
            self._objects.learned(node, row, index, digest)
        return data

    async def hash_external(self, node: Inode, content: FileContent) -> None:
        """Give an imported file a manifest before its first modification."""
        keys = []
        for index, _slot in enumerate(content.slots):
            length = chunk.chunk_length(content.size, index)
            data = await self.read_external(node, index, length)
            # The read hashed the chunk if it fetched it (``_objects``): no second pass over it.
            # Zeros (a sparse object's holes) stay holes.
            digest = self._store.content_key(external_key(node.row, index))
            keys.append(chunk.content_key(data) if digest is None else chunk.entry_of(digest, length))
        for index, key in enumerate(keys):
            content.slots[index] = None if key == chunk.HOLE else Slot(key=key)
        manifest = chunk.pack_manifest(keys)
        node.row = await self._meta.set_attrs(node.ino, manifest=manifest)

    async def join_read_round(self, node: Inode) -> None:
        """A file opened for reading that other nodes may read too: the nodes reading it share the storage fetches.

        A tagged file joins its group's round; an untagged one, with
        ``-o autogroup``, a round of the nodes that open the same version
        within AUTOGROUP_WINDOW_S.  An object imported without a manifest
        takes part by the names of its chunks (``_objects``).
        """
        if not self._cluster.shared:
            return
        row, content = node.row, node.content
        if row.manifest:
            manifest = row.manifest
        elif row.manifest is None and row.size and content is not None and any(
                s is not None and s.is_external for s in content.slots):
            manifest = chunk.pack_manifest(external_keys(row))
        else:
            return
        group, group_size = await self._table.grouping(node)
        auto = group is None
        if auto:
            # A version not yet durable is in its holders' DRAM (future 0): readers take it from there at once
            if not self._options.autogroup or row.size < AUTOGROUP_BYTES_MIN or row.state != STATE_DURABLE:
                return
            group = f"auto:{node.ino}:{row.version}:{row.backend_etag or ''}"
        assert group is not None
        path = f"<inode {node.ino}>" if auto else await self._table.path(node.ino)  # (a lone reader waits for no query)
        self._cluster.start_read(ReadRequest(
            ino=node.ino, version=row.version, path=path, size=row.size,
            manifest=manifest, group=group, group_size=group_size, auto=auto,
        ))

    async def lseek(self, node: Inode, content: FileContent, offset: int, whence: int) -> int:
        """lseek(2) SEEK_DATA / SEEK_HOLE: holes by chunk (a hole may read as data, never the reverse).

        Raises ``NoDataAfter`` (ENXIO) at or past the end, or for SEEK_DATA
        with no data after ``offset``.
        """
        size = size_of(node, content)
        if offset < 0 or offset >= size:
            raise NoDataAfter(f"offset {offset} is not below the size {size}")
        if content.backing is not None and content.backing.kernel_opens:
            # The kernel serves the file from its backing file, which holds every chunk then.
            try:
                return os.lseek(content.backing.fd(), offset, whence)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    raise NoDataAfter(f"no data after offset {offset}") from None
                raise
        want_data = whence == os.SEEK_DATA
        for index in range(offset >> CHUNK_BITS, chunk.chunk_count(size)):
            if (content.slot_at(index) is not None) == want_data:
                return max(offset, index * CHUNK_BYTES)
        if want_data:
            raise NoDataAfter(f"no data after offset {offset}")
        return size


def attrs_of(node: Inode) -> InodeRow:
    """The inode's attributes: its row, with the size (and mtime) of what is written here and not committed yet."""
    row = node.row
    kernel = kernel_attrs(node)  # a file the kernel writes: what it has written so far
    if kernel is not None:
        size, mtime_ns = kernel
        return replace(row, size=size, mtime_ns=mtime_ns or row.mtime_ns)
    if node.content is not None and node.content.size != row.size:
        return replace(row, size=node.content.size)
    return row


def size_of(node: Inode, content: FileContent) -> int:
    """The file's size, with what the kernel wrote and no absorb took in yet."""
    kernel = kernel_attrs(node)
    return max(content.size, kernel[0]) if kernel is not None else content.size

