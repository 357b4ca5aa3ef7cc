"""The reconciler: makes the backend match the namespace for one inode.

A job compares what the metadata engine says (current paths, committed
version, state) with what the backend holds (``backend_keys`` at
``persisted_version``) and does what is missing: upload the committed
version (``Uploads.send``, then publish it with the inode's attributes),
move or copy after renames and hard links, delete after unlink (its
``Removals``, ``_remove``), write a
node's form, give the objects new attributes after a chmod, chown or utime
(where the backend keeps them: ``_push_attrs``, no data moves); then loops
until nothing changed meanwhile.  That is why renaming or deleting a file while it
persists leaves no ghost objects and loses no rename.

Objects are published, moved, deleted and their keys recorded under
``ns_lock`` (uploads send their data without it), so every inode's
``backend_keys`` match the backend whenever another job looks; operations
on one backend key are serialised by a per-key lock, and a key is only
deleted if no live inode's path names it (who has a claim on a key: its
``KeyClaims``, ``_claims``).  A file whose name another file's object
still occupies waits for it (``_defer``), moving its own objects at
others' names aside first (``Removals.give_way``), so swaps and cycles of
renames resolve.  ``ns_lock`` is the chunk store's (``store``: its fetch
and the importer take it too); the reconciler hands it to its
``Removals``, and each module says which of its methods take it and which
expect it held.

A backend directory's mtime moves whenever the persister changes an entry
of it: the directory is then queued to get its attributes again
(``_dir_changed``) a moment later, so a burst of files costs it one more
call and the backend's directories end with the namespace's mtimes, not
the persister's schedule.
"""

import errno
import functools
import logging
import stat
import time
from contextlib import asynccontextmanager
from typing import NamedTuple

import trio

from .._errors import AiturboError, BackendError, IntegrityError, TransientBackendError
from .._limits import PERSIST_BACKOFF_MAX_S
from ..backend import NodeAttrs, ObjectInfo
from ..meta import STATE_BROKEN, STATE_DURABLE, STATE_PERSISTING, STATE_STAGED, InodeRow
from ._claims import KeyClaims, parent_key
from ._host import PersistHost, PersistStats, is_mine
from ._remove import Removals
from ._upload import Uploads
from ._verify import holds_version

log = logging.getLogger("aiturbofs.persist")

# A file whose backend name another file still has to move away from waits
# this long before it tries again (see ``_defer``).
DEFER_RETRY_S = 0.1
# Hidden name prefix of an object moved out of the way (see ``_defer``).
# A publish or move refused because a directory (or a file, in the path) is
# in the way: a renamed directory not yet emptied, or one not yet removed.
# That clears once the other files have moved, so the file waits (_defer).
_CONFLICT_ERRNOS = frozenset({errno.EISDIR, errno.ENOTEMPTY, errno.ENOTDIR, errno.EEXIST})


class Published(NamedTuple):
    """What ``_upload_version`` saw right after it recorded the file durable: its row (read after the
    record) and its names (read under ``ns_lock`` after the publish).  A change after those reads queues
    the file again (a rename, link or unlink; a commit; a chmod, chown or utime of a durable file), so
    where they show nothing left to do, the job is done without reading them again."""

    row: InodeRow
    paths: list[str]


class _Deferred(Exception):
    """Another file must move its object away from our name first."""


class Reconciler:
    """Per-inode reconcile jobs (see module doc); the bookkeeping they share is its ``claims``, and its
    ``removals`` delete, move aside and clean up."""

    def __init__(self, host: PersistHost, stats: PersistStats, uploads: Uploads, queue):
        self.host = host
        self.meta = host.meta
        self.backend = host.backend
        self.pool = host.pool
        self.stats = stats
        self.uploads = uploads
        self._queue = queue  # the Persister: enqueue, running, and the backend-answers signal
        # The store's: held while backend objects are published, moved,
        # deleted and their keys recorded, so every inode's backend_keys match
        # the backend whenever another job looks (see KeyClaims.holder).
        # Uploads send their data without it and take it only to publish.
        self.ns_lock = host.store.ns_lock
        # The per-key locks, what moved (note_moved) and what went lately.
        self.claims = KeyClaims(self.meta, host, lambda ino: ino in queue.running)
        self.moved = self.claims.moved  # (the same dict: the queue asks it)
        self.removals = Removals(self.backend, self.meta, host, uploads, self.claims, self.ns_lock, self._dir_changed)
        self.defers: dict[int, int] = {}  # inode -> deferrals in a row (see _defer)
        self.trying: dict[int, int] = {}  # inode -> the version its running job uploads
        # Inodes whose running job is giving their objects new attributes: a
        # failure there leaves the data durable (see ``attrs_failed``).
        self.pushing_attrs: set[int] = set()
        # Durable directories whose backend mtime the persister moved (see
        # _dir_changed), queued to get their attributes again.
        self.dirs_changed: set[int] = set()

    def note_moved(self, ino: int, *, resumed: bool = False) -> None:
        """``ino``'s names changed: its objects may sit at names it no longer has (see ``KeyClaims.holder``).
        ``resumed``: by a run that stopped, perhaps after a backend move it did not record (``KeyClaims.settled``)."""
        self.moved[ino] = object()
        if resumed:
            self.claims.unsure.add(ino)

    def job_started(self, ino: int) -> None:
        if ino in self.moved:
            self.moved[ino] = object()  # its keys are read afresh: this job changes them

    def job_ended(self, ino: int, *, again: bool) -> None:
        """``again``: it was enqueued while it ran, and runs once more."""
        self.trying.pop(ino, None)
        self.pushing_attrs.discard(ino)
        if not again and not self._queue.dir_settling(ino):
            self.dirs_changed.discard(ino)  # pushed, or no longer a durable directory to push to
        if not again:
            self.moved.pop(ino, None)  # reconciled: its objects are at its names
            self.defers.pop(ino, None)

    def attrs_pending(self, row) -> bool:
        """Is ``row`` durable but its objects lack its current mode, owner or
        mtime?  (Only where the backend keeps them.)"""
        return (self.backend.keeps_attrs and row.state == STATE_DURABLE and row.persisted_version == row.version
                and (row.persisted_attrs != row.attrs() or row.ino in self.dirs_changed))

    def attrs_failed(self, ino: int) -> bool:
        """Did ``ino``'s job fail while it gave its objects new attributes?  Its data stays durable."""
        return ino in self.pushing_attrs

    async def clean_dir(self, path: str) -> None:
        """Remove the backend directory of a removed directory (``Removals.clean_dir``)."""
        await self.removals.clean_dir(path)

    async def claimed_keys(self, since: float) -> set[str]:
        """Backend keys the importer must not bring back as new names (``KeyClaims.claimed_keys``)."""
        return await self.claims.claimed_keys(since)

    async def reconcile(self, ino: int) -> None:
        """One job's work: loop until the backend matches the namespace for ``ino``."""
        self.pushing_attrs.discard(ino)  # a retry: what fails now is told apart afresh (attrs_failed)
        while True:
            row = await self.meta.get_inode(ino)
            if ino in self.claims.unsure:
                async with self.ns_lock:
                    row = await self.claims.settled(await self.meta.get_inode(ino))
            paths = await self.meta.paths_of(ino) if row.nlink > 0 else []
            if not paths:
                await self.removals.delete_all(row)
                return
            if row.state is None:
                return  # a node the backend does not keep: nothing there
            if row.state == STATE_BROKEN:
                return
            if not stat.S_ISREG(row.mode):
                if not await self._publish_node(row.ino):
                    await self._defer(row, paths)
                    return
                if self.attrs_pending(await self.meta.get_inode(ino)):
                    continue  # changed while it was written
                return
            if row.state != STATE_DURABLE or row.persisted_version != row.version:
                if not is_mine(self.host.cluster, row):
                    return  # its owner uploads it (and then reconciles the names it finds)
                self.trying[ino] = row.version  # what _mark_broken marks if this fails for good
                try:
                    uploaded = await self._upload_version(row, paths)
                except (BackendError, IntegrityError):
                    if (await self.meta.get_inode(ino)).version != row.version:
                        # Superseded meanwhile (truncated or rewritten: the old
                        # version's chunks may be gone): upload the new version
                        # rather than mark it broken for the old one's failure.
                        continue
                    raise
                if not uploaded:
                    await self._defer(row, paths)
                    return
                if isinstance(uploaded, Published) and self._done(uploaded.row, uploaded.paths):
                    return
                continue
            if sorted(row.backend_keys) != sorted(paths):
                if not await self._relocate(row, paths):
                    await self._defer(row, paths)
                    return
                continue
            if self.attrs_pending(row):
                await self._push_attrs(ino)
                continue
            return

    def _done(self, row, paths: list[str]) -> bool:
        """Is there nothing left to do for a file with ``row`` at ``paths``?  (The loop's checks.)"""
        return (row.ino not in self.claims.unsure and bool(paths) and row.state == STATE_DURABLE
                and row.persisted_version == row.version and sorted(row.backend_keys) == sorted(paths)
                and not self.attrs_pending(row))

    async def _publish_node(self, ino: int) -> bool:
        """A symlink, directory or special file: write its backend form at each
        of its names and remove it from the names it no longer has (there is
        no data to move: writing it again is cheaper than a copy).  False if
        another file must move its object away from one of our names first.
        """
        async with self.ns_lock:
            row = await self.meta.get_inode(ino)
            paths = await self.meta.paths_of(ino) if row.nlink > 0 else []
            if not paths or row.state is None or row.state == STATE_BROKEN:
                return True  # the reconcile loop deletes it, or there is nothing to do
            current = row.state == STATE_DURABLE and row.persisted_version == row.version
            if current and sorted(row.backend_keys) == sorted(paths):
                if self.attrs_pending(row):
                    await self._push_attrs_locked(row)
                return True
            if stat.S_IFMT(row.mode) not in self.backend.node_kinds:
                # Made when another backend was mounted on this metadata.
                log.info("node_metadata_only path=%s mode=%o (%s cannot hold it)", paths[0], row.mode, self.backend.url)
                await self.meta.set_attrs(ino, state=None)
                return True
            if row.state != STATE_PERSISTING and await self.meta.set_state(ino, STATE_PERSISTING, if_version=row.version):
                self.host.notify_state(ino)
            is_dir = stat.S_ISDIR(row.mode)
            node = NodeAttrs(row.mode, row.uid, row.gid, row.mtime_ns, row.rdev, row.target)
            done = [k for k in paths if current and k in row.backend_keys]
            for dst in paths:
                if dst in done:
                    continue
                # A directory shares its name with the objects below it: only
                # an object at its key or above it is in its way.
                placed = await self.claims.free_for(dst, ino, below=not is_dir)
                if placed:
                    async with self.claims.key_lock(dst):
                        placed = await self._place(self.backend.write_node, dst, dst, node)
                if not placed:
                    # Where our forms are so far: the stale ones go once we may write.
                    await self.meta.set_attrs(ino, backend_keys=sorted(set(row.backend_keys) | set(done)))
                    return False
                done.append(dst)
            for stale in row.backend_keys:
                if stale not in done:
                    if is_dir:
                        await self.removals.remove_dir_key(stale)
                    else:
                        await self.removals.delete_key(stale, ino)
            await self._dirs_changed(done)
            await self.meta.set_state(ino, STATE_DURABLE, if_version=row.version, backend_keys=done,
                                      persisted_version=row.version, persisted_attrs=row.attrs(), sync=False)
        await self.meta.sync()  # outside ns_lock: nodes in flight share the fsync
        self._queue.backend_answered()
        log.info("persisted_node path=%s mode=%o", ",".join(done), row.mode)
        await self.host.on_persisted(ino, await self.meta.get_inode(ino))
        return True

    async def _upload_version(self, row, paths: list[str]) -> bool | Published:
        """Upload the committed version; False if another file must move first, ``Published`` once it
        is durable (True: a newer version was committed meanwhile)."""
        started = time.monotonic()
        if row.state != STATE_PERSISTING:
            # Not synced: the durable state's sync covers it.  A power cut
            # before that leaves the backend object, if published, newer than
            # the row; the import then takes it as changed outside the mount
            # (its etag is not the row's), so the file reads as that version.
            if not await self.meta.set_state(row.ino, STATE_PERSISTING, if_version=row.version, sync=False):
                return True
            self.host.notify_state(row.ino)
        if await self.claims.held(paths, row.ino):
            return False  # before sending any data
        target = paths[0]
        try:
            upload = await self.uploads.send(row, target)
        except BackendError as exc:
            if exc.errno not in _CONFLICT_ERRNOS or isinstance(exc, TransientBackendError):
                raise
            log.info("%s: something is in the way (%s); waiting for it to go", target, exc)
            return False
        try:
            async with self.ns_lock:
                # The names may have changed while the data went out: publish
                # only where no other file lives or still keeps its object; a
                # target that is no longer ours is then moved like any rename.
                free, now = await self.claims.free_row(target, row.ino)
                if not free:
                    raise _Deferred
                published: list[ObjectInfo] = []
                await self.uploads.forget_sources(target)  # the object there is replaced
                # The attributes as they are now (a chmod while the data went
                # out included); a later change is pushed by the next loop.
                if now is None:  # (read by free_row where the target is still its name)
                    now = await self.meta.get_inode(row.ino)
                attrs = now.attrs()
                node = NodeAttrs(*attrs)
                if target not in now.backend_keys:
                    # Recorded before the object appears: a kill -9 between the publish and the durable
                    # record below left an object no row named, and when the file was unlinked meanwhile
                    # the restart deleted nothing and the import brought the removed name back.  Named
                    # before it is there, the key holds nothing or our own object (``free_for``), and
                    # the reconcile that follows a restart deletes or replaces it.
                    await self.meta.set_attrs(row.ino, backend_keys=[*now.backend_keys, target])
                async with self.claims.key_lock(target):
                    if not await self._place(lambda: self._complete(upload, row.size, node, published), target):
                        raise _Deferred
                info = published[0]
                done = [target]
                names = await self.meta.paths_of(row.ino)
                for extra in names:
                    if extra not in done and await self.claims.free_for(extra, row.ino):
                        named = [*now.backend_keys, *(k for k in done if k not in now.backend_keys)]
                        async with self.claims.key_lock(extra), self._naming_first(row.ino, named, extra):
                            if await self._place(functools.partial(self.backend.copy, attrs=node), extra, target, extra):
                                done.append(extra)
                for stale in row.backend_keys:
                    if stale not in done:
                        await self.removals.delete_key(stale, row.ino)
                await self._dirs_changed(done)
                # Synced below, once the lock is free: files in flight share
                # one fsync instead of taking turns at it under ns_lock.
                durable = await self.meta.set_state(
                    row.ino, STATE_DURABLE, if_version=row.version, sync=False, backend_keys=done,
                    persisted_version=row.version, backend_etag=info.etag, persisted_attrs=attrs,
                )
                if not durable:
                    # A newer version was committed meanwhile: it is not durable,
                    # but where this one's objects are must still be known (the
                    # stale ones are gone; an unrecorded one came back at import).
                    await self.meta.set_attrs(
                        row.ino, backend_keys=done, persisted_version=row.version, backend_etag=info.etag,
                        persisted_attrs=attrs,
                    )
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                try:
                    await upload.abort()  # a no-op once complete() published
                except AiturboError as abort_exc:
                    log.warning("abort of upload to %s failed: %s", paths[0], abort_exc)
            if isinstance(exc, _Deferred):
                return False
            raise
        if durable:
            await self.meta.sync()
            await self.uploads.record_sources(row, target, info.etag)
            self.stats.files_durable += 1
            self._queue.file_got_through()
            log.info("persisted path=%s size=%d s=%.2f version=%d", paths[0], row.size, time.monotonic() - started,
                     row.version)
            now = await self.meta.get_inode(row.ino)
            await self.host.on_persisted(row.ino, now)
            return Published(now, names)
        return True

    @staticmethod
    async def _complete(upload, size: int, attrs: NodeAttrs, out: list) -> None:
        out.append(await upload.complete(size, attrs=attrs))

    async def _relocate(self, row, paths: list[str]) -> bool:
        """Renamed or linked: move/copy the durable object, no re-upload.

        False (nothing done) if another file must move its object away from
        one of our names first.
        """
        src = row.backend_keys[0] if row.backend_keys else None
        if src is None:
            await self.meta.set_state(row.ino, STATE_STAGED, if_version=row.version)
            return True
        async with self.ns_lock:
            # Decide on what holds now: renames do not wait for this lock.
            row = await self.meta.get_inode(row.ino)
            paths = await self.meta.paths_of(row.ino) if row.nlink > 0 else []
            if (
                not paths or not row.backend_keys or sorted(row.backend_keys) == sorted(paths)
                or row.state != STATE_DURABLE or row.persisted_version != row.version
            ):
                return True  # changed meanwhile (e.g. a new version to upload): the reconcile loop looks again
            src = row.backend_keys[0]
            if await self.claims.held([dst for dst in paths if dst not in row.backend_keys], row.ino):
                return False
            keep = [k for k in row.backend_keys if k in paths]
            current = list(row.backend_keys)  # where our objects are, as we go
            for dst in paths:
                if dst in row.backend_keys:
                    continue
                async with self.claims.key_lock(dst), self._naming_first(row.ino, current, dst):
                    if keep:
                        copy = functools.partial(self.backend.copy, attrs=NodeAttrs(*row.persisted_attrs)
                                                 if row.persisted_attrs is not None else None)
                        placed = await self._place(copy, dst, keep[0], dst)
                        if placed:
                            current.append(dst)
                    else:
                        await self.uploads.forget_sources(src)
                        placed = await self._place_moved(row, src, dst)
                        if placed:
                            current[current.index(src)] = dst
                            keep = [dst]
                if not placed:
                    await self.meta.set_attrs(row.ino, backend_keys=current)  # (without the target named first)
                    return False
            for stale in row.backend_keys:
                if stale not in paths:
                    await self.removals.delete_key(stale, row.ino)
            # Recorded whatever the version: the objects did move.  (Only under
            # if_version, a commit racing with the move left backend_keys naming
            # a key that no longer exists, and the next upload could not fetch
            # unchanged chunks from it.)
            fields = {}
            if len(paths) == 1:  # a copy has a new etag: not a change made outside the mount
                info = await self.backend.stat(paths[0])
                fields["backend_etag"] = info.etag if info is not None else row.backend_etag
            await self._dirs_changed(paths)
            await self.meta.set_attrs(row.ino, backend_keys=paths, **fields)
            await self.meta.set_state(row.ino, STATE_DURABLE, if_version=row.version)
        log.info("moved_in_backend from=%s to=%s", ",".join(row.backend_keys), ",".join(paths))
        return True

    @asynccontextmanager
    async def _naming_first(self, ino: int, keys: list[str], target: str):
        """Name ``target`` among ``ino``'s backend keys before the body copies or moves an object there.

        A kill -9 between the backend's copy or move and the record that follows left an object no row
        named; when the name was gone by the restart (a link renamed away), the import brought it back
        as a file.  Named first, the restart finds it (``KeyClaims.settled`` keeps it only where it
        holds the file's version) and the reconcile deletes it like any stale key.  A body that fails
        leaves the file ``unsure``: the target may or may not hold its object.
        """
        await self.meta.set_attrs(ino, backend_keys=[*keys, target])
        try:
            yield
        except BaseException:
            self.claims.unsure.add(ino)
            raise

    async def _place_moved(self, row, src: str, dst: str) -> bool:
        """Move ``row``'s object from ``src`` to ``dst`` (see ``_place``).

        A move the backend made before a kill -9 and the metadata never
        recorded finds no ``src``: if ``dst`` holds exactly this version, that
        is the move, done.
        """
        try:
            return await self._place(self.backend.move, dst, src, dst)
        except BackendError as exc:
            if exc.errno != errno.ENOENT or isinstance(exc, TransientBackendError) \
                    or await holds_version(self.host, dst, row) is None:
                raise
            log.info("%s was moved to %s before the daemon stopped; recording it", src, dst)
            return True

    async def _defer(self, row, paths: list[str]) -> None:
        """Let the holder of one of our names move its object first.

        Our own objects at names another file lives at now are moved aside to
        hidden keys first: when files swap names (a cycle: a->tmp, b->a,
        tmp->b, or RENAME_EXCHANGE) each holds the other's target, and one
        of them has to give way.
        """
        await self.removals.give_way(row.ino, row.mode)
        waits = self.defers[row.ino] = self.defers.get(row.ino, 0) + 1
        if waits % 50 == 0:
            log.warning("inode %d has waited %d times for other files to move out of its backend names", row.ino, waits)
        await trio.sleep(min(DEFER_RETRY_S * (1 << min(waits // 20, 6)), PERSIST_BACKOFF_MAX_S))
        self._queue.enqueue(row.ino)  # runs again after this job ends

    async def _push_attrs(self, ino: int) -> None:
        """Give ``ino``'s objects its current mode, owner and mtime, without moving its data."""
        async with self.ns_lock:
            row = await self.meta.get_inode(ino)
            if self.attrs_pending(row):
                await self._push_attrs_locked(row)

    async def _push_attrs_locked(self, row) -> None:
        """``_push_attrs`` with ``ns_lock`` held and ``row`` read under it.

        What was asked is recorded whatever the backend did with it (an
        owner it may not set, a permanent error: logged), so the loop ends;
        a transient error is retried by the queue, and never breaks the file
        (``attrs_failed``).
        """
        attrs = row.attrs()
        self.pushing_attrs.add(row.ino)
        fields: dict = {"persisted_attrs": attrs}
        for key in row.backend_keys:
            try:
                async with self.claims.key_lock(key):
                    info = await self.backend.set_attrs(key, NodeAttrs(*attrs))
            except TransientBackendError:
                raise
            except BackendError as exc:
                log.warning("attributes of %s not persisted: %s", key, exc)
                continue
            if key == row.backend_keys[0] and stat.S_ISREG(row.mode) and info.etag != row.backend_etag:
                fields["backend_etag"] = info.etag  # counts the mtime: not a change made outside the mount
                await self.uploads.forget_sources(key)  # dedup copies name the etag
                await self.uploads.record_sources(row, key, info.etag)
        self.pushing_attrs.discard(row.ino)
        self.dirs_changed.discard(row.ino)
        if fields != {"persisted_attrs": row.persisted_attrs}:  # (a directory given its mtime back: the same)
            await self.meta.set_attrs(row.ino, **fields)
        self.stats.attrs_persisted += 1
        log.info("persisted_attrs path=%s mode=%o uid=%d gid=%d mtime_ns=%d", ",".join(row.backend_keys), *attrs)
        await self.host.on_persisted(row.ino, await self.meta.get_inode(row.ino))

    async def _dirs_changed(self, keys: list[str]) -> None:
        """``_dir_changed`` of the directories ``keys`` are in.  With ``ns_lock``."""
        for parent in dict.fromkeys(parent_key(key) for key in keys):
            await self._dir_changed(parent)

    async def _dir_changed(self, key: str, row=None) -> None:
        """The persister changed an entry of backend directory ``key``, which
        moved its mtime: queue the directory to get its attributes again.

        Where the backend keeps attributes, and ``key`` is a durable
        directory of the namespace (``row``, if the caller read it) other
        than the root, which keeps none.  Until then its state is
        ``persisting`` (``attrs_pending``).
        """
        if not self.backend.keeps_attrs or not key:
            return
        if row is None:
            row = await self.claims.lookup_path(key)
        if row is None or not stat.S_ISDIR(row.mode) or row.state != STATE_DURABLE:
            return
        self.dirs_changed.add(row.ino)
        self._queue.dir_changed(row.ino)

    async def _place(self, op, key: str, *args) -> bool:
        """Run ``op(*args)`` that writes ``key`` (publish, move, copy); False if
        something is in the way there (see _CONFLICT_ERRNOS).  An empty
        directory left at ``key`` is removed and the write tried again."""
        for attempt in range(2):
            try:
                await op(*args)
                return True
            except BackendError as exc:
                if exc.errno not in _CONFLICT_ERRNOS or isinstance(exc, TransientBackendError):
                    raise
                log.info("%s is in the way (%s); waiting for it to go", key, exc)
                if attempt == 0:
                    try:
                        await self.backend.remove_dir(key)  # does nothing unless an empty directory
                    except BackendError:
                        return False
        return False

