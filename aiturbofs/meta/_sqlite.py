"""The SQLite metadata engine: one file, one connection, one worker thread.

This module owns the sqlite3 connection and its transaction boundaries; all
SQL lives in ``_sql``.  It must never hand the connection to more than one
thread at a time (the capacity limiter of ``META_THREADS_MAX`` guarantees it).

Durability: the database runs in WAL mode with ``synchronous=NORMAL``; the
transactions that record content, persistence or who persists
(``commit_manifest``, ``set_state``, ``claim_owner``, ``forget_chunk_sources``,
``init``) switch to ``synchronous=FULL`` and so fsync the WAL before they
return.  What a crash may lose:

- a crash of the process (kill -9, a bug): nothing that was committed;
- a crash of the host (power cut, kernel panic): the namespace changes
  (create, rename, unlink, setxattr...), node records and recorded chunk
  sources (dedup chances, not data) committed after the last synced
  transaction.  WAL replays in order, so what survives is always a prefix of
  the history: never a manifest without the create before it.  The database
  is never corrupted.

Several daemons on one host may share a file: writers take the write lock
up front (``BEGIN IMMEDIATE``) and wait up to ``META_BUSY_TIMEOUT_S`` for
another daemon's transaction to finish; readers never wait (WAL).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import trio

from .. import _errors as err
from .._limits import META_BUSY_TIMEOUT_S, META_THREADS_MAX
from ._sql import SqlMetaStore, Tx

# Primary result codes that are operating conditions, not bugs in our SQL.
_OPERATING_CODES = {
    sqlite3.SQLITE_BUSY,
    sqlite3.SQLITE_LOCKED,
    sqlite3.SQLITE_IOERR,
    sqlite3.SQLITE_CORRUPT,
    sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_NOTADB,
}


@contextlib.contextmanager
def _operating_errors() -> Iterator[None]:
    """Turn sqlite's operating errors into ``_errors``; bugs (bad SQL,
    constraint violations) stay sqlite3 exceptions and crash loudly."""
    try:
        yield
    except sqlite3.Error as exc:
        code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
        if code == sqlite3.SQLITE_FULL:
            raise err.NoSpace(f"metadata database: {exc}") from exc
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):  # another writer held it too long
            raise err.MetaUnavailable(f"metadata database: {exc}") from exc
        if code in _OPERATING_CODES:
            raise err.AiturboError(f"metadata database: {exc}") from exc
        raise


class SqliteMetaStore(SqlMetaStore):
    """``MetaStore`` in the SQLite file at ``path``."""

    BLOB = "BLOB"
    IDENTITY = "INTEGER PRIMARY KEY AUTOINCREMENT"  # AUTOINCREMENT: never reuse
    # Without statistics the planner walks every dentry id above the offset,
    # across all directories; the (parent, id) index seeks straight to the page.
    READDIR_FROM = "dentries AS d INDEXED BY dentries_readdir"

    def __init__(self, path: str):
        super().__init__(trio.CapacityLimiter(META_THREADS_MAX))
        self.path = path
        self._conn: sqlite3.Connection | None = None

    def __repr__(self) -> str:
        return f"SqliteMetaStore({self.path!r})"

    def _connect(self) -> None:
        with _operating_errors():
            conn = sqlite3.connect(
                self.path,
                timeout=META_BUSY_TIMEOUT_S,  # sets sqlite's busy_timeout
                isolation_level=None,  # we issue BEGIN/COMMIT ourselves
                check_same_thread=False,  # trio's worker threads take turns
            )
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":  # e.g. a filesystem without shared memory
                conn.close()
                raise err.ConfigError(f"{self.path}: sqlite cannot use WAL (journal_mode={mode})")
            conn.execute("PRAGMA synchronous = NORMAL")
        self._conn = conn

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        assert conn is not None  # the base class disconnects only a connected store
        with contextlib.suppress(sqlite3.Error):  # best effort: planner statistics
            conn.execute("PRAGMA optimize")
        conn.close()  # the last connection checkpoints and removes the WAL

    def _transact(self, body: Callable[..., Any], args: tuple, write: bool, durable: bool) -> Any:
        conn = self._conn
        assert conn is not None, "MetaStore.init() was not called, or close() was"
        with _operating_errors():
            if durable:
                conn.execute("PRAGMA synchronous = FULL")
            try:
                return self._in_transaction(conn, body, args, write)
            finally:
                if durable:
                    conn.execute("PRAGMA synchronous = NORMAL")

    def _in_transaction(
        self, conn: sqlite3.Connection, body: Callable[..., Any], args: tuple, write: bool
    ) -> Any:
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        cursor = conn.cursor()
        try:
            result = body(Tx(cursor, self._sql), *args)
            conn.execute("COMMIT")
            return result
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        finally:
            cursor.close()


def from_url(url: str) -> SqliteMetaStore:
    """A store for ``sqlite:///abs/path.db`` (the path must be absolute)."""
    path = url.removeprefix("sqlite://")
    if not path.startswith("/") or path == url:
        raise err.ConfigError(f"metadata URL {url!r}: expected sqlite:///absolute/path.db")
    return SqliteMetaStore(path)
