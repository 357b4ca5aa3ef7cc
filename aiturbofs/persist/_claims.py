"""Who has a claim on a backend key: the bookkeeping every reconcile job shares.

A backend key may be the name of a file or directory of the namespace
(``lookup_path``), still hold the object of an inode renamed or unlinked
since, whose job has yet to move or delete it (``holder``: such inodes are
in ``moved``), be worked on right now (``key_lock``: operations on one key
are serialised), or have been removed or moved away lately (``note_vacated``).
Writing a key another inode holds would destroy that inode's only backend
copy (``free_for``); the importer must not bring any claimed key back as a
new name (``claimed_keys``).

``KeyClaims`` takes no lock of its own beyond the per-key locks, and none
of its methods takes the store's ``ns_lock`` (the reconciler holds it).
``free_for`` expects it held, and so do its callers' uses of ``holder``, ``lookup_path``,
``is_dir_of_namespace``, ``note_vacated`` and ``key_lock`` (the publish,
move, delete, defer and attribute paths), so what they find still holds
when they write; the importer holds it around ``claimed_keys``.  Only an
upload's first look (``held``, before it sends any data) runs without it:
it looks again with ``free_for`` under the lock to publish.
``moved_keys`` keeps what it read of a moved inode's keys until that
inode's job starts or it is enqueued again (not while its job runs: the
job may change them).

A kill -9 may cut a job between a backend move and its record, so a
restart may find an inode's object at one of its new names, or at the
hidden key of a move aside, while its row still names the old key.  Such
inodes are ``unsure`` until ``settled`` has looked at the backend once
(with ``ns_lock``): before their own job runs, and before another job
deletes or moves aside an object at one of their names.
"""

import logging
import stat
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import trio

from .._errors import NotFound
from ..meta import STATE_BROKEN, STATE_DURABLE, MetaStore
from ._host import PersistHost
from ._verify import holds_version

log = logging.getLogger("aiturbofs.persist")

# How long a backend key removed or moved away is remembered, so that an
# import whose listing started before the removal does not bring it back.
VACATED_KEEP_S = 600.0


def parent_key(key: str) -> str:
    """The backend directory ``key`` is in ('' for the root)."""
    return key.rpartition("/")[0]


class KeyClaims:
    """Backend keys and who holds, works on or lately vacated them (see module doc)."""

    def __init__(self, meta: MetaStore, host: PersistHost, is_running: Callable[[int], bool]):
        self.meta = meta
        self.host = host
        self._is_running = is_running  # does this inode's reconcile job run now (and may change its keys)?
        self.key_locks: dict[str, list] = {}
        self._vacated: dict[str, float] = {}  # backend key/dir -> monotonic time it went away
        # Queued inodes whose names changed (see Reconciler.note_moved) -> (live, backend_keys)
        # as last read, or a fresh ``object()`` until read; only the inode's
        # own job changes its keys, and a job start or a new enqueue forgets them.
        self.moved: dict[int, object] = {}
        # Inodes whose recorded backend keys may lag the backend: a restart resumed their moves, or a move
        # aside failed midway (see ``settled``).
        self.unsure: set[int] = set()

    def note_vacated(self, key: str) -> None:
        now = time.monotonic()
        self._vacated.pop(key, None)
        self._vacated[key] = now  # insertion order is time order: old ones go from the front
        while self._vacated:
            oldest, when = next(iter(self._vacated.items()))
            if when >= now - VACATED_KEEP_S:
                break
            del self._vacated[oldest]

    async def is_dir_of_namespace(self, key: str) -> bool:
        row = await self.lookup_path(key)
        return row is not None and stat.S_ISDIR(row.mode)

    async def holder(self, key: str, ino: int, *, below: bool = True) -> int | None:
        """Another inode whose persisted object is still at ``key`` although
        its name is elsewhere now (a chain of renames, RENAME_EXCHANGE): it
        has yet to move that object away, so writing ``key`` would destroy
        its only backend copy.  Such an inode is always queued here, as moved.
        ``below=False``: objects below ``key`` are no obstacle (a directory's
        own form shares its name with them)."""
        above = set()
        parent = key.rpartition("/")[0]
        while parent:
            above.add(parent)
            parent = parent.rpartition("/")[0]
        for other in list(self.moved):
            if other == ino:
                continue
            holds, keys = await self.moved_keys(other)
            # also objects below ``key`` (a backend directory still in use
            # there) or at a directory above it (a file where one is needed)
            if holds and any(k == key or (below and k.startswith(key + "/")) or k in above for k in keys):
                return other
        return None

    async def free_for(self, key: str, ino: int, *, below: bool = True) -> bool:
        """With ``ns_lock`` held: may ``ino`` write its object at ``key``?  (``below``: see holder)"""
        return (await self.free_row(key, ino, below=below))[0]

    async def free_row(self, key: str, ino: int, *, below: bool = True):
        """``free_for``, and ``ino``'s row as read then if ``key`` is its name (else None)."""
        owner = await self.lookup_path(key)
        if owner is not None and owner.ino != ino:
            return False, None  # another file or a directory has that name now
        return await self.holder(key, ino, below=below) is None, owner

    async def held(self, keys: list[str], ino: int) -> bool:
        for key in keys:
            if await self.holder(key, ino) is not None:
                return True
        return False

    async def moved_keys(self, ino: int) -> tuple[bool, list[str]]:
        """(holds its keys: linked, not broken, not a directory; backend keys) of a moved inode, cached.

        A directory's old form is no file's only copy: names below it may be
        written or deleted, and a file at its very key meets it as a conflict
        (``_place``).
        """
        marker = self.moved.get(ino)
        if isinstance(marker, tuple):
            return marker
        try:
            row = await self.meta.get_inode(ino)
            # (an unlinked file still open holds its objects too, until they are moved aside)
            holds = ((row.nlink > 0 or self.host.is_open(ino)) and row.state != STATE_BROKEN
                     and not stat.S_ISDIR(row.mode))
            known = (holds, list(row.backend_keys))
        except NotFound:
            known = (False, [])
        if ino in self.moved and self.moved[ino] is marker and not self._is_running(ino):
            self.moved[ino] = known  # not while its job runs: it may change them
        return known

    async def claimed_keys(self, since: float) -> set[str]:
        """Backend keys the importer must not bring back as new names (directories to clean: the queue's).

        These are the keys of inodes queued here after a name change (the
        object is about to be moved or deleted: unlinked, renamed), of unlinked inodes
        still open or known to the kernel, keys being worked on, and keys
        removed at or after ``since`` (a ``time.monotonic()``: when the
        importer's listing started, so the listing may still show them).
        """
        keys = set(self.key_locks)
        keys.update(key for key, when in self._vacated.items() if when >= since)
        keys |= self.host.unlinked_keys()
        for ino in list(self.moved):
            keys.update((await self.moved_keys(ino))[1])
        return keys

    async def lookup_path(self, key: str):
        """The row the namespace has at backend path ``key``, or None."""
        return await self.meta.lookup_path(key)

    async def owner_of(self, key: str):
        """``lookup_path``, ``settled``: the file at ``key`` with its keys as the backend has them.  With
        ``ns_lock``."""
        row = await self.lookup_path(key)
        return None if row is None else await self.settled(row)

    async def settled(self, row):
        """``row`` with its backend keys as the backend has them, if it is ``unsure``.  With ``ns_lock``.

        The record of a backend step made before a kill -9 may lag it.  Every copy, move, move aside and
        publish names its target in the row first (``Reconciler._naming_first``, ``_upload_version``,
        ``Removals._move_aside``), so the row may name a target that holds nothing (dropped here), or
        still holds what was there before, the replaced file's object (kept at one of the file's names
        only if it holds exactly its version: size, every chunk's BLAKE3).  A name of the file holding
        exactly its version is added (a move an older run made before it named its targets).  Until
        then the replaced file's delete took the moved object for its own stale one and deleted the
        renamed file's only copy.  Once per unsure inode; a file with one key (the usual restart)
        costs one ``stat``, and the hashing is of a key at one of its names beyond the first.
        """
        if row.ino not in self.unsure:
            return row
        if not stat.S_ISREG(row.mode):
            self.unsure.discard(row.ino)  # a node's form is written again at its names, never moved
            return row
        current = row.state == STATE_DURABLE and row.persisted_version == row.version
        paths = await self.meta.paths_of(row.ino) if row.nlink > 0 else []
        present, hashed = [], set()
        for i, key in enumerate(row.backend_keys):
            info = await self.host.backend.stat(key)
            if info is None or info.is_dir:
                continue
            # A target named first may still hold what was there before (the replaced file's object):
            # taken for ours, it would be served.  Kept at one of the file's names only if it is
            # exactly this version.  The first key was recorded once placed; a key at no name of the
            # file is deleted as stale anyway (and may hold an older version: ``_recover_from_backend``).
            # A version not yet durable is uploaded again, over its target.
            if current and i > 0 and key in paths:
                hashed.add(key)
                if await holds_version(self.host, key, row) is None:
                    continue
            present.append(key)
        if present != row.backend_keys:
            fields = {}
            if current:
                for path in paths:
                    info = None if path in present or path in hashed else await holds_version(self.host, path, row)
                    if info is not None:
                        present.append(path)
                        if len(present) == 1:  # its only object now: an etag the import must not take for a change
                            fields["backend_etag"] = info.etag
            log.info("backend keys of ino=%d were %s and are %s (the record of a move lagged the backend)",
                     row.ino, ",".join(row.backend_keys) or "-", ",".join(present) or "-")
            row = await self.meta.set_attrs(row.ino, backend_keys=present, **fields)
            if row.ino in self.moved:
                self.moved[row.ino] = object()  # read its keys afresh
        self.unsure.discard(row.ino)
        return row

    @asynccontextmanager
    async def key_lock(self, key: str):
        entry = self.key_locks.get(key)
        if entry is None:
            entry = self.key_locks[key] = [trio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self.key_locks[key]
