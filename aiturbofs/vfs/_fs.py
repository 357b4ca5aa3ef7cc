"""POSIX semantics over the metadata engine, the staging pool and the backend: the front the FUSE handlers call.

``Filesystem`` speaks in domain types (``InodeRow``, bytes names,
``AiturboError``) and never imports pyfuse3.  It keeps the POSIX rules of
opens, closes, attributes and xattrs, and hands the rest down:

* ``_inodes``: the inode and handle table;
* ``_namespace``: names and attributes (lookup, create, link, rename, readdir);
* ``_writer``: a file's bytes while written (slots, room, sealing, the commit:
  future 0), with ``_kernel_io`` for the bytes a passthrough writer's kernel wrote;
* ``_reader``: reads, read-ahead, chunks for the cluster, over the chunk
  store (``store``, below the persister; ``_objects`` records the manifests
  of objects imported without one);
* ``_durability``: durability states, the persister's news, recovery, repair
  (future 1 is the persister's, below).
"""

import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable

import trio

from .._errors import (
    AiturboError,
    BrokenFile,
    FileTooBig,
    InvalidArgument,
    IsADirectory,
    NotPermitted,
    NotSupported,
)
from .._limits import ERRORS_KEPT_MAX, FILE_SIZE_BYTES_MAX, PERSIST_YIELD_QUIET_S
from .._syscalls import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE
from ..backend import Backend
from ..cluster import ClusterPort, SingleNode
from ..meta import ROOT_INO, STATE_BROKEN, STATE_DURABLE, InodeRow, MetaStore
from ..persist import Persister
from ..staging import BackingArea, BackingFile, StagingPool
from ..store import BackendHealth, ChunkStore
from . import _xattr
from ._content import FileContent
from ._durability import Durability
from ._importer import Importer
from ._inodes import Handle, Inode, InodeTable, without_suidgid
from ._kernel_io import absorb, being_written, close_kernel, open_kernel, run_charger, stamp_kernel_mtime
from ._namespace import Namespace
from ._objects import ObjectChunks
from ._options import VfsOptions
from ._reader import Reader, attrs_of, size_of
from ._writer import Writer, now_ns

log = logging.getLogger(__name__)


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
        self, meta: MetaStore, backend: Backend, pool: StagingPool, options: VfsOptions, *, staging: BackingArea,
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
        self.errors: list[str] = []
        self.errors_total = 0  # every record_error (the list keeps the last ERRORS_KEPT_MAX): for the metrics
        self._nursery: trio.Nursery | None = None
        self.inodes = InodeTable(meta)
        self.state_waits = self.inodes.state_waits  # the control socket's ``wait`` watches it too
        self._writing_at = -PERSIST_YIELD_QUIET_S  # trio time of the last request that changed files
        self.health = BackendHealth(backend, record_error=self.record_error)
        self.health.when_up(self._backend_up)
        self.store = ChunkStore(meta, backend, pool, self.cluster, self.health, record_error=self.record_error)
        self.persister = Persister(self)
        self.importer = Importer(self)
        self.objects = ObjectChunks(self)
        self.reader = Reader(self.inodes, meta, self.store, staging, self.cluster, options, self.objects,
                             spawn=self.spawn, record_error=self.record_error)
        self.writer = Writer(self.inodes, meta, pool, staging, self.cluster, self.reader, self.persister,
                             size_max=self.size_max)
        self.names = Namespace(self.inodes, meta, backend, self.importer, self.persister, self.writer, self.cluster)
        self.durability = Durability(self.inodes, meta, pool, self.persister, self.writer, self.cluster)

    # =============================================================== lifecycle
    async def start(self, nursery: trio.Nursery) -> None:
        """Check the backend, recover staged files, then run the sealer and the persister.

        Raises ``BackendError`` if the backend refuses for good (a missing
        bucket); one that does not answer is only marked unavailable.
        """
        await self.health.check_at_mount(nursery)
        await self.persister.recover()
        self._nursery = nursery
        nursery.start_soon(self.writer.run_sealer)
        nursery.start_soon(run_charger, self.writer)
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

    # ============================================== what the persister asks
    def kernel_writing(self, ino: int) -> bool:
        node = self.inodes.get(ino)
        # (dirty: what the kernel wrote is taken in and its commit to come; the last writer's
        # release counts the writer gone before it commits)
        return node is not None and (being_written(node) or (node.content is not None and node.content.dirty))

    def note_writing(self) -> None:
        """A request that changes files (create, write, close, rename, ...) came: the application writes."""
        self._writing_at = trio.current_time()

    def writers_active(self) -> bool:
        return trio.current_time() - self._writing_at < PERSIST_YIELD_QUIET_S and not len(self.state_waits)

    def is_cached(self, ino: int) -> bool:
        """The persister's question: does the kernel or a handle still know ``ino``?"""
        return ino in self.inodes

    def is_open(self, ino: int) -> bool:
        return self.inodes.is_open(ino)

    def unlinked_keys(self) -> set[str]:
        return self.inodes.unlinked_keys()

    def notify_state(self, ino: int) -> None:
        self.inodes.notify_state(ino)

    async def on_persisted(self, ino: int, row: InodeRow) -> None:
        await self.durability.on_persisted(ino, row)

    def adopt_recovered(self, row: InodeRow, pinned: set[int], backings: list[BackingFile]) -> None:
        self.durability.adopt_recovered(row, pinned, backings)

    async def restage(self, ino: int) -> dict:
        return await self.durability.restage(ino)

    async def wait_durable(self, ino: int) -> None:
        await self.durability.wait_durable(ino)

    async def state_inputs(self, row: InodeRow) -> list[int]:
        """The inodes whose states make up ``row``'s ``user.aiturbo.state`` (a directory's: its symlinks and
        special files too)."""
        return await self.durability.state_inputs(row)

    async def state_shown(self, row: InodeRow, inputs: list[int]) -> str:
        """``user.aiturbo.state`` of ``row`` (NoAttribute: none), a directory's from ``inputs`` as
        ``state_inputs`` gave them (beyond itself) rather than from a new listing."""
        return await self.durability.shown(row, inputs)

    # ================================================ names and attributes
    async def lookup(self, parent: int, name: bytes) -> InodeRow:
        return await self.names.lookup(parent, name)

    async def forget(self, ino: int, count: int) -> None:
        await self.names.forget(ino, count)

    def note_lookup(self, row: InodeRow) -> None:
        self.names.note_lookup(row)

    async def getattr(self, ino: int) -> InodeRow:
        return await self.names.getattr(ino)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> InodeRow:
        return await self.names.mknod(parent, name, mode, rdev, uid, gid)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> InodeRow:
        return await self.names.mkdir(parent, name, mode, uid, gid)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> InodeRow:
        return await self.names.symlink(parent, name, target, uid, gid)

    async def readlink(self, ino: int) -> bytes:
        return await self.names.readlink(ino)

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int, gid: int) -> tuple[Handle, InodeRow]:
        node = await self.names.create(parent, name, mode, uid, gid)
        handle = self.inodes.open_handle(node, flags, created=True)
        node.cached_version = node.row.version
        return handle, attrs_of(node)

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> InodeRow:
        return await self.names.link(ino, new_parent, new_name)

    async def unlink(self, parent: int, name: bytes) -> None:
        await self.names.unlink(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.names.rmdir(parent, name)

    async def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes, *, noreplace: bool, exchange: bool) -> None:
        await self.names.rename(parent, name, new_parent, new_name, noreplace=noreplace, exchange=exchange)

    async def readdir(self, ino: int, offset: int) -> list[tuple[bytes, InodeRow, int]]:
        return await self.names.readdir(ino, offset)

    async def dots(self, ino: int) -> list[tuple[bytes, InodeRow]]:
        return await self.names.dots(ino)

    async def statfs(self) -> tuple[int, int]:
        return await self.names.statfs()

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
        kill_suidgid: bool = False,
    ) -> InodeRow:
        """chmod, chown, truncate, utime.  ``kill_suidgid``: the kernel asks the set-user/group-ID
        bits killed (``without_suidgid``) with the change (FATTR_KILL_SUIDGID: a chown, or a
        truncate by a caller without CAP_FSETID)."""
        node = await self.inodes.load(ino)
        if being_written(node) and size is not None:
            # What the kernel wrote comes before the cut.  A chmod, chown or atime change orders with
            # no byte, so it hashes none (0.35 s on an open 1 GiB file), and a utime stamps the backing
            # file instead (``stamp_kernel_mtime``).
            await absorb(self.writer, node)
        elif being_written(node) and mtime_ns is not None:
            stamp_kernel_mtime(node, mtime_ns)
        now = now_ns()
        fields: dict = {}
        if size is not None:
            if not stat.S_ISREG(node.row.mode):
                raise IsADirectory("truncate of a non-regular file") if stat.S_ISDIR(node.row.mode) else InvalidArgument("truncate of a non-regular file")
            if size > self.size_max:
                raise FileTooBig(f"size {size} exceeds {self.size_max}, the most the backend can hold")
            content = await self._content(node)
            if size and node.row.manifest is None and any(s is not None and s.is_external for s in content.slots):
                # an imported file gets its manifest first, as open for
                # writing does: commit cannot describe unhashed chunks
                await self.reader.hash_external(node, content)
            await self.writer.truncate(node, content, size)
            # Asked after the truncate's awaits, not before: a passthrough open that came while it
            # waited fitted the backing file to the old size, and the kernel reads it to its end.
            if content.backing is not None and content.backing.kernel_opens > 0:
                await self.writer.cut_backing(content, size)
            node.row.mtime_ns = mtime_ns if mtime_ns is not None else now
            if fh is None and node.opens == 0:
                await self.writer.commit(node)
        if mode is not None:
            fields["mode"] = (node.row.mode & stat.S_IFMT(0o170000)) | (mode & 0o7777)
        if kill_suidgid and stat.S_ISREG(node.row.mode):
            before = fields.get("mode", node.row.mode)
            if without_suidgid(before) != before:
                fields["mode"] = without_suidgid(before)
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
        return attrs_of(node)

    # ================================================================== xattr
    async def getxattr(self, ino: int, name: bytes) -> bytes:
        if name == _xattr.STATE:
            return (await self.durability.shown(await self.getattr(ino))).encode()
        _xattr.validate_name(name)
        return await self.meta.getxattr(ino, name)

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        try:
            _xattr.validate_set(name, value)
        except AiturboError as exc:
            if isinstance(exc, InvalidArgument) or isinstance(exc, NotPermitted):
                log.warning("setxattr %s on inode %d refused: %s", name.decode(errors="replace"), ino, exc)
            raise
        await self.meta.setxattr(ino, name, value, flags)
        node = self.inodes.get(ino)
        if node is not None:
            node.tags = None

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self.meta.listxattr(ino)

    async def removexattr(self, ino: int, name: bytes) -> None:
        if name == _xattr.STATE:
            raise NotPermitted("user.aiturbo.state is read-only")
        _xattr.validate_name(name)
        await self.meta.removexattr(ino, name)
        node = self.inodes.get(ino)
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

    async def open(self, ino: int, flags: int, *, uid: int = 0) -> tuple[Handle, bool]:
        """Open ``ino`` for the caller ``uid``; returns the handle and whether kernel pages stay valid."""
        node = await self.inodes.load(ino)
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
                await absorb(self.writer, node)  # another open the kernel serves has written it
            if content.size:
                await self.writer.truncate(node, content, 0)
                node.row.mtime_ns = now_ns()
            if kernel:
                await self.writer.cut_backing(content, 0)
            if uid != 0 and without_suidgid(row.mode) != row.mode:
                # as truncate(2) by a caller without CAP_FSETID (the kernel asks for that at a
                # truncating setattr, not here)
                row = await self.setattr(ino, kill_suidgid=True)
        elif writable and row.manifest is None and any(s is not None and s.is_external for s in content.slots):
            await self.reader.hash_external(node, content)
        if (writable and uid != 0 and without_suidgid(row.mode) != row.mode
                and content.backing is not None and content.backing.kernel_opens > 0):
            # The kernel serves the file itself (passthrough), so it must serve this open too, and
            # its writes never reach us to kill the set-user/group-ID bits: a writer without
            # CAP_FSETID kills them at open.  (A first such writer is served through requests,
            # whose WRITEs say when to kill them: ``open_kernel``.)
            row = await self.setattr(ino, kill_suidgid=True)
        handle = self.inodes.open_handle(node, flags)
        if not writable and not content.dirty:
            await self.reader.join_read_round(node)
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
        self.writer.release_pins(node, None)
        new = node.content = FileContent.from_manifest(node.row.size, node.row.manifest)
        new.backing, old.backing = old.backing, None
        new.kernel_behind = new.backing is not None and new.backing.kernel_opens > 0
        log.info("inode %d: version %d committed elsewhere replaces the content held here%s", node.ino,
                 node.row.version, " (descriptors open here read it from now on)" if node.opens else "")

    async def open_kernel(self, handle: Handle) -> int | None:
        """The backing file's descriptor if the kernel may serve ``handle`` itself (FUSE passthrough), else None."""
        return await open_kernel(self.writer, handle)

    async def close_kernel(self, handle: Handle) -> None:
        """``handle`` is not served by the kernel after all (it refused the backing file)."""
        if handle.kernel:
            await close_kernel(self.writer, handle)
            handle.inode.served += 1

    async def release(self, fh: int) -> None:
        handle = self.inodes.close_handle(fh)
        node = handle.inode
        try:
            if handle.kernel:
                await close_kernel(self.writer, handle)
            else:
                node.served -= 1
            # Only the last writer's: the kernel sends a RELEASE after close() has returned, and the
            # next open and write (of the same process, say) may come first.  What the file holds then
            # is no state the application committed, and a kill -9 brought it back.  The writer still
            # open commits at its own close (what a mapping wrote through this handle too).
            if handle.commits and node.writers == 1 and node.content is not None and node.content.dirty \
                    and node.row.nlink > 0:
                await self.writer.commit(node)
        finally:
            node.opens -= 1
            if handle.commits:
                node.writers -= 1
            await self.writer.release_unused(node)

    async def flush(self, fh: int) -> None:
        """close(): future 0, or future 1 with ``-o sync_close``."""
        handle = self.inodes.handle(fh)
        node = handle.inode
        if not handle.commits or node.content is None:
            return
        if being_written(node):
            await absorb(self.writer, node)
        if node.content.dirty and node.row.nlink > 0:
            await self.writer.commit(node)
        if self.options.sync_close and node.row.nlink > 0 and node.row.state != STATE_DURABLE:
            await self.wait_durable(node.ino)

    async def fsync(self, fh: int) -> None:
        handle = self.inodes.handle(fh)
        node = handle.inode
        if node.content is None:
            return
        if being_written(node):
            await absorb(self.writer, node)
        if node.content.dirty and node.row.nlink > 0:
            await self.writer.commit(node, sync=True)
        elif node.row.nlink > 0:
            await self.meta.sync()  # a close's unsynced commit: on disk now
        if node.row.nlink > 0 and await self._fsync_durable(node):
            await self.wait_durable(node.ino)

    async def _fsync_durable(self, node: Inode) -> bool:
        mode = (await self.inodes.tags(node)).get(_xattr.FSYNC)
        if mode is None:
            return self.options.fsync_durable
        return mode == b"durable"

    # ================================================================== bytes
    async def read(self, fh: int, offset: int, size: int):
        return await self.reader.read(self.inodes.handle(fh), offset, size)

    async def read_chunk(self, ino: int, index: int, key: bytes, length: int) -> bytes:
        """Chunk ``key`` (chunk ``index`` of ``ino``) for the cluster: a read round's prefetch, a chain successor."""
        return await self.reader.read_chunk(ino, index, key, length)

    async def write(self, fh: int, offset: int, data, *, kill_suidgid: bool = False) -> int:
        """``kill_suidgid``: the writer lacks CAP_FSETID (the kernel's FUSE_WRITE_KILL_SUIDGID), so the
        write kills the set-user/group-ID bits, as on a local filesystem (``without_suidgid``)."""
        node = self.inodes.handle(fh).inode
        if kill_suidgid and without_suidgid(node.row.mode) != node.row.mode:
            await self.setattr(node.ino, fh=fh, kill_suidgid=True)
        return await self.writer.write(node, offset, data)

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
        node = self.inodes.handle(fh).inode
        content = await self._content(node)
        end = offset + length
        size = size_of(node, content)
        if zero:
            await self.writer.zero_range(node, content, offset, min(end, size))
        if not mode & FALLOC_FL_KEEP_SIZE and end > size:
            await self.setattr(node.ino, fh=fh, size=end)

    async def lseek(self, fh: int, offset: int, whence: int) -> int:
        """lseek(2) SEEK_DATA / SEEK_HOLE (the kernel answers the other whences itself)."""
        if whence not in (os.SEEK_DATA, os.SEEK_HOLE):
            raise InvalidArgument(f"lseek whence {whence}: the kernel answers it itself")
        node = self.inodes.handle(fh).inode
        return await self.reader.lseek(node, await self._content(node), offset, whence)
