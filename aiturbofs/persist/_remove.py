"""Removals: the persister's deletes, moves aside and backend directory cleanup.

What goes from the backend when names go from the namespace: the objects
of an unlinked inode (``delete_all``; an unlinked file still open keeps
them at hidden keys beside its old names until its last close), a stale
object at a name an inode no longer has (``delete_key``: unless another
live inode's own object is there now or a moved inode still holds it there), a
directory's backend directory after a rename or rmdir (``remove_dir_key``,
``clean_dir``) and the emptied backend directories above them
(``_prune_dirs``).  A file that must wait for another to move out of its
name first moves its own objects at other files' names aside
(``give_way``), so swaps and cycles of renames resolve.  Each removal
queues the backend directory that lost an entry for its attributes again
(``dir_changed``, the reconciler's).

Locking: ``clean_dir``, ``delete_all`` and ``give_way`` take ``ns_lock``
themselves; ``delete_key``, ``remove_dir_key`` and the private methods
expect it held (the reconciler calls them from its publish and move
paths, under it).  Each backend key is touched under its ``key_lock``.
"""

import errno
import logging
import secrets
import stat
from typing import Protocol

import trio

from .._errors import BackendError, TransientBackendError
from ..backend import ASIDE_PREFIX, Backend
from ..meta import InodeRow, MetaStore
from ._claims import KeyClaims, parent_key
from ._host import PersistHost
from ._upload import Uploads

log = logging.getLogger("aiturbofs.persist")


class DirChanged(Protocol):
    """``Reconciler._dir_changed``: backend directory ``key`` (the namespace's ``row`` there, if read) lost an entry."""

    async def __call__(self, key: str, row: InodeRow | None = None) -> None: ...


class Removals:
    """Deletes, moves aside and backend directory cleanup for the reconciler (see module doc)."""

    def __init__(
        self, backend: Backend, meta: MetaStore, host: PersistHost, uploads: Uploads, claims: KeyClaims,
        ns_lock: trio.Lock, dir_changed: DirChanged,
    ):
        self.backend = backend
        self.meta = meta
        self.host = host
        self.uploads = uploads
        self.claims = claims
        self.ns_lock = ns_lock  # the store's, as the reconciler holds it (see module doc: who holds it where)
        self._dir_changed = dir_changed  # a backend directory lost an entry: its mtime moved

    async def clean_dir(self, path: str) -> None:
        """Remove the backend directory of a removed directory (does nothing unless empty)."""
        try:
            async with self.ns_lock:
                if not await self.claims.is_dir_of_namespace(path):  # made again meanwhile: it is that one's now
                    await self.backend.remove_dir(path)
                    self.claims.note_vacated(path)
                    await self._dir_changed(parent_key(path))
        except BackendError as exc:
            log.info("backend directory %s not removed: %s", path, exc)

    async def _move_aside(self, ino: int, keys: list[str], i: int) -> str | None:
        """Move ``ino``'s object at ``keys[i]`` to a hidden key beside it and record it there.  With ``ns_lock``."""
        key = keys[i]
        head, _, _ = key.rpartition("/")
        aside = f"{head}/" if head else ""
        aside += f"{ASIDE_PREFIX}{secrets.token_hex(8)}"
        # Both names stay locked until the keys are recorded: an import
        # listing meanwhile must not take the hidden name for a new file.
        async with self.claims.key_lock(key), self.claims.key_lock(aside):
            await self.uploads.forget_sources(key)
            # Named beside the key first: a kill -9 between the move and the record below left the
            # object at a hidden key no row named, and the file's only copy was gone for the restart.
            # Until the record, the object is at one of the two (``KeyClaims.settled`` keeps that one).
            await self.meta.set_attrs(ino, backend_keys=[*(k for k in keys if k), aside])
            moved: str | None = aside
            try:
                await self.backend.move(key, aside)
            except BackendError as exc:
                if exc.errno != errno.ENOENT or isinstance(exc, TransientBackendError):
                    self.claims.unsure.add(ino)  # (S3: copied, perhaps not deleted): the next look settles it
                    raise
                # Nothing of ours there: a key recorded before a publish that never happened
                # (``Reconciler._upload_version`` names it first).  Nothing to move: forget it.
                moved = None
            keys[i] = moved or ""  # ("": forgotten; callers drop it, and so does every record)
            await self.meta.set_attrs(ino, backend_keys=[k for k in keys if k])
        if moved is not None:
            await self._dir_changed(head)
        return moved

    async def _keep_aside(self, ino: int) -> None:
        """An unlinked file still open: its objects leave its old names (another file may take them) but stay,
        at hidden keys, for the reads of its open descriptors.  The last close queues it again to delete them.
        With ``ns_lock``."""
        keys = list((await self.meta.get_inode(ino)).backend_keys)
        for i, key in enumerate(list(keys)):
            if key.rpartition("/")[2].startswith(ASIDE_PREFIX):
                continue
            owner = await self.claims.owner_of(key)
            if owner is not None and owner.state is not None and key in owner.backend_keys:
                keys[i] = ""  # another file's object is there now: ours was replaced before we could move it
                continue
            await self._move_aside(ino, keys, i)
        if "" in keys:
            await self.meta.set_attrs(ino, backend_keys=[k for k in keys if k])

    async def delete_all(self, row) -> None:
        """``row`` has no name left: delete its objects (an open file's go aside) and its row.  Takes ``ns_lock``."""
        async with self.ns_lock:
            if self.host.is_open(row.ino) and stat.S_ISREG(row.mode):
                await self._keep_aside(row.ino)
                return
            for key in row.backend_keys:
                await self.delete_key(key, row.ino)
            if not self.host.is_cached(row.ino):
                await self.meta.delete_inode(row.ino)
            else:
                await self.meta.set_state(row.ino, row.state, backend_keys=[])

    async def delete_key(self, key: str, ino: int) -> None:
        """Delete ``ino``'s stale object at ``key`` unless it is another file's now.

        Called with ``ns_lock`` held.
        """
        async with self.claims.key_lock(key):
            owner = await self.claims.owner_of(key)
            if owner is not None and owner.ino != ino and owner.state is not None and key in owner.backend_keys:
                return  # the file that has this name now put its own object there
            # ``ino`` itself at ``key`` again (renamed back while its job ran):
            # the object there is an older version of its own, and the caller
            # drops the key from the row, so kept it would be named by nothing.
            if await self.claims.holder(key, ino) is not None:
                return  # another file's object, about to be moved from here (renamed again)
            # Otherwise the object is stale even if a file has the name now: that
            # file has not written it yet (it does so under this lock, later),
            # and it may be renamed away first, which left the object orphaned
            # for an import to bring back as a deleted file.
            await self.uploads.forget_sources(key)
            await self.backend.delete(key)
            self.claims.note_vacated(key)
        await self._prune_dirs(key)

    async def remove_dir_key(self, key: str) -> None:
        """A directory moved away from ``key``: its backend directory (marker)
        goes where empty, and so do the emptied ones above it.  With ``ns_lock``."""
        if await self.claims.is_dir_of_namespace(key):
            return  # another directory has that name now
        try:
            await self.backend.remove_dir(key)  # does nothing unless empty: files still moving out
        except BackendError as exc:
            log.info("backend directory %s not removed: %s", key, exc)
            return
        self.claims.note_vacated(key)
        await self._prune_dirs(key)

    async def _prune_dirs(self, key: str) -> None:
        """Remove the backend directories above ``key`` that the namespace no
        longer has, deepest first, where they are now empty.

        They are the old names of renamed or removed directories: the
        directory's own rmdir cleanup may have run before its files were
        moved or deleted, and an import would show them again as ghosts.
        """
        parent = key.rpartition("/")[0]
        while parent:
            row = await self.claims.lookup_path(parent)
            if row is not None and stat.S_ISDIR(row.mode):
                await self._dir_changed(parent, row)  # it lost an entry
                return  # still a directory of the namespace (and so are its ancestors)
            try:
                await self.backend.remove_dir(parent)  # does nothing unless empty
            except BackendError as exc:
                log.info("backend directory %s not removed: %s", parent, exc)
                return
            self.claims.note_vacated(parent)
            parent = parent.rpartition("/")[0]

    async def give_way(self, ino: int, mode: int) -> None:
        """Move ``ino``'s objects at names another file lives at now to hidden
        keys, so that file can write there (for ``Reconciler._defer``: when
        files swap names, each holds the other's target and one has to give
        way).  Keys where that file's own object already replaced ours are
        forgotten; a directory's old form stays (other files' objects are
        below it).  Takes ``ns_lock``.
        """
        async with self.ns_lock:
            keys = list((await self.meta.get_inode(ino)).backend_keys)
            paths = await self.meta.paths_of(ino)
            replaced = []
            for i, key in enumerate(keys):
                if key in paths:
                    continue
                owner = await self.claims.owner_of(key)
                if owner is None or owner.state is None:
                    continue
                if key in owner.backend_keys:
                    # Its own object is there now: ours was replaced while
                    # nothing needed it (we were unlinked meanwhile; this job
                    # decided to wait before that).  Moving it aside would
                    # take that file's only copy.
                    replaced.append(key)
                    continue
                if await self.claims.holder(key, ino) is not None:
                    continue
                if stat.S_ISDIR(mode):
                    continue  # a directory's old form holds other files' objects: it goes once they moved
                aside = await self._move_aside(ino, keys, i)
                if aside is not None:
                    log.info("moved %s aside to %s: another file takes that name first", key, aside)
            if replaced:
                keys = [k for k in keys if k and k not in replaced]
                await self.meta.set_attrs(ino, backend_keys=keys)
