"""Lazy import of objects that already exist in the backend.

A directory is listed in the backend when it is looked up in or read and its
last import is older than the TTL (``-o import_ttl``).  The listing runs in
the background, at most one per directory: a lookup waits IMPORT_WAIT_S for
it and then answers from the metadata (stale-while-revalidate), so a backend
that stops answering never stalls a writer.  A directory never imported
before waits for its first listing while the backend is available.  While it
is unavailable (``store.BackendHealth``) nothing is listed and every lookup answers
from the metadata at once; the root is imported again when it answers, the
other directories at their next lookup.  New objects become
``durable`` files without a manifest (read by range, hashed on first write);
prefixes become directories; both with the mode, owner and mtime the
backend keeps (``Backend.keeps_attrs``; elsewhere 0644 or 0755 and the
mount's owner); symlinks, FIFOs and devices in the backend's
form of them (``Backend.read_node``) become those nodes; durable files whose
object changed outside the mount are refreshed; durable files and nodes
whose object vanished are removed, unless open.  Names that cannot be POSIX names (``..``, too long) are skipped with a
log line, so a backend key can never escape the mount.
"""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import trio

from .._errors import AiturboError, BackendError, BackendUnreachable, NotFound, TransientBackendError
from .._limits import (
    IMPORT_CREATE_BATCH_ENTRIES,
    IMPORT_DIRS_REMEMBERED_MAX,
    IMPORT_NODE_PROBES_IN_FLIGHT,
    IMPORT_READDIR_BATCH_ENTRIES,
    IMPORT_WAIT_S,
    LIST_ENTRIES_MAX,
    NAME_BYTES_MAX,
)
from .._nursery import open_nursery
from ..backend import ASIDE_PREFIX, NodeAttrs, ObjectInfo
from ..meta import ROOT_INO, STATE_DURABLE, InodeRow

if TYPE_CHECKING:
    from ..backend import Backend
    from ..meta import MetaStore
    from ..persist import Persister
    from ..store import BackendHealth, ChunkStore
    from ._inodes import InodeTable
    from ._options import VfsOptions
    from ._writer import Writer

log = logging.getLogger(__name__)


def _with_dirs(keys: set[str]) -> set[str]:
    """``keys`` and every directory above them."""
    out = set(keys)
    for key in keys:
        while "/" in key:
            key = key.rpartition("/")[0]
            if key in out:
                break
            out.add(key)
    return out


class _Listing:
    """One directory's import in flight."""

    __slots__ = ("first", "started", "done")

    def __init__(self, first: bool):
        self.first = first  # never imported before: lookups wait for it
        self.started = trio.current_time()
        self.done = trio.Event()


class ImportHost(Protocol):
    """What the import needs of the filesystem."""

    meta: MetaStore
    backend: Backend
    health: BackendHealth
    store: ChunkStore  # its ``ns_lock``
    options: VfsOptions
    persister: Persister
    inodes: InodeTable
    writer: Writer

    def spawn(self, fn: Callable[..., Awaitable[None]], *args) -> bool:
        """Run ``fn(*args)`` in the background; False before the filesystem started."""
        ...

    def record_error(self, message: str, event: str | None = None) -> None:
        """An operating error, for the log and ``aiturbo status``."""


class Importer:
    def __init__(self, fs: ImportHost):
        self.fs = fs
        self._busy: dict[int, _Listing] = {}
        # Directory -> an imported_ns it had: imported_ns only grows, so one
        # that is fresh here is fresh in the metadata too, and a lookup or
        # create in it needs no read of the directory's row.
        self._imported: dict[int, int] = {}

    def note_imported(self, ino: int, imported_ns: int) -> None:
        if len(self._imported) >= IMPORT_DIRS_REMEMBERED_MAX and ino not in self._imported:
            self._imported.clear()  # forgetting costs one row read per directory
        self._imported[ino] = max(imported_ns, self._imported.get(ino, 0))

    async def refresh_named(self, parent: int, name: bytes) -> None:
        try:
            row = await self.fs.meta.lookup(parent, name)
        except NotFound:
            return
        await self.refresh(row.ino)

    async def refresh_tree(self, ino: int) -> None:
        """``refresh`` directory ``ino`` and every directory below it.

        Before a directory is renamed: what only the backend holds below it
        (never listed by this mount) must be in the namespace to move with it,
        or it stayed at the old name and came back there at the next import.
        """
        stack = [ino]
        while stack:
            current = stack.pop()
            await self.refresh(current)
            async for _, row in self.fs.meta.children(current, IMPORT_READDIR_BATCH_ENTRIES):
                if stat.S_ISDIR(row.mode):
                    stack.append(row.ino)

    async def refresh(self, ino: int, row: InodeRow | None = None) -> None:
        """Import ``ino``'s backend listing if it is a directory older than the TTL.

        ``row``: ``ino``'s row, if the caller just read it.  Waits for the
        listing only as the module doc says; a failed listing is logged,
        never raised (the caller answers from the metadata).
        """
        listing = self._busy.get(ino)
        if listing is None:
            ttl_ns = self.fs.options.import_ttl_s * 1e9
            known = self._imported.get(ino)
            if known is not None and time.time_ns() - known < ttl_ns:
                return
            if row is None:
                row = await self.fs.meta.get_inode(ino)
            if not stat.S_ISDIR(row.mode):
                return
            self.note_imported(ino, row.imported_ns)
            if time.time_ns() - row.imported_ns < ttl_ns:
                return
            if not self.fs.health.available:
                return  # imported once the backend answers
            listing = self._busy.get(ino) or await self._start(row)
        if listing.first:
            await listing.done.wait()
        else:
            with trio.move_on_at(listing.started + IMPORT_WAIT_S):
                await listing.done.wait()

    def refresh_soon(self, ino: int) -> None:
        """Import ``ino`` in the background now (the backend answers again)."""
        self.fs.spawn(self._refresh_logged, ino)

    async def _refresh_logged(self, ino: int) -> None:
        try:
            await self.refresh(ino)
        except AiturboError as exc:
            log.warning("import of directory inode %d failed: %s", ino, exc)

    async def _start(self, row: InodeRow) -> _Listing:
        listing = self._busy[row.ino] = _Listing(first=row.imported_ns == 0)
        if not self.fs.spawn(self._run, row, listing):
            await self._run(row, listing)  # not started yet: no background
        return listing

    async def _run(self, row: InodeRow, listing: _Listing) -> None:
        try:
            await self._import(row)
        except AiturboError as exc:  # the directory went away, the metadata engine is down...
            log.warning("import of directory inode %d failed: %s", row.ino, exc)
        except Exception as exc:  # a bug: keep the daemon (and the other imports) going
            log.exception("BUG while importing directory inode %d", row.ino)
            self.fs.record_error(f"internal error importing directory inode {row.ino}: {exc!r}")
        finally:
            del self._busy[row.ino]
            listing.done.set()

    async def _import(self, dir_row: InodeRow) -> None:
        meta = self.fs.meta
        started = time.time_ns()
        listed_at = time.monotonic()
        if dir_row.ino == ROOT_INO:
            prefix = ""
        else:
            paths = await meta.paths_of(dir_row.ino)
            if not paths:
                return
            prefix = paths[0]
        # The persister publishes, moves and deletes objects only under the
        # store's ns_lock: holding it, the listing and every row's backend keys agree,
        # so an object mid-move is neither taken for an outside change (its
        # file refreshed to another file's bytes) nor for a vanished one.
        async with self.fs.store.ns_lock:
            await self._import_locked(dir_row, meta, prefix, started, listed_at)

    async def _import_locked(self, dir_row: InodeRow, meta, prefix: str, started: int, listed_at: float) -> None:
        # The namespace is read BEFORE the backend is listed: a file that
        # becomes durable while the listing runs must not look like a durable
        # file whose object vanished (it was removed from the namespace).
        existing = {name: row async for name, row in meta.children(dir_row.ino, IMPORT_READDIR_BATCH_ENTRIES)}
        try:
            infos = await self.fs.backend.list_dir(prefix)
        except BackendUnreachable as exc:
            # Not imported (a first import stays a first): listed again once
            # the backend answers, not every TTL while it does not.
            log.warning("import of %r from the backend failed: %s", prefix or "/", exc)
            self.fs.health.mark_down(f"listing {prefix or '/'}: {exc}")
            return
        except BackendError as exc:  # refused, or a 5xx: try again after the TTL
            log.warning("import of %r from the backend failed: %s", prefix or "/", exc)
            await meta.set_attrs(dir_row.ino, imported_ns=started)
            self.note_imported(dir_row.ino, started)
            return
        self.fs.health.mark_up()
        listed = set()
        new: list[tuple[bytes, InodeRow]] = []
        claimed: set[str] | None = None
        nodes = await self._probe_nodes(infos[:LIST_ENTRIES_MAX], existing)
        for info in infos[:LIST_ENTRIES_MAX]:
            name = info.key.rsplit("/", 1)[-1].encode("utf-8", "surrogateescape")
            if not name or name in (b".", b"..") or b"\0" in name or len(name) > NAME_BYTES_MAX:
                log.warning("import: skipping backend key %r (not a valid file name)", info.key)
                continue
            if name.startswith(ASIDE_PREFIX.encode()):
                continue  # the persister's, not a file (see ASIDE_PREFIX)
            listed.add(name)
            row = existing.get(name)
            if row is None:
                # An object the namespace no longer names but the persister has
                # yet to delete or move away (unlink, rename, rm -rf) is not a
                # new file: importing it would bring deleted files back.
                if claimed is None:
                    claimed = _with_dirs(await self.fs.persister.claimed_keys(listed_at))
                if info.key in claimed or (info.key in nodes and nodes[info.key] is None):
                    continue
                new.append((name, self._new_row(info, nodes.get(info.key))))
            elif row.state == STATE_DURABLE and stat.S_ISREG(row.mode) and not info.is_dir:
                await self._maybe_update(row, info)
        # In batches (a transaction each, not one per entry); a name a writer made meanwhile stays its.
        for at in range(0, len(new), IMPORT_CREATE_BATCH_ENTRIES):
            await meta.create_imported(dir_row.ino, new[at:at + IMPORT_CREATE_BATCH_ENTRIES])
        for name, row in existing.items():
            if (name not in listed and row.state == STATE_DURABLE and not stat.S_ISDIR(row.mode)
                    and row.backend_keys == [self._key(prefix, name)]):
                await self._remove(dir_row.ino, name, row)
        await meta.set_attrs(dir_row.ino, imported_ns=started)
        self.note_imported(dir_row.ino, started)

    @staticmethod
    def _key(prefix: str, name: bytes) -> str:
        n = name.decode("utf-8", "surrogateescape")
        return f"{prefix}/{n}" if prefix else n

    async def _probe_nodes(self, infos: list[ObjectInfo], existing: dict) -> dict[str, NodeAttrs | None]:
        """The nodes among the new entries: those the listing shows as nodes,
        and (S3) small objects whose metadata may say so, HEADed in parallel.
        None: could not tell now (a transient error); such entries wait for the next import."""
        backend = self.fs.backend
        wanted = [
            info.key for info in infos
            if not info.is_dir and info.key.rsplit("/", 1)[-1].encode("utf-8", "surrogateescape") not in existing
            and (stat.S_IFMT(info.mode) not in (0, stat.S_IFREG) or info.size <= backend.node_probe_bytes_max)
        ]
        found: dict[str, NodeAttrs | None] = {}
        limit = trio.Semaphore(IMPORT_NODE_PROBES_IN_FLIGHT)

        async def probe(key: str) -> None:
            async with limit:
                try:
                    node = await backend.read_node(key)
                except TransientBackendError as exc:
                    log.warning("import: %r skipped this time (is it a symlink?): %s", key, exc)
                    found[key] = None  # not imported now: the next listing asks again
                    return
                except BackendError as exc:
                    log.warning("import: %r imported as a plain file: %s", key, exc)
                    return
            if node is not None:
                found[key] = node

        async with open_nursery() as nursery:
            for key in wanted:
                nursery.start_soon(probe, key)
        return found

    def _new_row(self, info: ObjectInfo, node: NodeAttrs | None) -> InodeRow:
        """The row of an entry the listing shows and the namespace lacks (``node``: what a probe found)."""
        opts = self.fs.options
        mtime = info.mtime_ns or time.time_ns()
        uid = opts.owner_uid if info.uid is None else info.uid
        gid = opts.owner_gid if info.gid is None else info.gid
        if info.is_dir:
            # Durable: the directory is there, so its rename moves its marker.
            mode = info.mode if stat.S_ISDIR(info.mode) else stat.S_IFDIR | 0o755
            row = InodeRow(ino=0, mode=mode, uid=uid, gid=gid, size=0, nlink=2,
                           atime_ns=mtime, mtime_ns=mtime, ctime_ns=mtime, state=STATE_DURABLE,
                           backend_keys=[info.key], persisted_version=0)
        elif node is not None:
            mtime = node.mtime_ns or mtime
            target = node.target if stat.S_ISLNK(node.mode) else None
            row = InodeRow(ino=0, mode=node.mode, size=len(target) if target else 0, nlink=1,
                           uid=opts.owner_uid if node.uid is None else node.uid,
                           gid=opts.owner_gid if node.gid is None else node.gid,
                           atime_ns=mtime, mtime_ns=mtime, ctime_ns=mtime, rdev=node.rdev, target=target,
                           state=STATE_DURABLE, backend_keys=[info.key], persisted_version=0)
        else:
            mode = info.mode if stat.S_ISREG(info.mode) else stat.S_IFREG | 0o644
            row = InodeRow(ino=0, mode=mode, uid=uid, gid=gid, size=info.size, nlink=1,
                           atime_ns=mtime, mtime_ns=mtime, ctime_ns=mtime, state=STATE_DURABLE, manifest=None,
                           backend_keys=[info.key], backend_etag=info.etag, persisted_version=0)
        # What the backend holds of it, or (where it keeps no attributes) stands in for that.
        row.persisted_attrs = row.attrs()
        return row

    async def _maybe_update(self, row: InodeRow, info) -> None:
        if info.etag is None or info.etag == row.backend_etag or row.backend_keys != [info.key]:
            return
        fresh = await self.fs.meta.get_inode(row.ino)
        if fresh.version != row.version or fresh.state != STATE_DURABLE or fresh.backend_etag != row.backend_etag:
            return  # persisted through the mount since the namespace was read: not an outside change
        node = self.fs.inodes.get(row.ino)
        if node is not None and (node.opens or (node.content is not None and node.content.dirty)):
            return
        log.info("import_changed key=%s (changed in the backend: dropping the cached content)", info.key)
        if node is not None:
            self.fs.writer.drop_content(node)
        fields = {"mode": info.mode if stat.S_ISREG(info.mode) else row.mode,
                  "uid": row.uid if info.uid is None else info.uid, "gid": row.gid if info.gid is None else info.gid,
                  "mtime_ns": info.mtime_ns or row.mtime_ns}
        fields["persisted_attrs"] = (fields["mode"], fields["uid"], fields["gid"], fields["mtime_ns"])
        new = await self.fs.meta.set_attrs(row.ino, size=info.size, manifest=None, backend_etag=info.etag, **fields)
        if node is not None:
            node.row = new
            # The version did not change (it counts commits through the mount),
            # so say explicitly that the kernel's cached pages are stale.
            node.cached_version = -1

    async def _remove(self, parent: int, name: bytes, row: InodeRow) -> None:
        node = self.fs.inodes.get(row.ino)
        if node is not None and node.opens:
            return
        try:
            # the name may have been given to another file since the listing
            current = await self.fs.meta.lookup(parent, name)
            if current.ino != row.ino or current.state != STATE_DURABLE or current.backend_keys != row.backend_keys:
                return
            log.info("import_vanished key=%s (gone from the backend: removing it)", row.backend_keys[0])
            gone = await self.fs.meta.unlink(parent, name)
        except NotFound:
            return
        if gone.nlink == 0 and node is None:
            await self.fs.meta.delete_inode(gone.ino)
        elif node is not None:
            node.row.nlink = gone.nlink
