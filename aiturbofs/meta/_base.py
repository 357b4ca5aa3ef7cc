"""The metadata engine's contract: ``MetaStore``, its row types and states.

This module owns the vocabulary every engine (SQLite, PostgreSQL) implements
and every caller (vfs, persister, controller) relies on.  It holds no I/O.
It must never import anything of the filesystem beyond ``_limits`` and
``_errors``: the metadata layer sits below everything that uses it.

Conventions shared by every method:

- Every public method is ``async`` and runs as ONE transaction: either all of
  its effects are visible to other stores (other daemons) or none are.
- Names are ``bytes`` (any bytes except ``b"/"`` and ``b"\\0"``, not ``b"."``
  or ``b".."``, at most ``NAME_BYTES_MAX`` long).
- Timestamps are integer nanoseconds since the epoch.  Bookkeeping times the
  engine sets itself (a parent's mtime on create, ctime on rename...) come from
  the engine's host clock.
- Operating errors are ``aiturbofs._errors`` classes; the fuse layer maps
  them to errno.  Wrong arguments that only a bug can produce (an unknown
  state, a field that does not exist) raise ``ValueError``.
"""

from __future__ import annotations

import collections
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

STATE_STAGED = "staged"  # every byte is in the cluster DRAM pool (future 0)
STATE_PERSISTING = "persisting"  # an upload of the current version is running
STATE_DURABLE = "durable"  # backend_keys hold the current version (future 1)
STATE_BROKEN = "broken"  # data lost or persist failed for good: reads get EIO
STATES = frozenset({STATE_STAGED, STATE_PERSISTING, STATE_DURABLE, STATE_BROKEN})

NODE_ALIVE = "alive"  # a member of the cluster, heartbeating
NODE_DEAD = "dead"  # missed its heartbeats: its DRAM pool is written off
NODE_LEFT = "left"  # drained and left on purpose
NODE_STATES = frozenset({NODE_ALIVE, NODE_DEAD, NODE_LEFT})

ROOT_INO = 1

# Xattrs under this prefix are aiturbo's own settings (group tag, fsync
# policy...).  A child inherits them from its directory at create, except the
# state: that one describes a single file and is never copied.
INHERIT_XATTR_PREFIX = b"user.aiturbo."
STATE_XATTR = b"user.aiturbo.state"


@dataclass
class InodeRow:
    """One inode as the metadata engine stores it.

    ``manifest`` is the concatenation of the file's 32-byte BLAKE3 chunk hashes
    (chunk i is ``manifest[32*i : 32*i + 32]``); an all-zero hash is a hole.
    ``None`` means unknown: the file was imported from the backend and not
    hashed yet.  ``version`` is bumped by every ``commit_manifest`` and is the
    token of the ``set_state`` compare-and-set; ``persisted_version`` is the
    version that ``backend_keys`` hold (-1: none).  In a cluster, ``owner``
    is the node that persists the current version and ``holders`` the nodes
    whose DRAM pool holds its chunks; a new version starts with neither.
    """

    ino: int
    mode: int  # full st_mode, file type bits included
    uid: int
    gid: int
    size: int
    nlink: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0
    target: bytes | None = None  # symlink target
    state: str | None = None  # one of STATES: regular files, and other nodes the backend keeps (else None)
    version: int = 0
    manifest: bytes | None = None
    backend_keys: list[str] = field(default_factory=list)
    backend_etag: str | None = None  # to notice a change made outside the mount
    imported_ns: int = 0  # dirs: when the backend listing was last imported
    persisted_version: int = -1
    owner: str | None = None  # node persisting the current version (None: single node)
    holders: list[str] = field(default_factory=list)  # nodes with its chunks in DRAM
    persisted_attrs: tuple[int, int, int, int] | None = None  # see attrs()

    def attrs(self) -> tuple[int, int, int, int]:
        """``(mode, uid, gid, mtime_ns)``: what a backend that keeps attributes
        holds of this inode beside its bytes (``Backend.keeps_attrs``)."""
        return (self.mode, self.uid, self.gid, self.mtime_ns)


@dataclass
class NodeRow:
    """One member of the cluster as the controller last recorded it.

    ``info`` is a small JSON-able dict the node reports (bandwidths, DRAM).
    """

    name: str
    address: str
    state: str  # one of NODE_STATES
    heartbeat_ns: int
    info: dict


@dataclass
class ChunkSource:
    """Where a chunk's bytes already are in the backend: ``length`` bytes at
    ``offset`` of the object ``backend_key`` (whose etag was ``etag`` then)."""

    backend_key: str
    offset: int
    length: int
    etag: str | None


INODE_FIELDS = tuple(f.name for f in dataclasses.fields(InodeRow))
# Fields a caller may change with set_attrs; ino is the identity.
SETTABLE_FIELDS = frozenset(INODE_FIELDS) - {"ino"}


class MetaStore(ABC):
    """The namespace, manifests, durability states and xattrs of one mount.

    Several stores (daemons) may share one database; each sees the others'
    committed transactions at its next call.
    """

    # Transactions run, by the name of their body (``get_inode``, ``create``...): ``aiturbo status`` shows
    # them, for telling which work loads the metadata engine.
    calls: collections.Counter[str]

    @abstractmethod
    async def init(self, *, root_uid: int, root_gid: int, root_mode: int) -> None:
        """Open the database, create the schema and the root inode if missing.

        Must be called once before any other method.  Existing data (schema
        and root) is left as it is, so every daemon calls this at start.
        ``root_mode`` may omit the ``S_IFDIR`` bits.  Raises ``ConfigError``
        if the database was written by a newer schema version.
        """

    @abstractmethod
    async def close(self) -> None:
        """Release the connection.  Idempotent; the store is unusable after."""

    @abstractmethod
    async def get_inode(self, ino: int) -> InodeRow:
        """The row of ``ino``.  Raises ``NotFound``."""

    @abstractmethod
    async def lookup(self, parent: int, name: bytes) -> InodeRow:
        """The inode ``name`` in directory ``parent`` names.  Raises ``NotFound``."""

    @abstractmethod
    async def lookup_path(self, path: str) -> InodeRow | None:
        """The inode at ``path`` (relative to the root, '/'-separated, as
        ``paths_of`` gives it), or ``None`` if no such name.  One call for the
        whole walk: the persister asks it for every file it publishes."""

    @abstractmethod
    async def readdir(
        self, parent: int, offset: int, limit: int
    ) -> list[tuple[bytes, InodeRow, int]]:
        """Up to ``limit`` entries of ``parent`` after the token ``offset``.

        Each item is ``(name, row, next_offset)``; ``next_offset`` (> 0) passed
        back resumes right after that entry.  Start with ``offset=0``.  Order
        is stable: entries created or removed between calls never make another
        entry repeat or go missing (new ones may or may not show, like POSIX).
        ``.`` and ``..`` are not included.  ``limit`` is clamped to
        ``META_READDIR_ENTRIES_MAX``.  Raises ``NotFound`` / ``NotADirectory``
        for a bad ``parent``.
        """

    @abstractmethod
    async def nodes_with_state(self, parent: int) -> list[InodeRow]:
        """The symlinks and special files in directory ``parent`` that have a durability state (the backend
        keeps them; their state is shown as part of the directory's), in ``readdir`` order.  Raises
        ``NotFound`` / ``NotADirectory`` for a bad ``parent``."""

    async def children(self, parent: int, batch: int) -> AsyncIterator[tuple[bytes, InodeRow]]:
        """Every ``(name, row)`` of ``parent``, read ``batch`` entries at a time (see ``readdir``)."""
        offset = 0
        while True:
            entries = await self.readdir(parent, offset, batch)
            if not entries:
                return
            offset = entries[-1][2]  # the last entry's cookie: where the next batch starts
            for name, row, _ in entries:
                yield name, row

    @abstractmethod
    async def create(
        self,
        parent: int,
        name: bytes,
        row: InodeRow,
        *,
        inherit_xattr_prefix: bytes | None = INHERIT_XATTR_PREFIX,
    ) -> InodeRow:
        """Allocate a new inode from ``row`` and link it as ``parent/name``.

        ``row.ino`` is ignored (inode numbers are never reused) and ``nlink``
        is set by the engine (2 for a directory, 1 otherwise).  A regular file
        without a state starts ``STATE_STAGED``; other types keep the state they
        come with (None: they live in the metadata only).
        The parent's mtime/ctime are set to now (``create_imported``: not)
        and its nlink grows by one for a new directory.  A new directory or regular file gets a copy of
        the parent's xattrs whose name starts with ``inherit_xattr_prefix``
        (none if ``None``), except ``STATE_XATTR``.  Returns the stored row.
        Raises ``NotFound`` (parent), ``NotADirectory`` (parent), ``Exists``,
        ``InvalidArgument`` / ``NameTooLong`` (name or symlink target).
        """

    @abstractmethod
    async def create_imported(self, parent: int, entries: Sequence[tuple[bytes, InodeRow]]) -> list[InodeRow | None]:
        """``create(parent, name, row)`` of each entry, in one transaction, leaving the parent's times.

        What an import found in a backend directory (which did not change:
        it had the entries already); ``None`` for a name that
        exists (a writer made it meanwhile: the namespace wins).  The other
        errors are ``create``'s, and fail the whole call.
        """

    @abstractmethod
    async def link(self, ino: int, new_parent: int, new_name: bytes) -> InodeRow:
        """Hard link: add ``new_parent/new_name`` for ``ino``, nlink + 1.

        Raises ``NotFound``, ``NotPermitted`` (``ino`` is a directory, like
        link(2)), ``NotADirectory``, ``Exists``, ``TooManyLinks``.
        """

    @abstractmethod
    async def unlink(self, parent: int, name: bytes) -> InodeRow:
        """Remove ``parent/name``; return the inode's row with nlink - 1.

        The inode row is kept even at nlink 0: the caller drops it with
        ``delete_inode`` once no handle has it open (``orphans`` finds the
        ones a crash left behind).  Raises ``NotFound``, ``NotADirectory``
        (parent), ``IsADirectory`` (use rmdir).
        """

    @abstractmethod
    async def rmdir(self, parent: int, name: bytes) -> InodeRow:
        """Remove the empty directory ``parent/name`` and its inode row.

        Returns the removed row (nlink 0).  Raises ``NotFound``,
        ``NotADirectory``, ``NotEmpty``.
        """

    @abstractmethod
    async def rename(
        self,
        parent: int,
        name: bytes,
        new_parent: int,
        new_name: bytes,
        *,
        noreplace: bool = False,
        exchange: bool = False,
    ) -> InodeRow | None:
        """Move ``parent/name`` to ``new_parent/new_name`` with POSIX semantics.

        An existing target is replaced: a file (or symlink...) loses one link
        and its row is returned with the new nlink, kept like ``unlink``
        keeps it; an empty directory is deleted and its row returned with
        nlink 0.  Returns ``None`` when nothing was replaced, for
        ``exchange`` and for the no-op cases (same entry; both names already
        link the same inode).  ``exchange`` swaps the two entries.
        Directory nlink bookkeeping, ctime of the moved inode(s) and
        mtime/ctime of both parents are updated.  The moved entry keeps its
        readdir position token.
        Raises ``NotFound`` (source, or target with ``exchange``),
        ``NotADirectory`` (directory over non-directory, or a bad parent),
        ``IsADirectory`` (non-directory over directory), ``NotEmpty``,
        ``Exists`` (``noreplace``), ``InvalidArgument`` (a directory into its
        own subtree, or both flags).
        """

    @abstractmethod
    async def set_attrs(self, ino: int, /, **fields) -> InodeRow:
        """Set the given ``InodeRow`` fields (any but ``ino``); return the row.

        Raises ``NotFound``; ``ValueError`` for an unknown field.
        """

    @abstractmethod
    async def commit_manifest(
        self,
        ino: int,
        *,
        size: int,
        manifest: bytes | None,
        state: str,
        mtime_ns: int | None = None,
        owner: str | None = None,
        holders: Sequence[str] | None = None,
        sync: bool = True,
    ) -> InodeRow:
        """Record new content: size, manifest and state; version + 1.

        ``mtime_ns``, when given, sets both mtime and ctime (content changed).
        ``owner`` and ``holders`` of the new version are set as given: a
        version committed without them starts unowned and held nowhere.
        Returns the row with the new version.  ``sync``: the commit is on
        stable storage before this returns (fsync(2)); without it a process
        crash still keeps it, a host crash may not (SQLite: see its module).
        Raises ``NotFound``.
        """

    async def sync(self) -> None:
        """Put every change committed so far on stable storage (fsync(2) of a
        file whose last commit was made without ``sync``).  An engine whose
        every commit is durable (PostgreSQL) has nothing to do."""
        return None

    @abstractmethod
    async def set_state(
        self, ino: int, state: str, /, *, if_version: int | None = None, sync: bool = True, **fields
    ) -> bool:
        """Set the state (and other fields) if the version still matches.

        Returns ``False`` and changes nothing when ``if_version`` is given and
        the row's version differs (a newer commit won the race).  ``fields``
        are as in ``set_attrs`` except ``version``, which only
        ``commit_manifest`` moves.  ``sync``: on stable storage before this
        returns (else call ``sync()`` later, e.g. once a lock is released).
        Raises ``NotFound``.
        """

    @abstractmethod
    async def set_manifest_if(self, ino: int, manifest: bytes, *, etag: str) -> bool:
        """Give an object imported without a manifest its manifest, found by hashing it.

        Only while the row has none and still names the object version
        ``etag`` (no commit, no newer import since); ``False`` changes
        nothing.  The version does not move: the bytes are the same.
        Raises ``NotFound``.
        """

    @abstractmethod
    async def claim_owner(
        self, ino: int, version: int, expected_owner: str | None, new_owner: str | None
    ) -> bool:
        """Compare-and-set of the owner: set ``new_owner`` if the row is still
        at ``version`` and owned by ``expected_owner`` (``None``: unowned).

        Returns ``False`` and changes nothing otherwise (another node claimed
        it first, or a newer commit reset it).  Raises ``NotFound``.
        """

    @abstractmethod
    async def paths_of(self, ino: int) -> list[str]:
        """Every path of ``ino`` relative to the root, without a leading '/'.

        One per hard link, e.g. ``['a/b/c.bin', 'x.bin']``; names are decoded
        with ``os.fsdecode``.  ``[]`` if the inode is unlinked or missing;
        the root is ``['']``.
        """

    @abstractmethod
    async def parent_of(self, ino: int) -> int:
        """The directory holding directory ``ino`` (the root's is the root); ``NotFound`` if it is removed."""

    @abstractmethod
    async def inodes_in_states(self, states: Sequence[str]) -> list[InodeRow]:
        """Every inode whose state is one of ``states`` (ordered by ino)."""

    @abstractmethod
    async def orphans(self) -> list[InodeRow]:
        """Every inode with nlink 0: unlinked while open, then not deleted."""

    @abstractmethod
    async def moves(self) -> list[tuple[int, int, str | None]]:
        """``(ino, gen, dir_path)`` of every inode whose names changed (rename, link, an unlink that
        left a name) since ``moves_done``: the persister has yet to make the backend match them.
        ``dir_path``: a renamed directory's path before its first such rename; None for files."""

    @abstractmethod
    async def move_of(self, ino: int) -> tuple[int, str | None] | None:
        """``(gen, dir_path)`` of ``ino``'s pending move (see ``moves``), or None."""

    @abstractmethod
    async def moves_add(self, inos: Sequence[int]) -> None:
        """Note a pending move of each of ``inos`` (files below a renamed directory)."""

    @abstractmethod
    async def moves_done(self, ino: int, gen: int) -> None:
        """The backend matches ``ino``'s names as of ``gen``: forget its move unless a newer one came."""

    @abstractmethod
    async def delete_inode(self, ino: int) -> None:
        """Drop the row of an unlinked inode with its manifest and xattrs.

        A no-op if the row is already gone.  ``ValueError`` if a directory
        entry still names the inode (a bug: unlink first).
        """

    @abstractmethod
    async def getxattr(self, ino: int, name: bytes) -> bytes:
        """The value of xattr ``name``.  Raises ``NoAttribute``, ``NotFound``."""

    @abstractmethod
    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        """Create or replace xattr ``name``.

        ``flags``: ``os.XATTR_CREATE`` -> ``Exists`` if present;
        ``os.XATTR_REPLACE`` -> ``NoAttribute`` if missing.  Raises
        ``OutOfRange`` for a name or value over the limits or a new name past
        ``XATTRS_PER_INODE_MAX``, ``InvalidArgument`` for an empty name or
        both flags, ``NotFound``.
        """

    @abstractmethod
    async def listxattr(self, ino: int) -> list[bytes]:
        """The names of ``ino``'s xattrs, sorted.  Raises ``NotFound``."""

    @abstractmethod
    async def removexattr(self, ino: int, name: bytes) -> None:
        """Remove xattr ``name``.  Raises ``NoAttribute``, ``NotFound``."""

    @abstractmethod
    async def stats(self) -> tuple[int, int]:
        """``(inode count, total bytes of regular file sizes)`` for statfs."""

    # --- cluster membership ---------------------------------------------------------

    @abstractmethod
    async def upsert_node(self, name: str, address: str, info: dict, now_ns: int) -> None:
        """Record node ``name`` as alive at ``address``, heartbeat ``now_ns``.

        Inserts a new node or replaces every field of a known one: this is
        how a node joins, and how a dead or departed one rejoins.
        """

    @abstractmethod
    async def node_heartbeat(self, name: str, now_ns: int, info: dict | None = None) -> bool:
        """Set the heartbeat time of ``name`` (and its ``info`` when given).

        The state is left as it is: a node declared dead rejoins with
        ``upsert_node``.  Returns ``False`` for an unknown node.
        """

    @abstractmethod
    async def set_node_state(self, name: str, state: str) -> bool:
        """Set the state of ``name``; ``False`` for an unknown node.

        ``ValueError`` for a state not in ``NODE_STATES``.
        """

    @abstractmethod
    async def nodes(self) -> list[NodeRow]:
        """Every node ever recorded (whatever its state), ordered by name."""

    # --- chunk sources: dedup against bytes already in the backend --------------------

    @abstractmethod
    async def record_chunk_sources(
        self, backend_key: str, etag: str | None, entries: Sequence[tuple[bytes, int, int]]
    ) -> None:
        """Record that the object ``backend_key`` (etag ``etag``) holds chunks.

        ``entries`` are ``(32-byte BLAKE3 key, offset, length)``.  A chunk
        key already recorded now points here (the latest record wins); the
        all-zero hole key is skipped.  ``ValueError`` for a key that is not
        32 bytes or a negative offset or length.
        """

    @abstractmethod
    async def chunk_sources(self, keys: Sequence[bytes]) -> dict[bytes, ChunkSource]:
        """The recorded source of each of ``keys`` that has one.

        Keys without a source are absent from the result; any number of keys
        may be asked at once.
        """

    @abstractmethod
    async def forget_chunk_sources(self, backend_key: str) -> int:
        """Drop every chunk source in the object ``backend_key``; how many.

        Call it before the object is overwritten, moved or deleted: a source
        left behind would let a copy take other bytes for the chunk.
        """
