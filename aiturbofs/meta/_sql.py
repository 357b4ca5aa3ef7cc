"""``MetaStore`` on a SQL database: every statement, no dialect.

This module owns the schema, the SQL of every operation and the crossing from
trio into the blocking driver.  An engine (``_sqlite``, later ``_postgres``)
subclasses ``SqlMetaStore`` and supplies only what differs between databases:
the column types of the schema, the placeholder style, and the synchronous
``_connect`` / ``_transact`` / ``_disconnect`` that own the connection and
the transaction boundaries.

Statements here are written with ``?`` placeholders (an engine rewrites them
through ``_sql``) and use only SQL that SQLite >= 3.35 and PostgreSQL >= 13
share: ``RETURNING``, partial indexes, ``COALESCE``, integer ``&``,
``ON CONFLICT (...) DO UPDATE SET c = excluded.c``; no ``%``.

Each public method runs one synchronous transaction body (``_tx_*``) that
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

import dataclasses
import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import trio

from .. import _errors as err
from .._limits import (
    DIR_DEPTH_MAX,
    HASH_BYTES,
    LINKS_PER_INODE_MAX,
    META_KEYS_PER_STATEMENT_MAX,
    META_READDIR_ENTRIES_MAX,
    NAME_BYTES_MAX,
    SYMLINK_TARGET_BYTES_MAX,
    XATTR_NAME_BYTES_MAX,
    XATTR_VALUE_BYTES_MAX,
    XATTRS_PER_INODE_MAX,
)
from ._base import (
    INHERIT_XATTR_PREFIX,
    INODE_FIELDS,
    NODE_ALIVE,
    NODE_STATES,
    ROOT_INO,
    SETTABLE_FIELDS,
    STATE_STAGED,
    STATE_XATTR,
    STATES,
    ChunkSource,
    InodeRow,
    MetaStore,
    NodeRow,
)

SCHEMA_VERSION = 4

_COLS = ", ".join(INODE_FIELDS)
_ICOLS = ", ".join("i." + name for name in INODE_FIELDS)
_S_IFMT = 0o170000  # file type bits of st_mode, for stats() in SQL
_BYTES_FIELDS = ("target", "manifest")
_JSON_FIELDS = ("backend_keys", "holders")  # lists of strings, stored as JSON text
# The inode columns v2 added: in CREATE TABLE, and in ALTER TABLE for a v1 database.
_INODE_COLUMNS_V2 = ("owner TEXT", "holders TEXT NOT NULL DEFAULT '[]'")
_INODE_COLUMN_V4 = "persisted_attrs TEXT"
_ATTRS_FIELD = "persisted_attrs"  # a tuple of ints or None, stored as JSON text or NULL
_HOLE = bytes(HASH_BYTES)  # aiturbofs.chunk.HOLE (meta does not import chunk)
_NODE_COLS = "name, address, state, heartbeat_ns, info"


def _upsert(table: str, key: str, columns: Sequence[str]) -> str:
    """INSERT of ``key`` and ``columns`` that overwrites them where ``key`` exists."""
    names = (key, *columns)
    sets = ", ".join(f"{name} = excluded.{name}" for name in columns)
    return (
        f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
        f" ON CONFLICT ({key}) DO UPDATE SET {sets}"
    )


_UPSERT_NODE = _upsert("nodes", "name", ("address", "state", "heartbeat_ns", "info"))
_UPSERT_CHUNK_SOURCE = _upsert(
    "chunk_sources", "chunk_key", ("backend_key", "offset_bytes", "length_bytes", "etag")
)


class Tx:
    """One open transaction: runs statements written with ``?`` placeholders."""

    __slots__ = ("_cursor", "_sql")

    def __init__(self, cursor: Any, sql: Callable[[str], str]):
        self._cursor = cursor
        self._sql = sql

    def all(self, sql: str, *params: Any) -> list[tuple]:
        """Every row the statement returns."""
        self._cursor.execute(self._sql(sql), params)
        return self._cursor.fetchall()

    def one(self, sql: str, *params: Any) -> tuple | None:
        """The first row, or ``None``.  Fetches all rows: a half-read
        statement would keep SQLite's statement open across COMMIT."""
        rows = self.all(sql, *params)
        return rows[0] if rows else None

    def run(self, sql: str, *params: Any) -> int:
        """Execute a statement without result rows; the number of rows changed."""
        self._cursor.execute(self._sql(sql), params)
        return self._cursor.rowcount

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Execute a statement without result rows once per parameter row;
        the driver batches them (psycopg pipelines, no round trip each)."""
        self._cursor.executemany(self._sql(sql), rows)


# --- rows <-> columns -------------------------------------------------------------


def _row(values: Sequence[Any]) -> InodeRow:
    """An ``InodeRow`` from columns selected in ``INODE_FIELDS`` order."""
    row = dict(zip(INODE_FIELDS, values))
    for name in _BYTES_FIELDS:
        if row[name] is not None:
            row[name] = bytes(row[name])  # psycopg may hand out memoryview
    for name in _JSON_FIELDS:
        row[name] = json.loads(row[name])
    if row[_ATTRS_FIELD] is not None:
        row[_ATTRS_FIELD] = tuple(json.loads(row[_ATTRS_FIELD]))
    return InodeRow(**row)


def _to_column(name: str, value: Any) -> Any:
    """The database value of field ``name``."""
    if name in _JSON_FIELDS or (name == _ATTRS_FIELD and value is not None):
        return json.dumps(list(value))
    if name in _BYTES_FIELDS and value is not None:
        return bytes(value)
    return value


def _assignments(fields: dict[str, Any]) -> tuple[str, list[Any]]:
    """``"a = ?, b = ?"`` and the column values, for an UPDATE of ``fields``."""
    sets = ", ".join(f"{name} = ?" for name in fields)
    return sets, [_to_column(name, value) for name, value in fields.items()]


def _check_fields(fields: dict[str, Any], allowed: Iterable[str] = SETTABLE_FIELDS) -> None:
    """Reject field names and values only a bug can produce.

    Field names are also interpolated into SQL, so this check is what keeps
    that safe.
    """
    unknown = set(fields) - set(allowed)
    if unknown:
        raise ValueError(f"not settable inode fields: {sorted(unknown)}")
    if "state" in fields and fields["state"] is not None and fields["state"] not in STATES:
        raise ValueError(f"unknown state {fields['state']!r}")
    manifest = fields.get("manifest")
    if manifest is not None and len(manifest) % HASH_BYTES:
        raise ValueError(f"manifest of {len(manifest)} bytes is not whole hashes")
    if fields.get("size", 0) < 0:
        raise ValueError("negative size")
    for name in _JSON_FIELDS:
        if isinstance(fields.get(name), (str, bytes)):  # list() would split it up
            raise ValueError(f"{name} must be a list of strings, not {fields[name]!r}")
    attrs = fields.get(_ATTRS_FIELD)
    if attrs is not None and (len(attrs) != 4 or not all(isinstance(v, int) for v in attrs)):
        raise ValueError(f"{_ATTRS_FIELD} must be four integers, not {attrs!r}")


def check_name(name: bytes) -> None:
    """Raise ``InvalidArgument`` / ``NameTooLong`` unless ``name`` can be an entry."""
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise err.InvalidArgument(f"invalid name {name!r}")
    if len(name) > NAME_BYTES_MAX:
        raise err.NameTooLong(f"name of {len(name)} bytes")


class SqlMetaStore(MetaStore):
    """The SQL of every ``MetaStore`` operation; subclasses add a database."""

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
        if dirs:
            return await trio.to_thread.run_sync(
                self._transact_in_dirs, dirs, body, args, write, durable, limiter=self._limiter
            )
        return await trio.to_thread.run_sync(
            self._transact, body, args, write, durable, limiter=self._limiter
        )

    def _now_ns(self) -> int:
        return time.time_ns()

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
        if self._find(tx, ROOT_INO) is None:
            now = self._now_ns()
            mode = stat.S_IFDIR | stat.S_IMODE(root_mode)
            root = InodeRow(ROOT_INO, mode, root_uid, root_gid, 0, 2, now, now, now)
            self._insert_inode(tx, root, with_ino=True)

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

    # --- shared transaction pieces ----------------------------------------------------

    def _find(self, tx: Tx, ino: int) -> InodeRow | None:
        found = tx.one(f"SELECT {_COLS} FROM inodes WHERE ino = ?", ino)
        return None if found is None else _row(found)

    def _get(self, tx: Tx, ino: int) -> InodeRow:
        row = self._find(tx, ino)
        if row is None:
            raise err.NotFound(f"inode {ino}")
        return row

    def _dir(self, tx: Tx, ino: int) -> InodeRow:
        """The row of directory ``ino``; ``NotFound`` / ``NotADirectory``."""
        row = self._get(tx, ino)
        if not stat.S_ISDIR(row.mode):
            raise err.NotADirectory(f"inode {ino}")
        return row

    def _entry(self, tx: Tx, parent: int, name: bytes) -> InodeRow | None:
        found = tx.one(
            f"SELECT {_ICOLS} FROM dentries d JOIN inodes i ON i.ino = d.ino"
            " WHERE d.parent = ? AND d.name = ?",
            parent,
            name,
        )
        return None if found is None else _row(found)

    def _has_entries(self, tx: Tx, parent: int) -> bool:
        return tx.one("SELECT 1 FROM dentries WHERE parent = ? LIMIT 1", parent) is not None

    def _insert_inode(self, tx: Tx, row: InodeRow, *, with_ino: bool = False) -> InodeRow:
        names = INODE_FIELDS if with_ino else INODE_FIELDS[1:]
        values = [_to_column(name, getattr(row, name)) for name in names]
        marks = ", ".join("?" * len(names))
        found = tx.one(
            f"INSERT INTO inodes ({', '.join(names)}) VALUES ({marks}) RETURNING {_COLS}",
            *values,
        )
        assert found is not None  # INSERT ... RETURNING yields the inserted row
        return _row(found)

    def _update(self, tx: Tx, ino: int, fields: dict[str, Any]) -> InodeRow:
        """Set ``fields`` (already checked) on ``ino``; the updated row."""
        if not fields:
            return self._get(tx, ino)
        sets, values = _assignments(fields)
        found = tx.one(f"UPDATE inodes SET {sets} WHERE ino = ? RETURNING {_COLS}", *values, ino)
        if found is None:
            raise err.NotFound(f"inode {ino}")
        return _row(found)

    def _add_links(self, tx: Tx, ino: int, delta: int, now: int) -> InodeRow:
        """nlink += delta and ctime = now (a link came or went)."""
        found = tx.one(
            f"UPDATE inodes SET nlink = nlink + ?, ctime_ns = ? WHERE ino = ? RETURNING {_COLS}",
            delta,
            now,
            ino,
        )
        assert found is not None, f"inode {ino} vanished inside its transaction"  # callers hold the inode
        return _row(found)

    def _touch_dir(self, tx: Tx, ino: int, now: int | None, nlink_delta: int = 0) -> None:
        """A directory's entries changed: mtime/ctime = now (None: they stay); a subdir came or went."""
        if now is None:
            tx.run("UPDATE inodes SET nlink = nlink + ? WHERE ino = ?", nlink_delta, ino)
            return
        tx.run(
            "UPDATE inodes SET mtime_ns = ?, ctime_ns = ?, nlink = nlink + ? WHERE ino = ?",
            now,
            now,
            nlink_delta,
            ino,
        )

    def _note_move(self, tx: Tx, ino: int, *, is_dir: bool = False) -> None:
        """``ino``'s names are about to change: remember it in ``moves`` (a directory with its path now)."""
        dir_path = None
        if is_dir:
            paths = self._tx_paths_of(tx, ino)
            dir_path = paths[0] if paths else None
        tx.run(
            "INSERT INTO moves (ino, gen, dir_path) VALUES (?, 1, ?) ON CONFLICT (ino) DO UPDATE"
            " SET gen = moves.gen + 1, dir_path = COALESCE(moves.dir_path, excluded.dir_path)",
            ino,
            dir_path,
        )

    def _drop_inode(self, tx: Tx, ino: int) -> None:
        tx.run("DELETE FROM moves WHERE ino = ?", ino)
        tx.run("DELETE FROM xattrs WHERE ino = ?", ino)
        tx.run("DELETE FROM inodes WHERE ino = ?", ino)

    def _parent_of_dir(self, tx: Tx, ino: int) -> tuple[int, bytes] | None:
        """``(parent, name)`` of a directory (it has exactly one entry)."""
        found = tx.one("SELECT parent, name FROM dentries WHERE ino = ?", ino)
        return None if found is None else (found[0], bytes(found[1]))

    def _check_not_below(self, tx: Tx, start: int, moved: int) -> None:
        """``InvalidArgument`` if directory ``start`` is ``moved`` or inside it."""
        current = start
        for _ in range(DIR_DEPTH_MAX):
            if current == moved:
                raise err.InvalidArgument("cannot move a directory into itself")
            if current == ROOT_INO:
                return
            up = self._parent_of_dir(tx, current)
            if up is None:
                return  # a detached directory cannot contain `moved`
            current = up[0]
        raise AssertionError(f"directory chain above inode {start} is a loop")

    # --- namespace reads ---------------------------------------------------------------

    async def get_inode(self, ino: int) -> InodeRow:
        return await self._run(self._get, ino, write=False, quick=True)

    async def lookup(self, parent: int, name: bytes) -> InodeRow:
        return await self._run(self._tx_lookup, parent, name, write=False, quick=True)

    def _tx_lookup(self, tx: Tx, parent: int, name: bytes) -> InodeRow:
        row = self._entry(tx, parent, name)
        if row is None:
            raise err.NotFound(f"{os.fsdecode(name)!r} in inode {parent}")
        return row

    async def readdir(self, parent: int, offset: int, limit: int) -> list[tuple[bytes, InodeRow, int]]:
        return await self._run(self._tx_readdir, parent, offset, limit, write=False)

    def _tx_readdir(self, tx: Tx, parent: int, offset: int, limit: int) -> list:
        limit = min(limit, META_READDIR_ENTRIES_MAX)
        if limit <= 0:
            self._dir(tx, parent)
            return []
        found = tx.all(
            f"SELECT d.id, d.name, {_ICOLS} FROM {self.READDIR_FROM} JOIN inodes i ON i.ino = d.ino"
            " WHERE d.parent = ? AND d.id > ? ORDER BY d.id LIMIT ?",
            parent,
            offset,
            limit,
        )
        if not found:
            self._dir(tx, parent)  # tell "empty" from "no such directory"
        return [(bytes(name), _row(rest), token) for token, name, *rest in found]

    async def paths_of(self, ino: int) -> list[str]:
        return await self._run(self._tx_paths_of, ino, write=False, quick=True)

    async def parent_of(self, ino: int) -> int:
        return await self._run(self._tx_parent_of, ino, write=False, quick=True)

    def _tx_parent_of(self, tx: Tx, ino: int) -> int:
        if ino == ROOT_INO:
            return ROOT_INO
        found = self._parent_of_dir(tx, ino)
        if found is None:
            raise err.NotFound(f"directory inode {ino} is removed")
        return found[0]

    def _tx_paths_of(self, tx: Tx, ino: int) -> list[str]:
        if ino == ROOT_INO:
            return [""]
        links = tx.all("SELECT parent, name FROM dentries WHERE ino = ? ORDER BY id", ino)
        known: dict[int, list[bytes] | None] = {ROOT_INO: []}
        paths = []
        for parent, name in links:
            above = self._dir_names(tx, parent, known)
            if above is not None:
                paths.append("/".join(os.fsdecode(n) for n in [*above, bytes(name)]))
        return paths

    def _dir_names(self, tx: Tx, ino: int, known: dict[int, list[bytes] | None]) -> list[bytes] | None:
        """The names from the root down to directory ``ino`` (memoised in
        ``known``); ``None`` if it hangs below no root."""
        chain = []  # (dir, its name), walking up
        current = ino
        for _ in range(DIR_DEPTH_MAX):
            if current in known:
                break
            up = self._parent_of_dir(tx, current)
            if up is None:
                known[current] = None
                break
            chain.append((current, up[1]))
            current = up[0]
        else:
            raise AssertionError(f"directory chain above inode {ino} is a loop")
        names = known[current]
        for directory, name in reversed(chain):
            names = None if names is None else [*names, name]
            known[directory] = names
        return known[ino]

    # --- namespace changes -------------------------------------------------------------

    async def create(
        self,
        parent: int,
        name: bytes,
        row: InodeRow,
        *,
        inherit_xattr_prefix: bytes | None = INHERIT_XATTR_PREFIX,
        imported: bool = False,
    ) -> InodeRow:
        return await self._run(
            self._tx_create, parent, name, row, inherit_xattr_prefix, imported, write=True, dirs=(parent,)
        )

    def _tx_create(
        self, tx: Tx, parent: int, name: bytes, row: InodeRow, prefix: bytes | None, imported: bool
    ) -> InodeRow:
        check_name(name)
        self._check_new_row(row)
        self._dir(tx, parent)
        if self._entry(tx, parent, name) is not None:
            raise err.Exists(f"{os.fsdecode(name)!r} in inode {parent}")
        is_dir = stat.S_ISDIR(row.mode)
        # Regular files always have a state; other nodes have one when the
        # backend keeps them too (vfs decides), else None (metadata only).
        state = row.state
        if stat.S_ISREG(row.mode) and state is None:
            state = STATE_STAGED
        new = self._insert_inode(tx, dataclasses.replace(row, nlink=2 if is_dir else 1, state=state))
        tx.run("INSERT INTO dentries (parent, name, ino) VALUES (?, ?, ?)", parent, name, new.ino)
        self._touch_dir(tx, parent, None if imported else self._now_ns(), 1 if is_dir else 0)
        # Tags steer the I/O of files and the files below directories; user.*
        # xattrs on other types are refused by Linux, so none are copied there.
        if prefix is not None and (is_dir or stat.S_ISREG(row.mode)):
            self._inherit_xattrs(tx, parent, new.ino, prefix)
        return new

    @staticmethod
    def _check_new_row(row: InodeRow) -> None:
        _check_fields({name: getattr(row, name) for name in SETTABLE_FIELDS})
        if stat.S_ISLNK(row.mode):
            if row.target is None:
                raise ValueError("a symlink needs a target")
            if len(row.target) > SYMLINK_TARGET_BYTES_MAX:
                raise err.NameTooLong(f"symlink target of {len(row.target)} bytes")

    def _inherit_xattrs(self, tx: Tx, parent: int, ino: int, prefix: bytes) -> None:
        """Copy the parent's ``prefix`` xattrs but the state to a new child."""
        for name, value in tx.all("SELECT name, value FROM xattrs WHERE ino = ?", parent):
            name = bytes(name)
            if name.startswith(prefix) and name != STATE_XATTR:
                tx.run("INSERT INTO xattrs (ino, name, value) VALUES (?, ?, ?)", ino, name, value)

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> InodeRow:
        return await self._run(self._tx_link, ino, new_parent, new_name, write=True, dirs=(new_parent,))

    def _tx_link(self, tx: Tx, ino: int, new_parent: int, new_name: bytes) -> InodeRow:
        check_name(new_name)
        row = self._get(tx, ino)
        if stat.S_ISDIR(row.mode):
            raise err.NotPermitted("hard link to a directory")
        if row.nlink == 0:
            raise err.NotFound(f"inode {ino} is unlinked")  # like linkat(2) of a deleted file
        if row.nlink >= LINKS_PER_INODE_MAX:
            raise err.TooManyLinks(f"inode {ino} has {row.nlink} links")
        self._dir(tx, new_parent)
        if self._entry(tx, new_parent, new_name) is not None:
            raise err.Exists(f"{os.fsdecode(new_name)!r} in inode {new_parent}")
        now = self._now_ns()
        tx.run("INSERT INTO dentries (parent, name, ino) VALUES (?, ?, ?)", new_parent, new_name, ino)
        self._touch_dir(tx, new_parent, now)
        self._note_move(tx, ino)
        return self._add_links(tx, ino, +1, now)

    async def unlink(self, parent: int, name: bytes) -> InodeRow:
        return await self._run(self._tx_unlink, parent, name, write=True, dirs=(parent,))

    def _tx_unlink(self, tx: Tx, parent: int, name: bytes) -> InodeRow:
        self._dir(tx, parent)
        row = self._tx_lookup(tx, parent, name)
        if stat.S_ISDIR(row.mode):
            raise err.IsADirectory(f"{os.fsdecode(name)!r} is a directory")
        now = self._now_ns()
        tx.run("DELETE FROM dentries WHERE parent = ? AND name = ?", parent, name)
        self._touch_dir(tx, parent, now)
        if row.nlink > 1:  # (the last name's inode is an orphan: found at start anyway)
            self._note_move(tx, row.ino)
        return self._add_links(tx, row.ino, -1, now)

    async def rmdir(self, parent: int, name: bytes) -> InodeRow:
        return await self._run(self._tx_rmdir, parent, name, write=True, dirs=(parent,))

    def _tx_rmdir(self, tx: Tx, parent: int, name: bytes) -> InodeRow:
        self._dir(tx, parent)
        row = self._tx_lookup(tx, parent, name)
        if not stat.S_ISDIR(row.mode):
            raise err.NotADirectory(f"{os.fsdecode(name)!r} is not a directory")
        if self._has_entries(tx, row.ino):
            raise err.NotEmpty(f"{os.fsdecode(name)!r}")
        tx.run("DELETE FROM dentries WHERE parent = ? AND name = ?", parent, name)
        self._drop_inode(tx, row.ino)
        self._touch_dir(tx, parent, self._now_ns(), -1)
        return dataclasses.replace(row, nlink=0)

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
            self._tx_rename,
            parent,
            name,
            new_parent,
            new_name,
            noreplace,
            exchange,
            write=True,
            dirs=(parent, new_parent),
        )

    def _tx_rename(
        self,
        tx: Tx,
        parent: int,
        name: bytes,
        new_parent: int,
        new_name: bytes,
        noreplace: bool,
        exchange: bool,
    ) -> InodeRow | None:
        if noreplace and exchange:
            raise err.InvalidArgument("RENAME_NOREPLACE with RENAME_EXCHANGE")
        check_name(new_name)
        self._dir(tx, parent)
        self._dir(tx, new_parent)
        src = self._tx_lookup(tx, parent, name)
        if (parent, name) == (new_parent, new_name):
            return None
        dst = self._entry(tx, new_parent, new_name)
        if exchange:
            if dst is None:
                raise err.NotFound(f"{os.fsdecode(new_name)!r} in inode {new_parent}")
            self._exchange(tx, (parent, name, src), (new_parent, new_name, dst))
            return None
        if dst is not None and noreplace:
            raise err.Exists(f"{os.fsdecode(new_name)!r} in inode {new_parent}")
        if dst is not None and dst.ino == src.ino:
            return None  # POSIX: two links to one file, rename does nothing
        src_is_dir = stat.S_ISDIR(src.mode)
        if src_is_dir and parent != new_parent:
            self._check_not_below(tx, new_parent, src.ino)
        now = self._now_ns()
        self._note_move(tx, src.ino, is_dir=src_is_dir)
        replaced = None
        if dst is not None:
            replaced = self._replace_target(tx, src, new_parent, new_name, dst, now)
            if replaced.nlink > 0:  # its other names stay; its object at this one goes
                self._note_move(tx, replaced.ino)
        tx.run(
            "UPDATE dentries SET parent = ?, name = ? WHERE parent = ? AND name = ?",
            new_parent,
            new_name,
            parent,
            name,
        )
        tx.run("UPDATE inodes SET ctime_ns = ? WHERE ino = ?", now, src.ino)
        moved_dir = src_is_dir and parent != new_parent
        self._touch_dir(tx, parent, now, -1 if moved_dir else 0)
        if new_parent != parent:
            self._touch_dir(tx, new_parent, now, 1 if moved_dir else 0)
        return replaced

    def _replace_target(
        self, tx: Tx, src: InodeRow, new_parent: int, new_name: bytes, dst: InodeRow, now: int
    ) -> InodeRow:
        """Remove the entry a rename overwrites; the replaced row (see rename)."""
        src_is_dir, dst_is_dir = stat.S_ISDIR(src.mode), stat.S_ISDIR(dst.mode)
        if src_is_dir and not dst_is_dir:
            raise err.NotADirectory(f"{os.fsdecode(new_name)!r} is not a directory")
        if dst_is_dir and not src_is_dir:
            raise err.IsADirectory(f"{os.fsdecode(new_name)!r} is a directory")
        if dst_is_dir and self._has_entries(tx, dst.ino):
            raise err.NotEmpty(f"{os.fsdecode(new_name)!r}")
        tx.run("DELETE FROM dentries WHERE parent = ? AND name = ?", new_parent, new_name)
        if not dst_is_dir:
            return self._add_links(tx, dst.ino, -1, now)
        self._drop_inode(tx, dst.ino)
        self._touch_dir(tx, new_parent, now, -1)
        return dataclasses.replace(dst, nlink=0)

    def _exchange(self, tx: Tx, a: tuple[int, bytes, InodeRow], b: tuple[int, bytes, InodeRow]) -> None:
        """Swap the inodes two entries name (RENAME_EXCHANGE)."""
        (a_parent, a_name, a_row), (b_parent, b_name, b_row) = a, b
        if a_row.ino == b_row.ino:
            return
        a_is_dir, b_is_dir = stat.S_ISDIR(a_row.mode), stat.S_ISDIR(b_row.mode)
        if a_parent != b_parent:
            if a_is_dir:
                self._check_not_below(tx, b_parent, a_row.ino)
            if b_is_dir:
                self._check_not_below(tx, a_parent, b_row.ino)
        now = self._now_ns()
        self._note_move(tx, a_row.ino, is_dir=a_is_dir)
        self._note_move(tx, b_row.ino, is_dir=b_is_dir)
        tx.run("UPDATE dentries SET ino = ? WHERE parent = ? AND name = ?", b_row.ino, a_parent, a_name)
        tx.run("UPDATE dentries SET ino = ? WHERE parent = ? AND name = ?", a_row.ino, b_parent, b_name)
        tx.run("UPDATE inodes SET ctime_ns = ? WHERE ino IN (?, ?)", now, a_row.ino, b_row.ino)
        # a_parent gains b and loses a; subdirectory counts move accordingly.
        delta = int(b_is_dir) - int(a_is_dir) if a_parent != b_parent else 0
        self._touch_dir(tx, a_parent, now, delta)
        if a_parent != b_parent:
            self._touch_dir(tx, b_parent, now, -delta)

    # --- attributes, manifests, states ------------------------------------------------

    async def set_attrs(self, ino: int, /, **fields: Any) -> InodeRow:
        _check_fields(fields)
        return await self._run(self._update, ino, fields, write=True)

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
        _check_fields(fields)
        if mtime_ns is not None:
            fields.update(mtime_ns=mtime_ns, ctime_ns=mtime_ns)
        # One transaction: a crash never keeps a manifest but loses the state
        # change that goes with it.  ``sync``: on disk before this returns.
        return await self._run(self._tx_commit_manifest, ino, fields, write=True, durable=sync)

    def _tx_commit_manifest(self, tx: Tx, ino: int, fields: dict[str, Any]) -> InodeRow:
        sets, values = _assignments(fields)
        found = tx.one(
            f"UPDATE inodes SET {sets}, version = version + 1 WHERE ino = ? RETURNING {_COLS}",
            *values,
            ino,
        )
        if found is None:
            raise err.NotFound(f"inode {ino}")
        return _row(found)

    async def set_state(
        self, ino: int, state: str, /, *, if_version: int | None = None, sync: bool = True, **fields: Any
    ) -> bool:
        if "state" in fields:
            raise ValueError("state is the second argument of set_state")
        fields = {"state": state, **fields}
        _check_fields(fields, SETTABLE_FIELDS - {"version"})
        expect = {} if if_version is None else {"version": if_version}
        # Synced by default: "durable" with its backend_keys must survive a power
        # cut, or a restart would think the only copy was the lost DRAM one.
        return await self._run(self._tx_update_if, ino, fields, expect, write=True, durable=sync)

    async def set_manifest_if(self, ino: int, manifest: bytes, *, etag: str) -> bool:
        _check_fields({"manifest": manifest})
        expect = {"backend_etag": etag, "manifest": None}
        # Unsynced: a lost manifest is found again by the next whole read.
        return await self._run(self._tx_update_if, ino, {"manifest": manifest}, expect, write=True, durable=False)

    async def claim_owner(
        self, ino: int, version: int, expected_owner: str | None, new_owner: str | None
    ) -> bool:
        expect = {"version": version, "owner": expected_owner}
        # Durable: a node told it owns the persist must not lose that to a crash.
        return await self._run(
            self._tx_update_if, ino, {"owner": new_owner}, expect, write=True, durable=True
        )

    def _tx_update_if(self, tx: Tx, ino: int, fields: dict[str, Any], expect: dict[str, Any]) -> bool:
        """Compare-and-set: ``fields`` on ``ino`` if its columns equal ``expect``
        (``None`` matches NULL); ``False`` if not, ``NotFound`` if no row."""
        sets, values = _assignments(fields)
        where = "".join(f" AND {name} {'IS NULL' if v is None else '= ?'}" for name, v in expect.items())
        compared = [v for v in expect.values() if v is not None]
        if tx.run(f"UPDATE inodes SET {sets} WHERE ino = ?{where}", *values, ino, *compared):
            return True
        self._get(tx, ino)  # NotFound, or a lost compare-and-set
        return False

    async def inodes_in_states(self, states: Sequence[str]) -> list[InodeRow]:
        states = list(states)
        for state in states:
            _check_fields({"state": state})
        if not states:
            return []
        return await self._run(self._tx_inodes_in_states, states, write=False)

    def _tx_inodes_in_states(self, tx: Tx, states: list[str]) -> list[InodeRow]:
        marks = ", ".join("?" * len(states))
        found = tx.all(f"SELECT {_COLS} FROM inodes WHERE state IN ({marks}) ORDER BY ino", *states)
        return [_row(values) for values in found]

    async def orphans(self) -> list[InodeRow]:
        return await self._run(self._tx_orphans, write=False)

    def _tx_orphans(self, tx: Tx) -> list[InodeRow]:
        found = tx.all(f"SELECT {_COLS} FROM inodes WHERE nlink = 0 ORDER BY ino")
        return [_row(values) for values in found]

    async def moves(self) -> list[tuple[int, int, str | None]]:
        return await self._run(self._tx_moves, write=False)

    def _tx_moves(self, tx: Tx) -> list[tuple[int, int, str | None]]:
        return [(ino, gen, dir_path) for ino, gen, dir_path in tx.all("SELECT ino, gen, dir_path FROM moves ORDER BY ino")]

    async def move_of(self, ino: int) -> tuple[int, str | None] | None:
        return await self._run(self._tx_move_of, ino, write=False, quick=True)

    def _tx_move_of(self, tx: Tx, ino: int) -> tuple[int, str | None] | None:
        found = tx.one("SELECT gen, dir_path FROM moves WHERE ino = ?", ino)
        return None if found is None else (found[0], found[1])

    async def moves_add(self, inos: Sequence[int]) -> None:
        if inos:
            await self._run(self._tx_moves_add, list(inos), write=True)

    def _tx_moves_add(self, tx: Tx, inos: list[int]) -> None:
        for ino in inos:
            self._note_move(tx, ino)

    async def moves_done(self, ino: int, gen: int) -> None:
        await self._run(self._tx_moves_done, ino, gen, write=True)

    def _tx_moves_done(self, tx: Tx, ino: int, gen: int) -> None:
        tx.run("DELETE FROM moves WHERE ino = ? AND gen = ?", ino, gen)

    async def delete_inode(self, ino: int) -> None:
        if ino == ROOT_INO:
            raise ValueError("the root inode is never deleted")
        await self._run(self._tx_delete_inode, ino, write=True)

    def _tx_delete_inode(self, tx: Tx, ino: int) -> None:
        if tx.one("SELECT 1 FROM dentries WHERE ino = ? LIMIT 1", ino) is not None:
            raise ValueError(f"inode {ino} still has a directory entry")
        self._drop_inode(tx, ino)

    async def stats(self) -> tuple[int, int]:
        return await self._run(self._tx_stats, write=False)

    def _tx_stats(self, tx: Tx) -> tuple[int, int]:
        found = tx.one(
            "SELECT COUNT(*), COALESCE(SUM(CASE WHEN (mode & ?) = ? THEN size ELSE 0 END), 0)"
            " FROM inodes",
            _S_IFMT,
            stat.S_IFREG,
        )
        assert found is not None  # an aggregate without GROUP BY yields one row
        count, total = found
        return int(count), int(total)  # PostgreSQL sums bigint to numeric

    # --- xattrs ----------------------------------------------------------------------

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self._run(self._tx_getxattr, ino, name, write=False, quick=True)

    def _tx_getxattr(self, tx: Tx, ino: int, name: bytes) -> bytes:
        found = tx.one("SELECT value FROM xattrs WHERE ino = ? AND name = ?", ino, name)
        if found is None:
            self._get(tx, ino)
            raise err.NoAttribute(os.fsdecode(name))
        return bytes(found[0])

    async def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        if not name:
            raise err.InvalidArgument("empty xattr name")
        if len(name) > XATTR_NAME_BYTES_MAX:
            raise err.OutOfRange(f"xattr name of {len(name)} bytes")
        if len(value) > XATTR_VALUE_BYTES_MAX:
            raise err.OutOfRange(f"xattr value of {len(value)} bytes")
        if flags & ~(os.XATTR_CREATE | os.XATTR_REPLACE) or flags == os.XATTR_CREATE | os.XATTR_REPLACE:
            raise err.InvalidArgument(f"xattr flags {flags:#x}")
        await self._run(self._tx_setxattr, ino, bytes(name), bytes(value), flags, write=True)

    def _tx_setxattr(self, tx: Tx, ino: int, name: bytes, value: bytes, flags: int) -> None:
        self._touch_inode(tx, ino)
        present = tx.one("SELECT 1 FROM xattrs WHERE ino = ? AND name = ?", ino, name) is not None
        if present and flags & os.XATTR_CREATE:
            raise err.Exists(os.fsdecode(name))
        if not present and flags & os.XATTR_REPLACE:
            raise err.NoAttribute(os.fsdecode(name))
        if present:
            tx.run("UPDATE xattrs SET value = ? WHERE ino = ? AND name = ?", value, ino, name)
            return
        found = tx.one("SELECT COUNT(*) FROM xattrs WHERE ino = ?", ino)
        assert found is not None  # an aggregate without GROUP BY yields one row
        (count,) = found
        if count >= XATTRS_PER_INODE_MAX:
            raise err.OutOfRange(f"inode {ino} has {count} xattrs")
        tx.run("INSERT INTO xattrs (ino, name, value) VALUES (?, ?, ?)", ino, name, value)

    def _touch_inode(self, tx: Tx, ino: int) -> None:
        """ctime = now (xattrs are inode metadata); ``NotFound`` if missing."""
        if not tx.run("UPDATE inodes SET ctime_ns = ? WHERE ino = ?", self._now_ns(), ino):
            raise err.NotFound(f"inode {ino}")

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self._run(self._tx_listxattr, ino, write=False, quick=True)

    def _tx_listxattr(self, tx: Tx, ino: int) -> list[bytes]:
        found = tx.all("SELECT name FROM xattrs WHERE ino = ? ORDER BY name", ino)
        if not found:
            self._get(tx, ino)
        return [bytes(name) for (name,) in found]

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self._run(self._tx_removexattr, ino, name, write=True)

    def _tx_removexattr(self, tx: Tx, ino: int, name: bytes) -> None:
        self._touch_inode(tx, ino)
        if not tx.run("DELETE FROM xattrs WHERE ino = ? AND name = ?", ino, name):
            raise err.NoAttribute(os.fsdecode(name))

    # --- cluster membership ----------------------------------------------------------

    async def upsert_node(self, name: str, address: str, info: dict, now_ns: int) -> None:
        params = (name, address, NODE_ALIVE, now_ns, json.dumps(info))
        await self._run(self._tx_statement, _UPSERT_NODE, *params, write=True)

    async def node_heartbeat(self, name: str, now_ns: int, info: dict | None = None) -> bool:
        sql = "UPDATE nodes SET heartbeat_ns = ?, info = COALESCE(?, info) WHERE name = ?"
        info_json = None if info is None else json.dumps(info)
        return bool(await self._run(self._tx_statement, sql, now_ns, info_json, name, write=True))

    async def set_node_state(self, name: str, state: str) -> bool:
        if state not in NODE_STATES:
            raise ValueError(f"unknown node state {state!r}")
        sql = "UPDATE nodes SET state = ? WHERE name = ?"
        return bool(await self._run(self._tx_statement, sql, state, name, write=True))

    async def nodes(self) -> list[NodeRow]:
        found = await self._run(self._tx_all, f"SELECT {_NODE_COLS} FROM nodes", write=False)
        rows = [
            NodeRow(name, address, state, heartbeat_ns, json.loads(info))
            for name, address, state, heartbeat_ns, info in found  # the columns of _NODE_COLS
        ]
        return sorted(rows, key=lambda row: row.name)  # code points: one order on every engine

    @staticmethod
    def _tx_statement(tx: Tx, sql: str, *params: Any) -> int:
        """A transaction of one statement; the number of rows it changed."""
        return tx.run(sql, *params)

    @staticmethod
    def _tx_all(tx: Tx, sql: str, *params: Any) -> list[tuple]:
        """A transaction of one query; every row."""
        return tx.all(sql, *params)

    # --- chunk sources -----------------------------------------------------------------

    async def record_chunk_sources(
        self, backend_key: str, etag: str | None, entries: Sequence[tuple[bytes, int, int]]
    ) -> None:
        places: dict[bytes, tuple[int, int]] = {}  # one row per key: a batch upserts each once
        for key, offset, length in entries:
            if len(key) != HASH_BYTES or offset < 0 or length < 0:
                raise ValueError(f"bad chunk source {bytes(key).hex()} at {offset}+{length}")
            if key != _HOLE:
                places[bytes(key)] = (offset, length)
        if places:
            rows = [(key, backend_key, offset, length, etag) for key, (offset, length) in places.items()]
            await self._run(self._tx_record_chunk_sources, rows, write=True)

    @staticmethod
    def _tx_record_chunk_sources(tx: Tx, rows: list[tuple]) -> None:
        tx.many(_UPSERT_CHUNK_SOURCE, rows)

    async def chunk_sources(self, keys: Sequence[bytes]) -> dict[bytes, ChunkSource]:
        unique = list(dict.fromkeys(bytes(key) for key in keys))
        if not unique:
            return {}
        return await self._run(self._tx_chunk_sources, unique, write=False)

    def _tx_chunk_sources(self, tx: Tx, keys: list[bytes]) -> dict[bytes, ChunkSource]:
        found = {}
        for start in range(0, len(keys), META_KEYS_PER_STATEMENT_MAX):
            batch = keys[start : start + META_KEYS_PER_STATEMENT_MAX]
            rows = tx.all(
                "SELECT chunk_key, backend_key, offset_bytes, length_bytes, etag FROM chunk_sources"
                f" WHERE chunk_key IN ({', '.join('?' * len(batch))})",
                *batch,
            )
            for key, *source in rows:
                found[bytes(key)] = ChunkSource(*source)
        return found

    async def forget_chunk_sources(self, backend_key: str) -> int:
        sql = "DELETE FROM chunk_sources WHERE backend_key = ?"
        # Durable: a source that comes back after a crash names bytes that are gone.
        return await self._run(self._tx_statement, sql, backend_key, write=True, durable=True)
