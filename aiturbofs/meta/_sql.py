"""``MetaStore`` on a SQL database: the store, its schema, no dialect.

This module owns the schema and the crossing from trio into the blocking
driver; the SQL of every other operation lives in the transaction bodies it
runs, grouped by concern: ``_sql_namespace`` (entries, moves),
``_sql_inodes`` (attributes, manifests, states, xattrs) and ``_sql_cluster``
(members, the chunk index), on the pieces they share in ``_sql_tx``.  An
engine (``_sqlite``, ``_postgres``) subclasses ``SqlMetaStore`` and supplies
only what differs between databases: the column types of the schema, the
placeholder style, and the synchronous ``_connect`` / ``_transact`` /
``_disconnect`` that own the connection and the transaction boundaries.

Statements are written with ``?`` placeholders (an engine rewrites them
through ``_sql``) and use only SQL that SQLite >= 3.35 and PostgreSQL >= 13
share: ``RETURNING``, partial indexes, ``COALESCE``, integer ``&``,
``ON CONFLICT (...) DO UPDATE SET c = excluded.c``; no ``%``.

Each public method checks its arguments and runs one synchronous
transaction body (a function of those modules, or ``_tx_init``) that
receives a ``Tx``; the body raises ``_errors`` classes and the engine rolls
the transaction back.  Checks come before changes so a reader can see every
error case at the top of a body.  Bodies check, then change ("is the name
free? insert it"), so an engine must run them serialisably: SQLite's
``BEGIN IMMEDIATE`` serialises writers; PostgreSQL needs SERIALIZABLE and a
retry on serialisation failure.

Schema (version ``SCHEMA_VERSION``):

- ``inodes``: one row per inode; ``ino`` is an identity that never repeats
  (the kernel and the backend caches key on it).  ``manifest`` is the last
  column: SQLite then reaches every other column (stats, state scans)
  without walking the blob's overflow pages.  (A database migrated from v1
  has ``owner`` and ``holders`` after it: only full-row reads, which read
  the manifest anyway, touch them; so does ``persisted_attrs``, from v4.)
  ``backend_keys`` and ``holders`` are JSON lists of strings,
  ``persisted_attrs`` a JSON list of four integers or NULL.
- ``dentries``: ``(parent, name)`` is unique and indexed for lookups; ``id``
  is an ever-growing identity that orders a directory for readdir, so a
  resume token stays valid whatever is created or removed meanwhile.
  Rename updates the row in place: the entry keeps its position.
- ``xattrs``: ``(ino, name) -> value``.
- ``nodes``: cluster membership, ``name -> address, state, heartbeat, info``
  (``info`` is JSON), so a restarted controller resumes where it was.
- ``chunk_sources``: ``chunk_key -> (backend_key, offset, length, etag)``,
  where a chunk's bytes already are in the backend (dedup by server-side
  copy); indexed by ``backend_key`` to forget an object's chunks at once.
- ``moves``: ``ino -> (gen, dir_path)``, inodes whose names changed
  (rename, link, an unlink that leaves a name) since the persister last
  made the backend match them: their objects may sit at names they no
  longer have, and a restart must move them on, not import them as new
  files.  Written in the same transaction as the name change; ``gen``
  grows with each change, so the persister lets go only of what it
  reconciled (``moves_done``).  ``dir_path`` is a renamed directory's path
  before its first pending rename (its backend form to clean up), NULL
  for files.
- ``meta_schema``: one row, the schema version.  v2 added ``owner`` and
  ``holders`` to ``inodes`` and the ``nodes`` and ``chunk_sources`` tables;
  v3 the ``moves`` table; v4 added ``persisted_attrs``, which a migration
  fills with each row's own attributes (what the backend holds of rows
  persisted before is unknown: they are taken as persisted, so nothing is
  pushed that was not changed).
"""

from __future__ import annotations

import collections
import json
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

import trio

from .. import _errors as err
from .._limits import HASH_BYTES, META_LOOKUP_PATH_JOINED_MAX, XATTR_NAME_BYTES_MAX, XATTR_VALUE_BYTES_MAX
from . import _sql_cluster, _sql_inodes, _sql_namespace, _sql_tx
from ._base import (
    INHERIT_XATTR_PREFIX,
    NODE_ALIVE,
    NODE_STATES,
    ROOT_INO,
    SETTABLE_FIELDS,
    ChunkSource,
    InodeRow,
    MetaStore,
    NodeRow,
)
from ._sql_tx import Tx as Tx  # the engines take it from here
from ._sql_tx import check_fields

SCHEMA_VERSION = 4

# The inode columns v2 added: in CREATE TABLE, and in ALTER TABLE for a v1 database.
_INODE_COLUMNS_V2 = ("owner TEXT", "holders TEXT NOT NULL DEFAULT '[]'")
_INODE_COLUMN_V4 = "persisted_attrs TEXT"


# Read bodies that read with one statement (a second one only to tell which error to raise): an engine
# may run them as a statement of their own, its own transaction, without BEGIN and COMMIT around it.
ONE_STATEMENT_READS = frozenset({
    _sql_tx.get_inode, _sql_namespace.lookup, _sql_namespace.lookup_path, _sql_namespace.paths_of,
    _sql_namespace.move_of,
    _sql_inodes.getxattr, _sql_inodes.listxattr,
})


class SqlMetaStore(MetaStore):
    """Every ``MetaStore`` operation as one transaction of SQL; subclasses add a database."""

    # --- dialect bits: a subclass overrides these -------------------------------
    BLOB = "BLOB"  # type of byte strings
    INT = "BIGINT"  # 64-bit integer (timestamps in ns)
    # An integer primary key that the database assigns, ever-growing, never
    # reused, and that also accepts an explicit value: the root inode is
    # inserted as 1 (PostgreSQL: an identity that STARTs WITH 2).
    IDENTITY = "INTEGER PRIMARY KEY AUTOINCREMENT"
    # The dentries table as readdir names it: a dialect may pin the
    # (parent, id) index here when its planner would rather scan ids.
    READDIR_FROM = "dentries d"

    def __init__(self, limiter: trio.CapacityLimiter):
        self._limiter = limiter  # bounds the worker threads using the connection(s)
        self._connected = False
        self.calls = collections.Counter()

    def _sql(self, sql: str) -> str:
        """``sql`` in the driver's placeholder style (here: ``?``, unchanged)."""
        return sql

    def _connect(self) -> None:
        """Open the connection(s); runs in a worker thread, once."""
        raise NotImplementedError

    def _disconnect(self) -> None:
        """Close the connection(s); runs in a worker thread, once."""
        raise NotImplementedError

    def _transact(self, body: Callable[..., Any], args: tuple, write: bool, durable: bool) -> Any:
        """Run ``body(tx, *args)`` as one transaction; runs in a worker thread.

        ``write``: the body changes data, take the write lock up front (no
        read-to-write upgrade deadlocks between daemons).  ``durable``: the
        commit must be on stable storage before this returns.  A body's
        exception rolls back and propagates unchanged; the engine's own
        operating errors (locked, disk full) become ``_errors`` classes.
        """
        raise NotImplementedError

    def _transact_in_dirs(
        self, dirs: tuple[int, ...], body: Callable[..., Any], args: tuple, write: bool, durable: bool
    ) -> Any:
        """``_transact`` for a body that changes the entries of directories ``dirs``.

        Such a body updates each directory's row (mtime, nlink), so two of
        them on one directory always conflict.  An engine whose writers run
        concurrently may queue them per directory here rather than let them
        abort each other; one that runs a single writer at a time (SQLite's
        ``BEGIN IMMEDIATE``) needs nothing.
        """
        return self._transact(body, args, write, durable)

    async def _run(
        self,
        body: Callable[..., Any],
        *args: Any,
        write: bool,
        durable: bool = False,
        dirs: tuple[int, ...] = (),
        quick: bool = False,
    ) -> Any:
        """Run ``body(tx, *args)`` as one transaction in a worker thread.

        ``dirs``: the directories whose entries the body changes (see
        ``_transact_in_dirs``).  ``quick``: a read of a few rows by key, which
        an engine whose reads need no I/O to wait for may run without the
        thread hop.  Not cancellable once started: a cancelled
        caller never leaves a transaction half-applied or a connection
        mid-statement.
        """
        assert self._connected, "MetaStore.init() was not called, or close() was"
        self.calls[body.__name__] += 1
        if dirs:
            return await trio.to_thread.run_sync(
                self._transact_in_dirs, dirs, body, args, write, durable, limiter=self._limiter
            )
        return await trio.to_thread.run_sync(
            self._transact, body, args, write, durable, limiter=self._limiter
        )

    def _schema(self) -> list[str]:
        """The DDL of the current schema version, in creation order."""
        b, i, ident = self.BLOB, self.INT, self.IDENTITY
        return [
            f"""CREATE TABLE inodes (
                ino {ident}, mode {i} NOT NULL, uid {i} NOT NULL, gid {i} NOT NULL,
                size {i} NOT NULL, nlink {i} NOT NULL, atime_ns {i} NOT NULL,
                mtime_ns {i} NOT NULL, ctime_ns {i} NOT NULL, rdev {i} NOT NULL,
                target {b}, state TEXT, version {i} NOT NULL,
                backend_keys TEXT NOT NULL, backend_etag TEXT,
                imported_ns {i} NOT NULL, persisted_version {i} NOT NULL,
                {", ".join(_INODE_COLUMNS_V2)}, {_INODE_COLUMN_V4}, manifest {b})""",
            "CREATE INDEX inodes_state ON inodes (state)",
            # Tiny: only orphans are in it, found at every start.
            "CREATE INDEX inodes_orphan ON inodes (ino) WHERE nlink = 0",
            f"""CREATE TABLE dentries (
                id {ident}, parent {i} NOT NULL, name {b} NOT NULL, ino {i} NOT NULL,
                UNIQUE (parent, name))""",
            "CREATE INDEX dentries_readdir ON dentries (parent, id)",
            "CREATE INDEX dentries_ino ON dentries (ino)",  # paths_of, walks up
            f"""CREATE TABLE xattrs (
                ino {i} NOT NULL, name {b} NOT NULL, value {b} NOT NULL,
                PRIMARY KEY (ino, name))""",
            *self._cluster_schema(),
            self._moves_schema(),
        ]

    def _moves_schema(self) -> str:
        """The DDL of the table v3 added."""
        return f"CREATE TABLE moves (ino {self.INT} PRIMARY KEY, gen {self.INT} NOT NULL, dir_path TEXT)"

    def _cluster_schema(self) -> list[str]:
        """The DDL of the tables v2 added, in creation order."""
        b, i = self.BLOB, self.INT
        return [
            f"""CREATE TABLE nodes (
                name TEXT PRIMARY KEY, address TEXT NOT NULL, state TEXT NOT NULL,
                heartbeat_ns {i} NOT NULL, info TEXT NOT NULL)""",
            f"""CREATE TABLE chunk_sources (
                chunk_key {b} PRIMARY KEY, backend_key TEXT NOT NULL,
                offset_bytes {i} NOT NULL, length_bytes {i} NOT NULL, etag TEXT)""",
            "CREATE INDEX chunk_sources_backend_key ON chunk_sources (backend_key)",
        ]

    # --- lifecycle ----------------------------------------------------------------

    async def init(self, *, root_uid: int, root_gid: int, root_mode: int) -> None:
        if not self._connected:
            await trio.to_thread.run_sync(self._connect, limiter=self._limiter)
            self._connected = True
        await self._run(self._tx_init, root_uid, root_gid, root_mode, write=True, durable=True)

    def _tx_init(self, tx: Tx, root_uid: int, root_gid: int, root_mode: int) -> None:
        tx.run(f"CREATE TABLE IF NOT EXISTS meta_schema (version {self.INT} NOT NULL)")
        found = tx.one("SELECT version FROM meta_schema")
        if found is None:
            for ddl in self._schema():
                tx.run(ddl)
            tx.run("INSERT INTO meta_schema (version) VALUES (?)", SCHEMA_VERSION)
        elif found[0] > SCHEMA_VERSION:
            raise err.ConfigError(
                f"metadata schema v{found[0]} is newer than this aiturbofs (v{SCHEMA_VERSION})"
            )
        elif found[0] < SCHEMA_VERSION:
            self._migrate(tx, found[0])
        if _sql_tx.find_inode(tx, ROOT_INO) is None:
            now = _sql_tx.now_ns()
            mode = stat.S_IFDIR | stat.S_IMODE(root_mode)
            root = InodeRow(ROOT_INO, mode, root_uid, root_gid, 0, 2, now, now, now)
            _sql_tx.insert_inode(tx, root, with_ino=True)

    async def close(self) -> None:
        if self._connected:
            self._connected = False
            await trio.to_thread.run_sync(self._disconnect, limiter=self._limiter)

    def _migrate(self, tx: Tx, from_version: int) -> None:
        """Bring an older schema to ``SCHEMA_VERSION``, in init's transaction
        (PostgreSQL: under its lock, so one daemon migrates, the others see it)."""
        if from_version < 1:
            raise err.ConfigError(f"no migration from metadata schema v{from_version}")
        if from_version < 2:  # cluster mode; existing rows start unowned, held nowhere
            for column in _INODE_COLUMNS_V2:
                tx.run(f"ALTER TABLE inodes ADD COLUMN {column}")
            for ddl in self._cluster_schema():
                tx.run(ddl)
        if from_version < 3:  # names changed but not yet in the backend: none known
            tx.run(self._moves_schema())
        if from_version < 4:  # attributes in the backend (see the module doc)
            tx.run(f"ALTER TABLE inodes ADD COLUMN {_INODE_COLUMN_V4}")
            tx.run("UPDATE inodes SET persisted_attrs = '[' || mode || ',' || uid || ',' || gid || ',' || mtime_ns || ']'")
        tx.run("UPDATE meta_schema SET version = ?", SCHEMA_VERSION)

    # --- namespace: bodies in _sql_namespace -----------------------------------------

    async def get_inode(self, ino: int) -> InodeRow:
        return await self._run(_sql_tx.get_inode, ino, write=False, quick=True)

    async def lookup(self, parent: int, name: bytes) -> InodeRow:
        return await self._run(_sql_namespace.lookup, parent, name, write=False, quick=True)

    async def lookup_path(self, path: str) -> InodeRow | None:
        joined = path.count("/") < META_LOOKUP_PATH_JOINED_MAX
        body = _sql_namespace.lookup_path if joined else _sql_namespace.lookup_path_walk
        return await self._run(body, path, write=False, quick=True)

    async def readdir(self, parent: int, offset: int, limit: int) -> list[tuple[bytes, InodeRow, int]]:
        return await self._run(_sql_namespace.readdir, parent, offset, limit, self.READDIR_FROM, write=False, quick=True)

    async def nodes_with_state(self, parent: int) -> list[InodeRow]:
        return await self._run(_sql_namespace.nodes_with_state, parent, self.READDIR_FROM, write=False, quick=True)

    async def paths_of(self, ino: int) -> list[str]:
        return await self._run(_sql_namespace.paths_of, ino, write=False, quick=True)

    async def parent_of(self, ino: int) -> int:
        return await self._run(_sql_namespace.parent_of, ino, write=False, quick=True)

    async def create(
        self,
        parent: int,
        name: bytes,
        row: InodeRow,
        *,
        inherit_xattr_prefix: bytes | None = INHERIT_XATTR_PREFIX,
    ) -> InodeRow:
        return await self._run(
            _sql_namespace.create, parent, name, row, inherit_xattr_prefix, False, write=True, dirs=(parent,)
        )

    async def create_imported(self, parent: int, entries: Sequence[tuple[bytes, InodeRow]]) -> list[InodeRow | None]:
        return await self._run(_sql_namespace.create_imported, parent, list(entries), INHERIT_XATTR_PREFIX,
                               write=True, dirs=(parent,))

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> InodeRow:
        return await self._run(_sql_namespace.link, ino, new_parent, new_name, write=True, dirs=(new_parent,))

    async def unlink(self, parent: int, name: bytes) -> InodeRow:
        return await self._run(_sql_namespace.unlink, parent, name, write=True, dirs=(parent,))

    async def rmdir(self, parent: int, name: bytes) -> InodeRow:
        return await self._run(_sql_namespace.rmdir, parent, name, write=True, dirs=(parent,))

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
        return await self._run(
            _sql_namespace.rename,
            parent,
            name,
            new_parent,
            new_name,
            noreplace,
            exchange,
            write=True,
            dirs=(parent, new_parent),
        )

    async def moves(self) -> list[tuple[int, int, str | None]]:
        return await self._run(_sql_namespace.moves, write=False)

    async def move_of(self, ino: int) -> tuple[int, str | None] | None:
        return await self._run(_sql_namespace.move_of, ino, write=False, quick=True)

    async def moves_add(self, inos: Sequence[int]) -> None:
        if inos:
            await self._run(_sql_namespace.moves_add, list(inos), write=True)

    async def moves_done(self, ino: int, gen: int) -> None:
        await self._run(_sql_namespace.moves_done, ino, gen, write=True)

    # --- attributes, manifests, states: bodies in _sql_inodes ------------------------

    async def set_attrs(self, ino: int, /, **fields: Any) -> InodeRow:
        check_fields(fields)
        return await self._run(_sql_inodes.update, ino, fields, write=True)

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
        fields: dict[str, Any] = {
            "size": size,
            "manifest": manifest,
            "state": state,
            "owner": owner,
            "holders": [] if holders is None else holders,
        }
        check_fields(fields)
        if mtime_ns is not None:
            fields.update(mtime_ns=mtime_ns, ctime_ns=mtime_ns)
        # One transaction: a crash never keeps a manifest but loses the state
        # change that goes with it.  ``sync``: on disk before this returns.
        return await self._run(_sql_inodes.commit_manifest, ino, fields, write=True, durable=sync)

    async def set_state(
        self, ino: int, state: str, /, *, if_version: int | None = None, sync: bool = True, **fields: Any
    ) -> bool:
        if "state" in fields:
            raise ValueError("state is the second argument of set_state")
        fields = {"state": state, **fields}
        check_fields(fields, SETTABLE_FIELDS - {"version"})
        expect = {} if if_version is None else {"version": if_version}
        # Synced by default: "durable" with its backend_keys must survive a power
        # cut, or a restart would think the only copy was the lost DRAM one.
        return await self._run(_sql_inodes.update_if, ino, fields, expect, write=True, durable=sync)

    async def set_manifest_if(self, ino: int, manifest: bytes, *, etag: str) -> bool:
        check_fields({"manifest": manifest})
        expect = {"backend_etag": etag, "manifest": None}
        # Unsynced: a lost manifest is found again by the next whole read.
        return await self._run(_sql_inodes.update_if, ino, {"manifest": manifest}, expect, write=True, durable=False)

    async def claim_owner(
        self, ino: int, version: int, expected_owner: str | None, new_owner: str | None
    ) -> bool:
        expect = {"version": version, "owner": expected_owner}
        # Durable: a node told it owns the persist must not lose that to a crash.
        return await self._run(
            _sql_inodes.update_if, ino, {"owner": new_owner}, expect, write=True, durable=True
        )

    async def inodes_in_states(self, states: Sequence[str]) -> list[InodeRow]:
        states = list(states)
        for state in states:
            check_fields({"state": state})
        if not states:
            return []
        return await self._run(_sql_inodes.inodes_in_states, states, write=False)

    async def orphans(self) -> list[InodeRow]:
        return await self._run(_sql_inodes.orphans, write=False)

    async def delete_inode(self, ino: int) -> None:
        if ino == ROOT_INO:
            raise ValueError("the root inode is never deleted")
        await self._run(_sql_inodes.delete_inode, ino, write=True)

    async def stats(self) -> tuple[int, int]:
        return await self._run(_sql_inodes.stats, write=False)

    # --- xattrs: bodies in _sql_inodes ------------------------------------------------

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self._run(_sql_inodes.getxattr, ino, name, write=False, quick=True)

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        if not name:
            raise err.InvalidArgument("empty xattr name")
        if len(name) > XATTR_NAME_BYTES_MAX:
            raise err.OutOfRange(f"xattr name of {len(name)} bytes")
        if len(value) > XATTR_VALUE_BYTES_MAX:
            raise err.OutOfRange(f"xattr value of {len(value)} bytes")
        if flags & ~(os.XATTR_CREATE | os.XATTR_REPLACE) or flags == os.XATTR_CREATE | os.XATTR_REPLACE:
            raise err.InvalidArgument(f"xattr flags {flags:#x}")
        await self._run(_sql_inodes.setxattr, ino, bytes(name), bytes(value), flags, write=True)

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self._run(_sql_inodes.listxattr, ino, write=False, quick=True)

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self._run(_sql_inodes.removexattr, ino, name, write=True)

    # --- cluster membership: statements of _sql_cluster ------------------------------

    async def upsert_node(self, name: str, address: str, info: dict, now_ns: int) -> None:
        params = (name, address, NODE_ALIVE, now_ns, json.dumps(info))
        await self._run(_sql_cluster.statement, _sql_cluster.UPSERT_NODE, *params, write=True)

    async def node_heartbeat(self, name: str, now_ns: int, info: dict | None = None) -> bool:
        sql = "UPDATE nodes SET heartbeat_ns = ?, info = COALESCE(?, info) WHERE name = ?"
        info_json = None if info is None else json.dumps(info)
        return bool(await self._run(_sql_cluster.statement, sql, now_ns, info_json, name, write=True))

    async def set_node_state(self, name: str, state: str) -> bool:
        if state not in NODE_STATES:
            raise ValueError(f"unknown node state {state!r}")
        sql = "UPDATE nodes SET state = ? WHERE name = ?"
        return bool(await self._run(_sql_cluster.statement, sql, state, name, write=True))

    async def nodes(self) -> list[NodeRow]:
        found = await self._run(_sql_cluster.query, f"SELECT {_sql_cluster.NODE_COLS} FROM nodes", write=False)
        rows = [
            NodeRow(name, address, state, heartbeat_ns, json.loads(info))
            for name, address, state, heartbeat_ns, info in found  # the columns of NODE_COLS
        ]
        return sorted(rows, key=lambda row: row.name)  # code points: one order on every engine

    # --- chunk sources: bodies in _sql_cluster -----------------------------------------

    async def record_chunk_sources(
        self, backend_key: str, etag: str | None, entries: Sequence[tuple[bytes, int, int]]
    ) -> None:
        places: dict[bytes, tuple[int, int]] = {}  # one row per key: a batch upserts each once
        for key, offset, length in entries:
            if len(key) != HASH_BYTES or offset < 0 or length < 0:
                raise ValueError(f"bad chunk source {bytes(key).hex()} at {offset}+{length}")
            if key != _sql_cluster.HOLE:
                places[bytes(key)] = (offset, length)
        if places:
            rows = [(key, backend_key, offset, length, etag) for key, (offset, length) in places.items()]
            await self._run(_sql_cluster.record_chunk_sources, rows, write=True)

    async def chunk_sources(self, keys: Sequence[bytes]) -> dict[bytes, ChunkSource]:
        unique = list(dict.fromkeys(bytes(key) for key in keys))
        if not unique:
            return {}
        return await self._run(_sql_cluster.chunk_sources, unique, write=False)

    async def forget_chunk_sources(self, backend_key: str) -> int:
        sql = "DELETE FROM chunk_sources WHERE backend_key = ?"
        # Durable: a source that comes back after a crash names bytes that are gone.
        return await self._run(_sql_cluster.statement, sql, backend_key, write=True, durable=True)
