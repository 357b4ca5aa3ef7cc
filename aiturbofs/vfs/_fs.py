"""POSIX semantics over the metadata engine, the staging pool and the backend.

``Filesystem`` is what the FUSE adapter calls.  It speaks in domain types
(``InodeRow``, bytes names, ``AiturboError``) and never imports pyfuse3.

Write path (future 0): ``write`` copies into the file's backing file (a
tmpfs, ``staging._backing``), into an open chunk whose room the pool has
counted; a chunk that fills up is hashed in a worker thread and sealed into
the pool in place while the writer goes on (one of all zeros becomes a hole:
no memory);
``flush``/``fsync``/``release`` seal the rest,
commit the manifest (ordered chunk hashes, size, state ``staged``) to the
metadata engine and hand the file to the persister (future 1).

Read path: open slot -> pool (backing files, buffers, spill) -> backend
range verified against the chunk hash, cached in the reading file's backing
file.  Files imported from the backend without a manifest are read by
the names of their chunks (``_objects``): only from the object version
imported, hashed when fetched, and given a manifest once whole.
"""

import errno
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import trio

from .. import chunk
from .._errors import (
    AiturboError,
    BackendUnavailable,
    BrokenFile,
    FileTooBig,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NoAttribute,
    NoDataAfter,
    NoSpace,
    NotFound,
    NotPermitted,
    NotSupported,
    TransientBackendError,
)
from .._limits import (
    AUTOGROUP_BYTES_MIN,
    CHUNK_BITS,
    CHUNK_BYTES,
    CLUSTER_STATE_POLL_S,
    ERRORS_KEPT_MAX,
    FILE_SIZE_BYTES_MAX,
    HASH_INLINE_BYTES_MAX,
    NAME_BYTES_MAX,
    PREFETCH_TASKS_MAX,
    READ_AHEAD_CHUNKS,
    READDIR_BATCH_ENTRIES,
    SEAL_QUEUE_MAX,
    SYMLINK_TARGET_BYTES_MAX,
)
from .._syscalls import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE
from .._threads import background
from ..cluster import ClusterPort, ReadRequest, SingleNode, StageRequest
from ..meta import ROOT_INO, STATE_BROKEN, STATE_DURABLE, STATE_PERSISTING, STATE_STAGED, InodeRow
from ..persist import Persister
from ..staging import BackingArea, BackingFile, Pins, Range, StagingPool, content_key_of, punch_hole, room
from . import _xattr
from ._content import FileContent, Slot, VersionPins
from ._fetch import ChunkFetcher
from ._health import BackendHealth
from ._importer import Importer
from ._kernel_io import (
    absorb,
    being_written,
    close_kernel,
    kernel_attrs,
    open_kernel,
    run_charger,
    stamp_kernel_mtime,
)
from ._objects import ObjectChunks, external_key, external_keys
from ._options import VfsOptions
from ._state_waits import StateWaits

log = logging.getLogger(__name__)



class Inode:
    """What the daemon holds in memory for an inode the kernel knows."""

    __slots__ = ("ino", "row", "lookups", "opens", "served", "writers", "content", "cached_version", "tags", "pins")

    def __init__(self, row: InodeRow):
        self.ino = row.ino
        self.row = row
        self.lookups = 0
        self.opens = 0
        self.served = 0  # of the opens, those served through requests (not by the kernel) and not being released
        self.writers = 0  # of the opens, those whose close commits: while any is open this node keeps its own view
        self.content: FileContent | None = None
        self.cached_version = -1  # version whose pages the kernel may hold
        self.tags: dict[bytes, bytes] | None = None  # user.aiturbo.* cache
        # The pins of committed versions not yet durable (see VersionPins), oldest first.
        self.pins: list[VersionPins] = []

    @property
    def file(self) -> FileContent:
        """The content of a file whose content is loaded (it is open, or being written)."""
        assert self.content is not None, f"inode {self.ino} has no content loaded"
        return self.content

    @property
    def live(self) -> bool:
        """Size and mtime in ``row`` are ahead of the metadata engine's."""
        return self.content is not None and (self.content.dirty or self.opens > 0)


class Handle:
    __slots__ = ("fh", "inode", "flags", "writable", "commits", "next_offset", "kernel")

    def __init__(self, fh: int, inode: Inode, flags: int, *, created: bool = False):
        self.fh = fh
        self.inode = inode
        self.flags = flags
        self.writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        # Its close() commits the file: a writer's, or the one that created the
        # file (open(O_CREAT|O_RDONLY) makes an empty file that must persist too).
        self.commits = self.writable or created
        self.next_offset = 0  # where a sequential reader reads next (read-ahead)
        self.kernel = False  # served by the kernel from the backing file (FUSE passthrough: _kernel_io)


def _now_ns() -> int:
    return time.time_ns()


def _check_name(name: bytes) -> None:
    if len(name) > NAME_BYTES_MAX:
        raise NameTooLong(f"name of {len(name)} bytes exceeds {NAME_BYTES_MAX}")
    if not name or b"/" in name or name in (b".", b".."):
        raise InvalidArgument(f"bad name {name!r}")


def _shows(content: FileContent, row: InodeRow) -> bool:
    """Whether a content not dirty is the committed version ``row`` describes."""
    if content.size != row.size:
        return False
    if row.manifest is None:  # an imported object: its chunks are read by the row's names
        return all(s is None or s.is_external for s in content.slots)
    if any(s is not None and s.key is None for s in content.slots):
        return False
    return content.manifest() == row.manifest


class Filesystem:
    """The node's POSIX filesystem (see module doc)."""

    def __init__(
        self, meta, backend, pool: StagingPool, options: VfsOptions, *, staging: BackingArea,
        cluster: ClusterPort | None = None,
    ):
        self.meta = meta
        self.cluster: ClusterPort = cluster or SingleNode()  # a node alone by default
        self.backend = backend
        # The largest file a write or truncate may make: what the backend can
        # hold (S3: 5 TiB), refused at once (EFBIG) rather than broken at persist.
        self.size_max = min(FILE_SIZE_BYTES_MAX, backend.object_bytes_max)
        self.pool = pool
        self.staging = staging
        self.options = options
        self._inodes: dict[int, Inode] = {}
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._seal_send, self._seal_recv = trio.open_memory_channel(SEAL_QUEUE_MAX)
        self.state_waits = StateWaits()  # fsync, sync_close and the control socket's ``wait`` watch it
        self.fetcher = ChunkFetcher(self)
        self.persister = Persister(self)
        self.importer = Importer(self)
        self.objects = ObjectChunks(self)
        self.health = BackendHealth(backend, on_up=self._backend_up, record_error=self.record_error)
        self.errors: list[str] = []
        self.errors_total = 0  # every record_error (the list keeps the last ERRORS_KEPT_MAX): for the metrics
        self._nursery: trio.Nursery | None = None
        self._prefetching: set[bytes] = set()

    # =============================================================== lifecycle
    async def start(self, nursery: trio.Nursery) -> None:
        """Check the backend, recover staged files, then run the sealer and the persister.

        Raises ``BackendError`` if the backend refuses for good (a missing
        bucket); one that does not answer is only marked unavailable.
        """
        await self.health.check_at_mount(nursery)
        await self.persister.recover()
        self._nursery = nursery
        nursery.start_soon(self._run_sealer)
        nursery.start_soon(run_charger, self)
        await nursery.start(self.persister.run)

    def spawn(self, fn: Callable[..., Awaitable[None]], *args) -> bool:
        """Run ``fn(*args)`` in the background; False before ``start`` (nothing runs)."""
        if self._nursery is None:
            return False
        self._nursery.start_soon(fn, *args)
        return True

    def _backend_up(self) -> None:
        """The backend answers again: retry persists now, import the root."""
        self.persister.backend_answered()
        self.importer.refresh_soon(ROOT_INO)

    def record_error(self, message: str, event: str | None = None) -> None:
        """Log an operating error and keep it for ``aiturbo status``.

        ``event``: the log line in ``event key=value`` form, when the message
        (for a person reading the status) is not one already."""
        log.error("%s", event or message)
        self.errors_total += 1
        self.errors.append(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}")
        del self.errors[:-ERRORS_KEPT_MAX]

    # ================================================================= inodes
    def _cached(self, ino: int) -> Inode | None:
        return self._inodes.get(ino)

    def kernel_written(self) -> list[Inode]:
        """The files open for the kernel to write (FUSE passthrough)."""
        return [h.inode for h in self._handles.values() if h.kernel and h.writable]

    def kernel_writing(self, ino: int) -> bool:
        node = self._inodes.get(ino)
        return node is not None and being_written(node)

    def is_cached(self, ino: int) -> bool:
        """The persister's question: does the kernel or a handle still know ``ino``?"""
        return ino in self._inodes

    def is_open(self, ino: int) -> bool:
        node = self._inodes.get(ino)
        return node is not None and node.opens > 0

    def unlinked_keys(self) -> set[str]:
        """Backend keys of unlinked inodes still open or known to the kernel (the importer must not revive them)."""
        return {k for node in list(self._inodes.values()) if node.row.nlink == 0 for k in node.row.backend_keys}

    async def _inode(self, ino: int) -> Inode:
        """The in-memory inode, loading its row if needed."""
        node = self._inodes.get(ino)
        if node is None:
            node = Inode(await self.meta.get_inode(ino))
            self._inodes[ino] = node
        return node

    def _attr(self, node: Inode) -> InodeRow:
        row = node.row
        kernel = kernel_attrs(node)  # a file the kernel writes: what it has written so far
        if kernel is not None:
            size, mtime_ns = kernel
            return replace(row, size=size, mtime_ns=mtime_ns or row.mtime_ns)
        if node.content is not None and node.content.size != row.size:
            return replace(row, size=node.content.size)
        return row

    async def _refresh(self, node: Inode) -> InodeRow:
        """Re-read the row from the metadata engine (close-to-open).

        A row older than the one held (a commit landed while it was read)
        is not taken: it would turn a just-committed file back into its
        previous, durable version, and sync_close would return at once.
        """
        row = await self.meta.get_inode(node.ino)
        if row.version < node.row.version:
            return node.row
        if node.live:
            row.size = node.file.size
            row.mtime_ns = node.row.mtime_ns
        node.row = row
        return row

    def _remember(self, row: InodeRow) -> Inode:
        node = self._inodes.get(row.ino)
        if node is None:
            node = self._inodes[row.ino] = Inode(row)
        else:
            if not node.live:
                node.row = row
        return node

    async def lookup(self, parent: int, name: bytes) -> InodeRow:
        """Resolve ``name`` in ``parent`` and count a kernel reference."""
        if len(name) > NAME_BYTES_MAX:
            raise NameTooLong(f"name of {len(name)} bytes exceeds {NAME_BYTES_MAX}")
        if name == b".":
            row = await self.getattr(parent)
        elif name == b"..":
            raise NotFound("'..' is resolved by the kernel")
        else:
            await self.importer.refresh(parent)
            row = await self.meta.lookup(parent, name)
        node = self._remember(row)
        node.lookups += 1
        return self._attr(node)

    async def forget(self, ino: int, count: int) -> None:
        node = self._inodes.get(ino)
        if node is None:
            return
        node.lookups = max(0, node.lookups - count)
        await self._maybe_drop(node)

    async def _maybe_drop(self, node: Inode) -> None:
        """Free an inode nobody references: data of unlinked files goes here."""
        if node.lookups or node.opens or node.ino == ROOT_INO:
            return
        if node.row.nlink == 0:
            self._drop_content(node)
            del self._inodes[node.ino]
            self.persister.enqueue(node.ino, moved=True)  # deletes backend copies, then the row
            return
        content = node.content
        if node.pins or (content is not None and (content.dirty or self._has_pins(content))):
            return  # still staged: keep the slots (and their pins) in memory
        if content is not None:
            self._let_go(content)  # what it cached stays in the pool, evictable
        del self._inodes[node.ino]

    def _has_pins(self, content: FileContent) -> bool:
        return any(s is not None and s.pinned for s in content.slots)

    def _drop_content(self, node: Inode) -> None:
        self._release_pins(node, None)
        content, node.content = node.content, None
        if content is None:
            return
        for i, slot in enumerate(content.slots):
            self._free_slot(slot, content=content, index=i)
            content.slots[i] = None
        self._let_go(content)

    def _let_go(self, content: FileContent) -> None:
        """The content no longer uses its backing file (the pool's entries there may)."""
        backing, content.backing = content.backing, None
        if backing is not None:
            backing.users -= 1
            self.staging.release(backing)

    def _backing(self, node: Inode, content: FileContent) -> BackingFile:
        if content.backing is None:
            content.backing = self.staging.current(node.ino)
            content.backing.users += 1
        return content.backing

    def _free_slot(self, slot: Slot | None, node: Inode | None = None, *, content: FileContent | None = None,
                   index: int = 0) -> None:
        """Give back a slot's room or pin.

        An open slot's range (chunk ``index`` of ``content``) is punched.  The
        pin of a slot sealed since the last commit is released, unless a
        commit is in flight that may name the chunk: it joins that version's pins.
        """
        if slot is None:
            return
        if slot.is_open:
            charge, slot.charge = slot.charge, 0
            slot.seq += 1  # invalidates a sealer working on it
            if content is None and node is not None:
                content = node.content
            if content is not None and content.backing is not None:
                rng = content.range(index)
                rng.writing = False
                self._punch(rng)
            self.pool.unreserve(charge)
        elif slot.pinned:
            assert slot.key is not None  # a pin is on a sealed chunk
            slot.pinned = False
            if content is None and node is not None:
                content = node.content
            if content is not None and content.committing is not None:
                content.committing.append(slot.key)
            else:
                self.pool.unpin(slot.key)

    def _release_pins(self, node: Inode, upto: int | None) -> None:
        """Release the pins of committed versions <= ``upto`` (all of them with None)."""
        keep = []
        for version in node.pins:
            if upto is None or version.version <= upto:
                version.pins.release()
            else:
                keep.append(version)
        node.pins = keep

    def _take_pins(self, node: Inode, content: FileContent, version: int, manifest: bytes, extra: list[bytes]) -> None:
        """After commit of ``version``: the slots' pins (and ``extra``) become the version's.

        A chunk it shares with an older version still pinned gets a pin of
        its own: that older version may turn broken and let its pins go
        while this one still needs the bytes.
        """
        keys = list(extra)
        for slot in content.slots:
            if slot is not None and slot.pinned:
                assert slot.key is not None
                keys.append(slot.key)
                slot.pinned = False
        pins = Pins(self.pool, keys)
        if node.pins:
            older = {k for v in node.pins for k in v.pins.keys}
            for k in (set(chunk.unpack_manifest(manifest)) & older) - set(keys):
                pins.add(k)
        node.pins.append(VersionPins(version, pins))

    async def getattr(self, ino: int) -> InodeRow:
        node = self._inodes.get(ino)
        if node is not None:
            if node.live:
                return self._attr(node)
            return await self._refresh(node)
        return await self.meta.get_inode(ino)

    async def setattr(
        self,
        ino: int,
        *,
        fh: int | None = None,
        size: int | None = None,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        ctime_ns: int | None = None,
    ) -> InodeRow:
        node = await self._inode(ino)
        if being_written(node) and size is not None:
            # What the kernel wrote comes before the cut.  A chmod, chown or atime change orders with
            # no byte, so it hashes none (0.35 s on an open 1 GiB file), and a utime stamps the backing
            # file instead (``stamp_kernel_mtime``).
            await absorb(self, node)
        elif being_written(node) and mtime_ns is not None:
            stamp_kernel_mtime(node, mtime_ns)
        now = _now_ns()
        fields: dict = {}
        if size is not None:
            if not stat.S_ISREG(node.row.mode):
                raise IsADirectory("truncate of a non-regular file") if stat.S_ISDIR(node.row.mode) else InvalidArgument("truncate of a non-regular file")
            if size > self.size_max:
                raise FileTooBig(f"size {size} exceeds {self.size_max}, the most the backend can hold")
            content = await self._content(node)
            kernel = content.backing is not None and content.backing.kernel_opens > 0
            if size and node.row.manifest is None and any(s is not None and s.is_external for s in content.slots):
                # an imported file gets its manifest first, as open for
                # writing does: commit cannot describe unhashed chunks
                await self._hash_external(node, content)
            await self._truncate(node, content, size)
            if kernel:
                await self._cut_backing(content, size)
            node.row.mtime_ns = mtime_ns if mtime_ns is not None else now
            if fh is None and node.opens == 0:
                await self._commit(node)
        if mode is not None:
            fields["mode"] = (node.row.mode & stat.S_IFMT(0o170000)) | (mode & 0o7777)
        if uid is not None:
            fields["uid"] = uid
        if gid is not None:
            fields["gid"] = gid
        if atime_ns is not None:
            fields["atime_ns"] = atime_ns
        if mtime_ns is not None:
            fields["mtime_ns"] = mtime_ns
            if node.content is not None:
                node.row.mtime_ns = mtime_ns
        fields["ctime_ns"] = ctime_ns if ctime_ns is not None else now
        row = await self.meta.set_attrs(ino, **fields)
        if self.persister.attrs_pending(row):
            # Durable: no upload will carry the change (one in flight reads the
            # attributes at its publish, and looks again after it).
            self.persister.enqueue(ino)
        if node.live:
            row.size = node.file.size
            row.mtime_ns = node.row.mtime_ns
        node.row = row
        return self._attr(node)

    # ============================================================== namespace
    def _creation_ids(self, parent_row: InodeRow, uid: int, gid: int, mode: int) -> tuple[int, int]:
        if parent_row.mode & stat.S_ISGID:
            gid = parent_row.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        return gid, mode

    async def _check_path_bytes(self, parent: int, name: bytes) -> None:
        """``NameTooLong`` if ``parent/name`` is longer than a backend key may be.

        A local filesystem refuses such a path at once (ENAMETOOLONG); accepted,
        it would be marked broken at persist, when the backend refuses the key.
        """
        parent_path = await self._path(parent)
        above = len(parent_path.encode("utf-8", "surrogateescape")) + 1 if parent_path else 0
        if above + len(name) > self.backend.key_bytes_max:
            raise NameTooLong(f"path of {above + len(name)} bytes exceeds the {self.backend.key_bytes_max} "
                              "the backend can name")

    async def _create_row(self, parent: int, name: bytes, mode: int, uid: int, gid: int, *, rdev: int = 0, target: bytes | None = None) -> Inode:
        _check_name(name)
        await self._check_path_bytes(parent, name)
        parent_row = await self.meta.get_inode(parent)
        await self.importer.refresh(parent, parent_row)
        gid, mode = self._creation_ids(parent_row, uid, gid, mode)
        now = _now_ns()
        is_reg = stat.S_ISREG(mode)
        # Other nodes get a state too where the backend can hold them: the
        # persister writes them there (see docs/design.md, "What the backend holds").
        kept = is_reg or stat.S_IFMT(mode) in self.backend.node_kinds
        row = InodeRow(
            ino=0, mode=mode, uid=uid, gid=gid, size=len(target) if target else 0,
            nlink=1, atime_ns=now, mtime_ns=now, ctime_ns=now, rdev=rdev, target=target,
            state=STATE_STAGED if kept else None, backend_keys=[],
            # a node persists from its row alone: its creator writes it (a file's commit names its owner)
            owner=self.cluster.owner if kept and not is_reg else None,
        )
        row = await self.meta.create(parent, name, row)
        node = self._remember(row)
        node.lookups += 1
        if is_reg:
            node.content = FileContent(0)
            node.content.seq = 1  # a new file is dirty until its (empty) manifest commits
        return node

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> InodeRow:
        node = await self._create_row(parent, name, mode, uid, gid, rdev=rdev)
        if stat.S_ISREG(mode):
            await self._commit(node)
        else:
            self._persist_node(node)
        return self._attr(node)

    def _persist_node(self, node: Inode) -> None:
        """A new symlink, directory or special file: to the backend, if it keeps them."""
        if node.row.state is not None:
            self.persister.enqueue(node.ino)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> InodeRow:
        node = await self._create_row(parent, name, stat.S_IFDIR | (mode & 0o7777), uid, gid)
        node.row.imported_ns = _now_ns()  # nothing in the backend below a new dir
        await self.meta.set_attrs(node.ino, imported_ns=node.row.imported_ns)
        self.importer.note_imported(node.ino, node.row.imported_ns)
        self._persist_node(node)
        return self._attr(node)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> InodeRow:
        if len(target) > SYMLINK_TARGET_BYTES_MAX:
            raise NameTooLong(f"symlink target of {len(target)} bytes exceeds {SYMLINK_TARGET_BYTES_MAX}")
        node = await self._create_row(parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target)
        self._persist_node(node)
        return self._attr(node)

    async def readlink(self, ino: int) -> bytes:
        row = await self.getattr(ino)
        if not stat.S_ISLNK(row.mode):
            raise InvalidArgument("not a symlink")
        return row.target or b""

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int) -> tuple[Handle, InodeRow]:
        node = await self._create_row(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid)
        handle = self._open_handle(node, flags, created=True)
        node.cached_version = node.row.version
        return handle, self._attr(node)

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> InodeRow:
        _check_name(new_name)
        await self._check_path_bytes(new_parent, new_name)
        row = await self.meta.link(ino, new_parent, new_name)
        node = self._remember(row)
        # _remember keeps the row of a file open for writing: count the link there too
        node.row.nlink = row.nlink
        node.row.ctime_ns = row.ctime_ns
        node.lookups += 1
        if row.state is not None:
            self.persister.enqueue(ino, moved=True)  # the backend gets a copy at the new path
        return self._attr(node)

    async def unlink(self, parent: int, name: bytes) -> None:
        row = await self.meta.unlink(parent, name)
        node = self._inodes.get(row.ino)
        if node is not None:
            node.row.nlink = row.nlink
            node.row.ctime_ns = row.ctime_ns
            await self._maybe_drop(node)
        if row.nlink > 0 or node is None or self.is_open(row.ino):
            # (still open: its objects move aside, readable through its descriptors, freeing its name)
            self.persister.enqueue(row.ino, moved=True)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.importer.refresh_named(parent, name)
        parent_paths = await self.meta.paths_of(parent) if parent != ROOT_INO else [""]
        row = await self.meta.rmdir(parent, name)
        node = self._inodes.get(row.ino)
        if node is not None:
            node.row.nlink = 0
        if parent_paths:
            n = name.decode("utf-8", "surrogateescape")
            self.persister.enqueue_dir_cleanup(f"{parent_paths[0]}/{n}" if parent_paths[0] else n)

    async def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes, *, noreplace: bool, exchange: bool) -> None:
        _check_name(new_name)
        await self._check_path_bytes(new_parent, new_name)
        await self.importer.refresh(new_parent)
        moved = await self.meta.lookup(parent, name)
        other = None if noreplace else await self._lookup_or_none(new_parent, new_name)
        for row in (moved, other):
            if row is not None and stat.S_ISDIR(row.mode):
                await self.importer.refresh_tree(row.ino)  # what only the backend has below it moves too
        old_path = None  # a moved directory's backend path, cleaned up once its files moved out
        if stat.S_ISDIR(moved.mode) and not exchange:
            above = await self.meta.paths_of(parent)
            if above:
                n = name.decode("utf-8", "surrogateescape")
                old_path = f"{above[0]}/{n}" if above[0] else n
        replaced = await self.meta.rename(parent, name, new_parent, new_name, noreplace=noreplace, exchange=exchange)
        for row in (moved, other):
            if row is None:
                continue
            if stat.S_ISDIR(row.mode):
                if replaced is not None and replaced.ino == row.ino:
                    continue  # a replaced empty directory: deleted, nothing below it
                if row.state is not None:
                    self.persister.enqueue(row.ino, moved=True)  # its own backend form moves too
                await self.persister.enqueue_tree(row.ino, old_path if row is moved else None)
            else:
                self.persister.enqueue(row.ino, moved=True)
        if replaced is not None and not exchange:
            node = self._inodes.get(replaced.ino)
            if node is not None:
                node.row.nlink = replaced.nlink
                await self._maybe_drop(node)
                if self.is_open(replaced.ino):
                    self.persister.enqueue(replaced.ino, moved=True)  # see unlink
            else:
                self.persister.enqueue(replaced.ino, moved=True)

    async def _lookup_or_none(self, parent: int, name: bytes) -> InodeRow | None:
        try:
            return await self.meta.lookup(parent, name)
        except NotFound:
            return None

    async def readdir(self, ino: int, offset: int) -> list[tuple[bytes, InodeRow, int]]:
        """Entries after ``offset`` (a token from a previous batch)."""
        if offset == 0:
            await self.importer.refresh(ino)
        entries = await self.meta.readdir(ino, offset, READDIR_BATCH_ENTRIES)
        out = []
        for name, row, token in entries:
            node = self._inodes.get(row.ino)
            out.append((name, self._attr(node) if node is not None else row, token))
        return out

    async def dots(self, ino: int) -> list[tuple[bytes, InodeRow]]:
        """A directory's ``.`` and ``..`` entries (readdir lists them first; the kernel takes no reference)."""
        here = await self.getattr(ino)
        parent = await self.meta.parent_of(ino)
        return [(b".", here), (b"..", here if parent == ino else await self.getattr(parent))]

    def note_lookup(self, row: InodeRow) -> None:
        """readdirplus handed the kernel a reference to ``row``'s inode."""
        self._remember(row).lookups += 1

    async def statfs(self) -> tuple[int, int]:
        return await self.meta.stats()

    # ================================================================== xattr
    async def _tags(self, node: Inode) -> dict[bytes, bytes]:
        if node.tags is None:
            tags = {}
            for name in await self.meta.listxattr(node.ino):
                if name.startswith(_xattr.PREFIX):
                    tags[name] = await self.meta.getxattr(node.ino, name)
            node.tags = tags
        return node.tags

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        if name == _xattr.STATE:
            row = await self.getattr(ino)
            node = self._inodes.get(ino)
            if stat.S_ISDIR(row.mode):
                return (await self._dir_state(row)).encode()
            if row.state is None:
                raise NoAttribute("only regular files have a durability state")
            if node is not None and node.content is not None and node.content.dirty:
                return STATE_STAGED.encode()
            return self._state(row).encode()
        _xattr.validate_name(name)
        return await self.meta.getxattr(ino, name)

    async def _dir_state(self, row: InodeRow) -> str:
        """A directory's durability state: that of its own backend form and of
        the symlinks and special files in it, which Linux lets carry no user.*
        xattr (so ``aiturbo wait`` asks their directory).  The worst one wins."""
        states = set() if row.state is None else {self._state(row)}
        async for child in self._nodes_with_state(row.ino):
            states.add(self._state(child))
        for state in (STATE_BROKEN, STATE_STAGED, STATE_PERSISTING, STATE_DURABLE):
            if state in states:
                return state
        raise NoAttribute("this directory and its symlinks and special files live in the metadata only")

    async def _nodes_with_state(self, directory: int) -> AsyncIterator[InodeRow]:
        """The symlinks and special files in ``directory`` that the backend keeps: their state is shown as
        part of the directory's."""
        async for _, child in self.meta.children(directory, READDIR_BATCH_ENTRIES):
            if child.state is not None and not stat.S_ISREG(child.mode) and not stat.S_ISDIR(child.mode):
                yield child

    async def state_inputs(self, row: InodeRow) -> list[int]:
        """The inodes whose durability states make up ``row``'s (``user.aiturbo.state``): its own and, for a
        directory, those of its symlinks and special files.  A watcher of its state watches them all."""
        if not stat.S_ISDIR(row.mode):
            return [row.ino]
        return [row.ino] + [child.ino async for child in self._nodes_with_state(row.ino)]

    def _state(self, row: InodeRow) -> str:
        """``row``'s state as ``user.aiturbo.state`` shows it: a durable inode
        whose mode, owner or mtime the backend still lacks is ``persisting``,
        and is queued (it may not be: a crash, a directory whose entries
        changed), so asking is enough for it to get there."""
        if self.persister.attrs_pending(row):
            self.persister.enqueue(row.ino)
            return STATE_PERSISTING
        assert row.state is not None  # callers ask only about inodes the backend keeps
        return row.state

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        try:
            _xattr.validate_set(name, value)
        except AiturboError as exc:
            if isinstance(exc, InvalidArgument) or isinstance(exc, NotPermitted):
                log.warning("setxattr %s on inode %d refused: %s", name.decode(errors="replace"), ino, exc)
            raise
        await self.meta.setxattr(ino, name, value, flags)
        node = self._inodes.get(ino)
        if node is not None:
            node.tags = None

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self.meta.listxattr(ino)

    async def removexattr(self, ino: int, name: bytes) -> None:
        if name == _xattr.STATE:
            raise NotPermitted("user.aiturbo.state is read-only")
        _xattr.validate_name(name)
        await self.meta.removexattr(ino, name)
        node = self._inodes.get(ino)
        if node is not None:
            node.tags = None

    # ================================================================ content
    async def _content(self, node: Inode) -> FileContent:
        """The file's slots, built from its manifest on first use."""
        if node.content is None:
            # built from a commit: pins were taken (and released) by the slots
            # that sealed the chunks, so a rebuilt content holds none
            node.content = FileContent.from_manifest(node.row.size, node.row.manifest)
        return node.content

    def _open_handle(self, node: Inode, flags: int, *, created: bool = False) -> Handle:
        fh = self._next_fh
        self._next_fh += 1
        handle = self._handles[fh] = Handle(fh, node, flags, created=created)
        node.opens += 1
        node.served += 1
        if handle.commits:
            node.writers += 1
        return handle

    async def open(self, ino: int, flags: int, *, uid: int = 0) -> tuple[Handle, bool]:
        """Open ``ino`` for the caller ``uid``; returns the handle and whether kernel pages stay valid."""
        node = await self._inode(ino)
        if not self._written_here(node) and (self.cluster.shared or node.opens == 0):
            # close-to-open; across nodes also beside descriptors open here (alone, no other node
            # commits: the row held stands while the file is open, and an open costs no metadata read)
            await self._take_latest(node)
        row = node.row
        if stat.S_ISDIR(row.mode):
            raise IsADirectory("open of a directory as a file")
        if row.state == STATE_BROKEN and (flags & os.O_ACCMODE) == os.O_RDONLY:
            raise BrokenFile(f"inode {ino} is broken: its data was lost before it became durable")
        content = await self._content(node)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if writable and flags & os.O_TRUNC:
            # libfuse enables atomic_o_trunc: the kernel passes O_TRUNC here
            # and sends no truncating setattr, so open itself empties the file
            # (without it, torch.save over a longer file left its old tail).
            kernel = content.backing is not None and content.backing.kernel_opens > 0
            if kernel:
                await absorb(self, node)  # another open the kernel serves has written it
            if content.size:
                await self._truncate(node, content, 0)
                node.row.mtime_ns = _now_ns()
            if kernel:
                await self._cut_backing(content, 0)
            if uid != 0 and row.mode & (stat.S_ISUID | stat.S_ISGID):
                # as truncate(2) by a caller without CAP_FSETID: set-user-ID goes, and set-group-ID where
                # the group may execute (the kernel asks for that at a truncating setattr, not here)
                mode = row.mode & ~stat.S_ISUID
                if mode & stat.S_IXGRP:
                    mode &= ~stat.S_ISGID
                if mode != row.mode:
                    row = await self.setattr(ino, mode=mode & 0o7777)
        elif writable and row.manifest is None and any(s is not None and s.is_external for s in content.slots):
            await self._hash_external(node, content)
        handle = self._open_handle(node, flags)
        if not writable and not content.dirty:
            await self._join_read_round(node)
        keep = node.cached_version == row.version and not content.dirty
        node.cached_version = row.version
        return handle, keep

    def _written_here(self, node: Inode) -> bool:
        """Whether this node has changes of the file the metadata does not have yet, or may make some
        (a handle whose close commits is open): it keeps its own view then, never another node's."""
        return node.writers > 0 or (node.content is not None and node.content.dirty)

    async def _take_latest(self, node: Inode) -> None:
        """Close-to-open: the file's latest commit, for a file this node does not write (docs/design.md, "Semantics").

        Also while descriptors of the file are open here: the node serves
        one version of a file (the kernel caches its pages per inode, and
        passthrough binds one backing file per inode), so they read the
        new version from now on.
        """
        row = await self.meta.get_inode(node.ino)
        # Checked again after the await: a writer may have opened, or committed (a row older than the
        # one held would turn a just-committed file back into its previous version).
        if row.version < node.row.version or self._written_here(node):
            return
        node.row = row
        content = node.content
        if content is None:
            return
        if row.backend_etag is not None and row.manifest and content.size == row.size \
                and any(s is not None and s.is_external for s in content.slots):
            self.objects.adopt(node, row)  # another node hashed the object this content holds by name
        if self.cluster.shared and not _shows(content, row):
            self._supersede(node)  # another node committed a newer version

    def _supersede(self, node: Inode) -> None:
        """The content held is not the committed version any more: the row's takes its place.

        The old content's slots are left as they are (it is not dirty: they
        hold no pin and no open range), so a read that began on it finishes
        from it.  The backing file moves to the new content: the kernel may
        be serving it to descriptors open here, which must read the new
        version before another open joins them (``_kernel_io``).
        """
        old = node.content
        assert old is not None and not old.dirty
        self._release_pins(node, None)
        new = node.content = FileContent.from_manifest(node.row.size, node.row.manifest)
        new.backing, old.backing = old.backing, None
        new.kernel_behind = new.backing is not None and new.backing.kernel_opens > 0
        log.info("inode %d: version %d committed elsewhere replaces the content held here%s", node.ino,
                 node.row.version, " (descriptors open here read it from now on)" if node.opens else "")

    async def open_kernel(self, handle: Handle) -> int | None:
        """The backing file's descriptor if the kernel may serve ``handle`` itself (FUSE passthrough), else None."""
        return await open_kernel(self, handle)

    async def close_kernel(self, handle: Handle) -> None:
        """``handle`` is not served by the kernel after all (it refused the backing file)."""
        if handle.kernel:
            await close_kernel(self, handle)
            handle.inode.served += 1

    async def _cut_backing(self, content: FileContent, size: int) -> None:
        """A file the kernel serves was truncated: so is its backing file (the kernel reads it to its end).

        Entries in the ranges past the cut move out first (``take_range``: a
        version not yet durable keeps a copy).
        """
        backing = content.backing
        assert backing is not None
        first = size >> CHUNK_BITS
        for rng in backing.ranges():
            if rng.index >= first:
                await self._take_out(rng)
        os.ftruncate(backing.fd(), size)
        content.absorbed = None

    async def _take_out(self, rng: Range) -> None:
        """The pool's entry in ``rng`` (if any) moves out before the range is cut or punched under the
        kernel (``take_range``: a version not yet durable keeps a copy); its charge is given back."""
        if rng.entry is not None:
            charge, _, _ = await self.pool.take_range(rng)
            self.pool.unreserve(charge)

    async def _join_read_round(self, node: Inode) -> None:
        """A file opened for reading that other nodes may read too: the nodes reading it share the storage fetches.

        A tagged file joins its group's round; an untagged one, with
        ``-o autogroup``, a round of the nodes that open the same version
        within AUTOGROUP_WINDOW_S.  An object imported without a manifest
        takes part by the names of its chunks (``_objects``).
        """
        if not self.cluster.shared:
            return
        row, content = node.row, node.content
        if row.manifest:
            manifest = row.manifest
        elif row.manifest is None and row.size and content is not None and any(
                s is not None and s.is_external for s in content.slots):
            manifest = chunk.pack_manifest(external_keys(row))
        else:
            return
        group, group_size = await self._grouping(node)
        auto = group is None
        if auto:
            # A version not yet durable is in its holders' DRAM (future 0): readers take it from there at once
            if not self.options.autogroup or row.size < AUTOGROUP_BYTES_MIN or row.state != STATE_DURABLE:
                return
            group = f"auto:{node.ino}:{row.version}:{row.backend_etag or ''}"
        assert group is not None
        path = f"<inode {node.ino}>" if auto else await self._path(node.ino)  # (a lone reader waits for no query)
        self.cluster.start_read(ReadRequest(
            ino=node.ino, version=row.version, path=path, size=row.size,
            manifest=manifest, group=group, group_size=group_size, auto=auto,
        ))

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh)
        node = handle.inode
        try:
            if handle.kernel:
                await close_kernel(self, handle)
            else:
                node.served -= 1
            if handle.commits and node.content is not None and node.content.dirty and node.row.nlink > 0:
                await self._commit(node)
        finally:
            node.opens -= 1
            if handle.commits:
                node.writers -= 1
            await self._maybe_drop(node)

    async def flush(self, fh: int) -> None:
        """close(): future 0, or future 1 with ``-o sync_close``."""
        handle = self._handles[fh]
        node = handle.inode
        if not handle.commits or node.content is None:
            return
        if being_written(node):
            await absorb(self, node)
        if node.content.dirty and node.row.nlink > 0:
            await self._commit(node)
        if self.options.sync_close and node.row.nlink > 0 and node.row.state != STATE_DURABLE:
            await self.wait_durable(node.ino)

    async def fsync(self, fh: int) -> None:
        handle = self._handles[fh]
        node = handle.inode
        if node.content is None:
            return
        if being_written(node):
            await absorb(self, node)
        if node.content.dirty and node.row.nlink > 0:
            await self._commit(node, sync=True)
        elif node.row.nlink > 0:
            await self.meta.sync()  # a close's unsynced commit: on disk now
        if node.row.nlink > 0 and await self._fsync_durable(node):
            await self.wait_durable(node.ino)

    async def _fsync_durable(self, node: Inode) -> bool:
        mode = (await self._tags(node)).get(_xattr.FSYNC)
        if mode is None:
            return self.options.fsync_durable
        return mode == b"durable"

    # ---------------------------------------------------------------- writes
    async def write(self, fh: int, offset: int, data) -> int:
        handle = self._handles[fh]
        node = handle.inode
        content = node.file
        length = len(data)
        if offset + length > self.size_max:
            raise FileTooBig(f"write past {self.size_max} bytes, the most the backend can hold")
        if offset >= content.size and content.size % CHUNK_BYTES:
            last = (content.size - 1) // CHUNK_BYTES
            slot = content.slot_at(last)
            if last < offset // CHUNK_BYTES and slot is not None and not slot.is_open:
                # The write skips the old short tail chunk, which now grows to a
                # full chunk of zeros: reopen it, as a growing truncate does (its
                # sealed hash covers only the old length: the upload failed and
                # the file was marked broken).
                await self._writable_slot(node, content, last, 0)
        view = memoryview(data)
        for index, start, count, done in chunk.spans(offset, length):
            slot = content.slot_at(index)
            end = start + count
            if slot is None or slot.charge < room(end, index):
                slot = await self._writable_slot(node, content, index, end)
            try:
                content.range(index).pwrite(start, view[done : done + count])
            except OSError as exc:
                raise NoSpace(f"staging area {self.staging.directory}: {exc.strerror}", errno_=exc.errno) from exc
            if end > slot.filled:
                slot.filled = end
            slot.seq += 1
            # The size grows with each span, before the next span may wait for
            # memory: a sealer started on this chunk meanwhile hashes
            # chunk_length(size) bytes, and a size still short of the span's
            # end sealed a short chunk under a full-length file (its upload
            # then failed as a wrong-length part).
            if index * CHUNK_BYTES + end > content.size:
                content.size = index * CHUNK_BYTES + end
            if end == CHUNK_BYTES and slot.filled == CHUNK_BYTES:
                self._seal_soon(node, index, slot)
        content.seq += 1
        node.row.mtime_ns = _now_ns()
        return length

    async def fallocate(self, fh: int, offset: int, length: int, mode: int) -> None:
        """fallocate(2) modes 0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE (with or without
        KEEP_SIZE); others (COLLAPSE_RANGE, INSERT_RANGE, UNSHARE_RANGE) are EOPNOTSUPP.

        Nothing is reserved: staged bytes live in DRAM (or on the spill
        disk) and the backend allocates when it stores them, so an
        allocation only grows the size (without KEEP_SIZE) like a truncate.
        A punched or zeroed range reads as zeros: whole chunks become holes
        (no memory, one zero chunk in the backend), the ends of the range
        are written with zeros.
        """
        zero = mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE)
        if (mode & ~(FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE)
                or zero == FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE
                or (mode & FALLOC_FL_PUNCH_HOLE and not mode & FALLOC_FL_KEEP_SIZE)):
            raise NotSupported(f"fallocate mode {mode:#x}: only 0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE and "
                               "ZERO_RANGE are supported")
        if offset < 0 or length <= 0:
            raise InvalidArgument(f"fallocate of {length} bytes at {offset}")
        node = self._handles[fh].inode
        content = await self._content(node)
        end = offset + length
        size = self._size_of(node, content)
        if zero:
            await self._zero_range(fh, node, content, offset, min(end, size))
        if not mode & FALLOC_FL_KEEP_SIZE and end > size:
            await self.setattr(node.ino, fh=fh, size=end)

    async def _zero_range(self, fh: int, node: Inode, content: FileContent, offset: int, end: int) -> None:
        """Make ``[offset, end)`` (inside the file) read as zeros."""
        if offset >= end:
            return
        if being_written(node):
            # The kernel writes the backing file itself, which holds every chunk while it does:
            # punched there, the change is the kernel's kind, taken in by the next absorb.
            assert content.backing is not None
            punch_hole(content.backing.fd(), offset, end - offset)  # (metadata only: no thread)
            return
        for index, start, count, _ in chunk.spans(offset, end - offset):
            if count < chunk.chunk_length(content.size, index):
                if content.slot_at(index) is not None:  # (a hole reads as zeros already)
                    await self.write(fh, index * CHUNK_BYTES + start, bytes(count))
                continue
            async with content.lock:  # after a slot replacement in flight, not under it
                slot = content.slot_at(index)
                if slot is None:
                    continue
                content.slots[index] = None  # a hole
                self._free_slot(slot, node, content=content, index=index)
                content.seq += 1
                if content.backing is not None and content.backing.kernel_opens:
                    # The kernel reads this range as the file: the pool's entry there moves out first.
                    rng = content.range(index)
                    await self._take_out(rng)
                    rng.punch()
        node.row.mtime_ns = _now_ns()

    async def lseek(self, fh: int, offset: int, whence: int) -> int:
        """lseek(2) SEEK_DATA / SEEK_HOLE: holes by chunk (a hole may read as data, never the reverse).

        Raises ``NoDataAfter`` (ENXIO) at or past the end, or for SEEK_DATA
        with no data after ``offset``.
        """
        if whence not in (os.SEEK_DATA, os.SEEK_HOLE):
            raise InvalidArgument(f"lseek whence {whence}: the kernel answers it itself")
        node = self._handles[fh].inode
        content = await self._content(node)
        size = self._size_of(node, content)
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

    def _size_of(self, node: Inode, content: FileContent) -> int:
        """The file's size, with what the kernel wrote and no absorb took in yet."""
        kernel = kernel_attrs(node)
        return max(content.size, kernel[0]) if kernel is not None else content.size

    async def _writable_slot(self, node: Inode, content: FileContent, index: int, end: int) -> Slot:
        """An open slot at ``index`` with room for ``end`` bytes (may wait for memory).

        The slot's bytes are chunk ``index``'s range of the backing file.  If
        the pool's entry of the chunk's current bytes is in that range, it is
        moved out (``take_range``: copied first if a version not yet durable
        needs it) and the bytes stay; otherwise they are read in.
        """
        async with content.lock:
            content.ensure_slots(index)
            slot = content.slots[index]
            if slot is not None and slot.is_open:
                return await self._grow(content, index, slot, end)
            need = room(max(end, chunk.chunk_length(content.size, index)), index)
            rng = self._backing(node, content).range(index)
            charge, kept, kept_length = await self.pool.take_range(rng)
            rng.writing = True  # from now on no read-ahead caches a chunk here
            try:
                if charge < need:
                    await self._reserve(content, index, need - charge)
                    charge = need
                if charge >= CHUNK_BYTES and not rng.file.kernel_opens:  # (its size is the file's then)
                    rng.open_for_writing()
                # A truncate (which takes no lock) may have shortened the slots while we waited.
                content.ensure_slots(index)
                slot = content.slots[index]  # may have changed while we waited
                if slot is not None and slot.is_open:
                    self.pool.unreserve(charge)
                    charge = 0
                    return await self._grow(content, index, slot, end)
                valid = chunk.chunk_length(content.size, index)
                if slot is not None and kept is not None and kept == self._cache_key(node, index, slot):
                    filled = min(kept_length, valid)
                    if filled < kept_length:
                        rng.punch(filled)  # a truncate cut the chunk meanwhile
                else:
                    if kept is not None or rng.file.size > rng.offset:
                        rng.punch()  # another version's bytes
                    filled = await self._fill_from(node, content, index, slot, rng, valid)
            except BaseException:
                self.pool.unreserve(charge)
                rng.writing = False
                raise
            content.ensure_slots(index)
            slot = content.slots[index]
            new = Slot(charge=charge)
            # (a truncate during the fill's await cut the chunk: its old bytes past the cut are gone)
            new.filled = min(filled, chunk.chunk_length(content.size, index))
            if new.filled < filled:
                rng.punch(new.filled)
            content.slots[index] = new
            self._free_slot(slot, node, content=content, index=index)
            return new

    async def _grow(self, content: FileContent, index: int, slot: Slot, end: int) -> Slot:
        """Room in open slot ``index`` for ``end`` bytes (and the chunk's current length)."""
        need = room(max(end, chunk.chunk_length(content.size, index)), index)
        if slot.charge < need:
            await self._reserve(content, index, need - slot.charge)
            slot.charge = need
        return slot

    async def _reserve(self, content: FileContent, index: int, n: int) -> None:
        """Room for ``n`` more bytes of chunk ``index``; when the pool is full, first seal the open chunks of open files.

        A chunk written in part stays open (its room outside the pool's
        reach) until close seals it: random writes over more chunks than the
        budget holds (scattered copies into a sparse file) waited forever.
        Sealed, they are pinned entries like full chunks, which the pool
        spills under pressure; a later write reopens them from there.
        """
        if await self.pool.reserve(n, wait=False):
            return
        for handle in list(self._handles.values()):
            other = handle.inode.content
            if other is None:
                continue
            # Not a file's last chunk: the next write past EOF may grow it,
            # and a chunk sealed short would then be a wrong-length part.
            for i, slot in enumerate(other.slots[: chunk.chunk_count(other.size) - 1]):
                if slot is not None and slot.is_open and not (other is content and i == index):
                    await self._seal(other, i, slot)
        await self.pool.reserve(n)

    async def _fill_from(self, node: Inode, content: FileContent, index: int, slot: Slot | None, rng: Range, valid: int) -> int:
        """Write the current bytes of chunk ``index`` into its range; returns bytes filled."""
        if slot is None or valid == 0:
            return 0
        assert not slot.is_open  # an open slot's bytes are in its range already
        data = await self._read_slot(node, index, slot, valid, cache=False)
        try:
            rng.pwrite(0, data)
        except OSError as exc:
            raise NoSpace(f"staging area {self.staging.directory}: {exc.strerror}", errno_=exc.errno) from exc
        return len(data)

    def _punch(self, rng: Range) -> None:
        try:
            rng.punch()
        except OSError as exc:
            log.warning("could not free chunk %d of %s: %s", rng.index, rng.file.path, exc)

    async def _truncate(self, node: Inode, content: FileContent, size: int) -> None:
        if size == content.size:
            content.seq += 1
            return
        keep = chunk.chunk_count(size)
        if size < content.size:
            tail = size - ((keep - 1) * CHUNK_BYTES) if keep else 0
            if keep and tail < CHUNK_BYTES:
                slot = content.slot_at(keep - 1)
                if slot is not None and not slot.is_open:
                    slot = await self._writable_slot(node, content, keep - 1, 0)
                if slot is not None and slot.filled > tail:
                    content.range(keep - 1).punch(tail)  # the range past the cut reads as zeros again
                    slot.filled = tail
                    slot.seq += 1
            for i, slot in enumerate(content.slots[keep:], start=keep):
                self._free_slot(slot, node, content=content, index=i)
            del content.slots[keep:]
        else:
            last = chunk.chunk_count(content.size) - 1
            slot = content.slot_at(last) if last >= 0 else None
            if slot is not None and not slot.is_open and chunk.chunk_length(content.size, last) < CHUNK_BYTES:
                # the sealed tail chunk grows: its bytes change (zeros appended)
                await self._writable_slot(node, content, last, 0)
        content.size = size
        content.seq += 1

    # ---------------------------------------------------------------- sealing
    def _seal_soon(self, node: Inode, index: int, slot: Slot) -> None:
        try:
            self._seal_send.send_nowait((node, index, slot, slot.seq))
        except trio.WouldBlock:
            pass  # sealed at commit instead

    async def _run_sealer(self) -> None:
        async for node, index, slot, seq in self._seal_recv:
            content = node.content
            if content is None or content.slot_at(index) is not slot or slot.seq != seq or not slot.is_open:
                continue
            await self._seal(content, index, slot, urgent=False)

    async def _seal(self, content: FileContent, index: int, slot: Slot, *, urgent: bool = True) -> bool:
        """Hash an open slot and hand its range to the pool; False if it changed meanwhile."""
        if not slot.is_open:
            return slot.key is not None  # sealed meanwhile by the other sealer
        length = chunk.chunk_length(content.size, index)
        if length > slot.charge:
            return False  # needs more room: the caller reserves it
        seq = slot.seq
        rng = content.range(index)
        if length > HASH_INLINE_BYTES_MAX:
            # the sealer works ahead at low priority; close()/fsync wait on it
            path, at = rng.file.path, rng.offset
            try:
                if urgent:
                    key = await trio.to_thread.run_sync(content_key_of, path, at, length)
                else:
                    key = await trio.to_thread.run_sync(background, content_key_of, path, at, length)
            except FileNotFoundError:
                return False  # the file is gone (unlinked and dropped meanwhile)
        else:
            key = chunk.content_key(rng.pread(0, length))
        if content.slot_at(index) is not slot or slot.seq != seq or not slot.is_open or chunk.chunk_length(content.size, index) != length:
            return False
        if key == chunk.HOLE:
            # written as zeros: a hole like one never written (no pool memory,
            # no spill, no backend blocks)
            content.slots[index] = None
            self._free_slot(slot, content=content, index=index)
            return True
        charge, slot.charge = slot.charge, 0
        slot.key = key
        slot.pinned = True
        self.pool.adopt_range(key, rng, length, charge)
        return True

    async def _seal_all(self, node: Inode, content: FileContent) -> None:
        while True:
            pending = [(i, s) for i, s in enumerate(content.slots[: chunk.chunk_count(content.size)]) if s is not None and s.is_open]
            if not pending:
                return
            for index, slot in pending:
                if not await self._seal(content, index, slot) and content.slot_at(index) is slot and slot.is_open:
                    if chunk.chunk_length(content.size, index) > slot.charge:
                        await self._writable_slot(node, content, index, chunk.chunk_length(content.size, index))

    async def _commit(self, node: Inode, *, sync: bool = False) -> None:
        """Future 0: seal every chunk and commit the manifest as ``staged``.

        ``sync`` (fsync): the commit is on disk when this returns.  Without
        it (close) a host crash may lose the commit, as it loses the DRAM
        bytes; the sync of the file's durable state covers it (docs/design.md,
        "What needs an fsync of the metadata").
        """
        content = node.file
        while content.dirty:
            seq = content.seq
            await self._seal_all(node, content)
            if content.seq != seq:
                continue
            # Sealed slots that are not pinned hold chunks the backend already
            # has (unchanged since the last durable version): the persister
            # fetches them from there if the pool has evicted them.
            manifest = content.manifest()
            freed: list[bytes] = []
            content.committing = freed
            row = None
            try:
                request = await self._stage_request(node, content, manifest)
                placed = await self.cluster.stage(request)
                if content.seq == seq:  # else written meanwhile: seal and place the new bytes
                    row = await self.meta.commit_manifest(
                        node.ino, size=content.size, manifest=manifest, state=STATE_STAGED, mtime_ns=node.row.mtime_ns,
                        sync=sync, owner=self.cluster.owner, holders=placed.holders,
                    )
            finally:
                content.committing = None
                if row is None:
                    for key in freed:
                        self.pool.unpin(key)  # nothing committed names them
            if row is None:
                continue
            self._take_pins(node, content, row.version, manifest, freed)
            content.committed_seq = seq
            node.row = row
            log.info("staged ino=%d version=%d size=%d holders=%s", node.ino, row.version, row.size,
                     ",".join(placed.holders) or "local")
            self.notify_state(node.ino)
            self.persister.set_hints(node.ino, row.version, placed.hints)
            self.persister.enqueue(node.ino)
            await self.cluster.committed(request, row.version)

    async def _stage_request(self, node: Inode, content: FileContent, manifest: bytes) -> StageRequest:
        """What the cluster port places before close() returns (a grouped file's path goes in its round report)."""
        group, group_size = await self._grouping(node)
        return StageRequest(
            ino=node.ino, path=await self._path(node.ino) if group is not None else "", size=content.size,
            manifest=manifest, group=group, group_size=group_size,
        )

    async def _grouping(self, node: Inode) -> tuple[str | None, int | None]:
        """The file's group tag and group size (``None`` where not set)."""
        tags = await self._tags(node)
        group, size = tags.get(_xattr.GROUP), tags.get(_xattr.GROUP_SIZE)
        return (group.decode() if group else None), (int(size) if size else None)

    async def _path(self, ino: int) -> str:
        """One path of ``ino`` (its first link), for reports and logs."""
        paths = await self.meta.paths_of(ino)
        return paths[0] if paths else ""

    # ------------------------------------------------------------------ reads
    async def read(self, fh: int, offset: int, size: int):
        handle = self._handles[fh]
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
        return await self._read_slot(node, index, slot, chunk.chunk_length(content.size, index), start=start, count=count,
                                     content=content)

    def _read_ahead(self, node: Inode, content: FileContent, last: int) -> None:
        """A sequential reader: fetch the next chunks into the pool while it reads this one."""
        for index in range(last + 1, min(last + 1 + READ_AHEAD_CHUNKS, chunk.chunk_count(content.size))):
            slot = content.slot_at(index)
            if slot is None or slot.is_open:
                continue
            key = self._cache_key(node, index, slot)
            if key in self._prefetching or self.pool.has(key) or len(self._prefetching) >= PREFETCH_TASKS_MAX:
                continue
            self._prefetching.add(key)
            assert self._nursery is not None  # started
            self._nursery.start_soon(self._prefetch, node, content, index, slot.key is None, key,
                                     chunk.chunk_length(content.size, index))

    async def read_chunk(self, ino: int, index: int, key: bytes, length: int) -> bytes:
        """Chunk ``key`` (chunk ``index`` of ``ino``) for the cluster: a read round's prefetch, a chain successor.

        Fetched as a reader fetches it, and kept in the file's backing file
        while the file is open here with that chunk (else in a pool buffer).
        ``key`` may be the name of an imported object's chunk (``_objects``).
        """
        node = self._inodes.get(ino)
        content = node.content if node is not None else None
        slot = content.slot_at(index) if content is not None else None
        if (node is not None and content is not None and slot is not None and node.row.backend_etag is not None
                and external_key(node.row, index) == key):
            if slot.is_external:
                named_into = self._backing(node, content).range(index)
                return bytes(await self._read_external(node, index, length, into=named_into))
            if slot.key is not None:
                key = slot.key  # hashed meanwhile (``_objects.adopt``): the same bytes, under their content key
        into = self._backing(node, content).range(index) if node and content and slot and slot.key == key else None
        row = node.row if node is not None else None
        data = await self.pool.read(key, lambda: self.fetcher.chunk(ino, index, key, length, row), into=into)
        return bytes(data)

    async def _prefetch(self, node: Inode, content: FileContent, index: int, named: bool, key: bytes, length: int) -> None:
        try:
            into = self._backing(node, content).range(index) if node.content is content else None
            if named:  # an imported object's chunk (``_objects``)
                await self.pool.read(key, lambda: self.objects.fetch(node, index, length), into=into, count=0)
            else:
                await self.pool.read(key, lambda: self.fetcher.chunk(node.ino, index, key, length, node.row),
                                     into=into, count=0)
        except AiturboError as exc:  # the reader will fetch (and report) it itself
            log.debug("read-ahead of inode %d chunk %d: %s", node.ino, index, exc)
        finally:
            self._prefetching.discard(key)

    async def _read_slot(self, node: Inode, index: int, slot: Slot, length: int, *, start: int = 0,
                         count: int | None = None, cache: bool = True, content: FileContent | None = None):
        """Bytes ``start:start+count`` of a sealed or external slot (valid until the next await).

        ``content``: the content the slot is of (default: the node's).  With
        ``cache`` a chunk fetched from elsewhere is kept in the file's range
        (a clean entry the pool may evict), unless that content has been
        replaced by a newer version meanwhile.
        """
        if content is None:
            content = node.content
        into = self._backing(node, content).range(index) if cache and content is not None \
            and content is node.content else None
        if slot.key is None:
            return await self._read_external(node, index, length, into=into, start=start, count=count)
        key = slot.key

        async def fetch() -> bytes:
            return await self.fetcher.chunk(node.ino, index, key, length, node.row)

        try:
            return await self.pool.read(key, fetch, into=into, start=start, count=count)
        except AiturboError as exc:
            why = await self._why_gone(node, content)
            self.record_error(f"read of inode {node.ino} chunk {index} failed: {exc}{why}")
            raise BrokenFile(f"{exc}{why}") from exc

    async def _why_gone(self, node: Inode, content: FileContent | None) -> str:
        """Why a chunk is nowhere, when the reason is a newer version: its version was replaced on another node
        (its chunks were let go there, its object overwritten) while a descriptor here still reads it."""
        if content is not None and content is not node.content:
            return "; the file took a newer version while this read ran"
        if content is None or content.dirty:
            return ""
        try:
            latest = await self.meta.get_inode(node.ino)
        except AiturboError:
            return ""
        if latest.version <= node.row.version:
            return ""
        return (f"; version {node.row.version}, which a descriptor open here reads, was replaced by version "
                f"{latest.version} on another node and its chunks are gone (a fresh open reads the new version)")

    def _cache_key(self, node: Inode, index: int, slot: Slot) -> bytes:
        """The pool key of a sealed or external slot's bytes."""
        return slot.key if slot.key is not None else external_key(node.row, index)

    async def _read_external(self, node: Inode, index: int, length: int, *, into: Range | None = None,
                             start: int = 0, count: int | None = None):
        try:
            return await self.pool.read(external_key(node.row, index), lambda: self.objects.fetch(node, index, length),
                                        into=into, start=start, count=count)
        except TransientBackendError as exc:
            self.record_error(f"read of {node.row.backend_keys[:1]} chunk {index} failed: {exc}")
            raise BackendUnavailable(str(exc)) from exc

    async def _hash_external(self, node: Inode, content: FileContent) -> None:
        """Give an imported file a manifest before its first modification."""
        keys = []
        for index, _slot in enumerate(content.slots):
            length = chunk.chunk_length(content.size, index)
            data = await self._read_external(node, index, length)
            # The read hashed the chunk if it fetched it (``_objects``): no second pass over it.
            # Zeros (a sparse object's holes) stay holes.
            digest = self.objects.content_key(external_key(node.row, index))
            keys.append(chunk.content_key(data) if digest is None else chunk.entry_of(digest, length))
        for index, key in enumerate(keys):
            content.slots[index] = None if key == chunk.HOLE else Slot(key=key)
        manifest = chunk.pack_manifest(keys)
        node.row = await self.meta.set_attrs(node.ino, manifest=manifest)

    # ============================================================ durability
    def notify_state(self, ino: int) -> None:
        self.state_waits.notify(ino)

    async def on_persisted(self, ino: int, row: InodeRow) -> None:
        """The persister made version ``row.version`` durable (or broken), or
        gave its objects new attributes."""
        node = self._inodes.get(ino)
        if node is not None:
            if not node.live:
                node.row = row
            else:
                node.row.state = row.state
                node.row.version = row.version
                node.row.backend_keys = row.backend_keys
                node.row.persisted_version = row.persisted_version
                node.row.persisted_attrs = row.persisted_attrs
                node.row.backend_etag = row.backend_etag  # a new mtime gives a file:// object a new etag
            content = node.content
            if row.state in (STATE_DURABLE, STATE_BROKEN):
                self._release_pins(node, row.version)
            if row.state == STATE_BROKEN and content is not None and not content.dirty:
                content.broken = True
            await self._maybe_drop(node)
        self.notify_state(ino)

    def adopt_recovered(self, row: InodeRow, pinned: set[int], backings: list[BackingFile]) -> None:
        """After a restart: hold the pins of a staged file recovered from its backing file or spill.

        ``pinned``: the chunk indexes recovery pinned; ``backings``: the
        backing files the previous run left for it (two after a crash while
        it moved to disk: the one recovery took more chunks from is its own).
        """
        node = self._inodes.get(row.ino)
        if node is None:
            node = self._inodes[row.ino] = Inode(row)
        content = FileContent.from_manifest(row.size, row.manifest)
        # Recovery pinned exactly the chunks it found.  The others are
        # unchanged since the last durable version (or lost): they hold no pin.
        keys = chunk.unpack_manifest(row.manifest or b"")
        node.pins.append(VersionPins(row.version, Pins(self.pool, [keys[i] for i in sorted(pinned)])))
        for backing in backings:
            # What recovery did not take from the file's backing files is not the file's: bytes a
            # passthrough writer left there after its last close (never committed), or a chunk now kept
            # elsewhere.  Read through the kernel they would be served; they go.
            for index in range(chunk.chunk_count(backing.size)):
                rng = backing.range(index)
                if rng.entry is None:
                    self._punch(rng)
        if backings:
            backing = max(backings, key=lambda b: sum(r.entry is not None for r in b.ranges()))
            content.backing = backing
            backing.users += 1
        node.content = content

    async def restage(self, ino: int) -> dict:
        """``aiturbo verify --repair``: upload durable ``ino`` again from copies of its chunks held here.

        Every chunk of the manifest must be in this node's DRAM, its spill
        store or a holder's pool: each is pinned (a peer's copy is stored
        here first), the file goes back to staged and the persister uploads
        it like any commit.  The backend is never a source: its object is
        what is being repaired.  Answers ``missing``: the chunk indexes with
        no copy (then nothing changes), or ``changed`` if a newer version
        was committed meanwhile (it is persisted anyway).
        """
        try:
            row = await self.meta.get_inode(ino)
        except NotFound:
            return {"ok": True, "missing": [], "changed": True, "state": "gone"}
        if row.state != STATE_DURABLE:
            return {"ok": True, "missing": [], "changed": True, "state": row.state}
        if row.manifest is None:  # imported, never read whole: no hash says which bytes are right
            return {"ok": True, "missing": list(range(chunk.chunk_count(row.size))), "changed": False,
                    "state": row.state}
        keys = chunk.unpack_manifest(row.manifest)[: chunk.chunk_count(row.size)]
        pins, missing = Pins(self.pool), []
        others = [h for h in row.holders if h != self.cluster.owner]
        for index, key in enumerate(keys):
            if key == chunk.HOLE:
                continue
            if self.pool.has(key):
                pins.add(key)
            elif self.pool.recover_spilled(key):  # pinned by that call
                pins.keys.append(key)
            elif others and (data := await self.cluster.fetch(key, others)) is not None:
                await self.pool.store(key, data)  # verified by the fabric; pinned by that call
                pins.keys.append(key)
            else:
                missing.append(index)
        if missing or not await self.meta.set_state(ino, STATE_STAGED, if_version=row.version):
            pins.release()
            return {"ok": True, "missing": missing, "changed": not missing, "state": row.state}
        node = self._inodes.get(ino)
        if node is None:
            node = self._inodes[ino] = Inode(row)
        node.pins.append(VersionPins(row.version, pins))
        node.row.state = STATE_STAGED
        log.warning("verify: re-uploading %s (inode %d) from the copies of its %d chunk(s) held here",
                    (await self.meta.paths_of(ino) or ["?"])[0], ino, len(pins.keys))
        self.persister.enqueue(ino)
        return {"ok": True, "missing": [], "changed": False, "state": STATE_STAGED}

    async def wait_durable(self, ino: int) -> None:
        """Block until the committed version of ``ino`` is durable (future 1)."""
        with self.state_waits.watch(ino) as changes:  # before the state is read: no change goes unseen
            while True:
                row = await self.meta.get_inode(ino)
                if row.state == STATE_BROKEN:
                    raise BrokenFile(f"inode {ino} is broken")
                if row.nlink == 0:
                    return
                if row.state == STATE_DURABLE and row.persisted_version == row.version and self._state(row) == STATE_DURABLE:
                    return
                if not self.cluster.shared:
                    await changes.wait()
                else:
                    # another node may persist it (a takeover): its progress is
                    # seen in the shared metadata only
                    with trio.move_on_after(CLUSTER_STATE_POLL_S):
                        await changes.wait()
