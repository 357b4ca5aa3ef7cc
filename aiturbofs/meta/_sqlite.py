"""The SQLite metadata engine: one file, one writer connection, a few readers.

This module owns the sqlite3 connections and their transaction boundaries;
all SQL lives in ``_sql`` and the modules of its transaction bodies
(``_sql_*``).  A connection is never used by two threads at once: writes go
through the one writer connection (a capacity limiter of 1), reads through
up to ``META_SQLITE_READERS`` reader connections, each taken by one worker
thread at a time.  In WAL mode readers never wait for the
writer and see every transaction committed before they begin, so a FUSE
lookup does not queue behind the persister's commits.

Group commit: write transactions queue, and whoever leads runs every one
that queued meanwhile as one SQLite transaction, each body in its own
savepoint (a body that raises rolls back its own changes and gets its own
error; the others commit), with one COMMIT.  The group runs on the trio
thread: a commit with ``synchronous=NORMAL`` writes WAL pages to the OS
cache and waits for no disk, which costs less than the hop to a worker
thread (0.3-1 ms on a busy 2-core machine).

Durability: the database runs in WAL mode with ``synchronous=NORMAL``, so no
commit waits for the disk.  A ``durable`` transaction (``set_state``,
``claim_owner``, ``forget_chunk_sources``, ``init``, a ``commit_manifest``
with ``sync``: fsync(2)) returns only once an fsync of the WAL file that
began after its commit has finished; that fsync runs in a thread without the
write lock, and one covers every commit before it (the callers that wait
meanwhile share the next one).  What a crash may lose:

- a crash of the process (kill -9, a bug): nothing that was committed;
- a crash of the host (power cut, kernel panic): what was committed after
  the last fsync: namespace changes (create, rename, unlink, setxattr...),
  manifests that close() committed (their bytes were in DRAM, lost with
  the host anyway: the file comes back as its last synced version), node
  records and recorded chunk sources (dedup chances, not data).  WAL
  replays in order, so what survives is always a prefix of the history:
  never a manifest without the create before it, never a ``durable`` state
  without the manifest it is for.  The database is never corrupted.

Several daemons on one host may share a file: writers take the write lock
up front (``BEGIN IMMEDIATE``) and wait up to ``META_BUSY_TIMEOUT_S`` for
another daemon's transaction to finish; readers never wait (WAL).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import outcome
import trio

from .. import _errors as err
from .._limits import (
    META_BUSY_TIMEOUT_S,
    META_SQLITE_CHECKPOINT_COMMITS,
    META_SQLITE_GROUP_MAX,
    META_SQLITE_READERS,
)
from .._syscalls import fsync_dir
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


def _private(path: str) -> None:
    """Make the database and its WAL and shm files readable by their owner only (0600).

    They hold every file name, of private directories too.  sqlite creates the
    -wal and -shm files with the database file's mode: the database is made
    0600 before sqlite first opens it, and an existing one is tightened.
    """
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        for name in (path, path + "-wal", path + "-shm"):
            with contextlib.suppress(FileNotFoundError):
                if os.stat(name).st_mode & 0o077:
                    os.chmod(name, 0o600)
    except OSError as exc:
        raise err.AiturboError(f"metadata database {path}: {exc.strerror}") from exc


@contextlib.contextmanager
def _committed(conn: sqlite3.Connection) -> Iterator[sqlite3.Cursor]:
    """A cursor in the transaction just begun on ``conn``: COMMIT when the
    block ends, ROLLBACK if it raises."""
    cursor = conn.cursor()
    try:
        yield cursor
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    finally:
        cursor.close()


class _Queued:
    """One write transaction waiting for the group commit."""

    __slots__ = ("body", "args", "durable", "outcome", "wake", "group")

    def __init__(self, body: Callable[..., Any], args: tuple, durable: bool):
        self.body = body
        self.args = args
        self.durable = durable
        self.outcome: outcome.Outcome | None = None  # set once its group committed (or failed)
        self.wake = trio.Event()  # done, or its turn to lead the next group
        self.group = 0  # the number of the group that committed it


class SqliteMetaStore(SqlMetaStore):
    """``MetaStore`` in the SQLite file at ``path``."""

    BLOB = "BLOB"
    IDENTITY = "INTEGER PRIMARY KEY AUTOINCREMENT"  # AUTOINCREMENT: never reuse
    # Without statistics the planner walks every dentry id above the offset,
    # across all directories; the (parent, id) index seeks straight to the page.
    READDIR_FROM = "dentries AS d INDEXED BY dentries_readdir"

    def __init__(self, path: str):
        super().__init__(trio.CapacityLimiter(1))  # the writer connection
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._read_limiter = trio.CapacityLimiter(META_SQLITE_READERS)
        self._readers: list[sqlite3.Connection] = []  # idle reader connections
        self._inline: sqlite3.Connection | None = None  # the trio thread's reader (quick reads)
        self._queue: list[_Queued] = []  # write transactions for the next group
        self._leading = False  # a caller runs a group now (or is about to)
        self._groups = 0  # groups begun so far (numbers them)
        self._committed_groups = 0  # every group up to this one has committed (they commit in order)
        self._checkpointed = 0  # the group after which the last checkpoint ran
        self._synced_group = 0  # every group up to this one is on disk
        self._syncing: trio.Event | None = None  # set when the running fsync ends
        self._wal_synced: int | None = None  # inode of the WAL file whose directory entry was synced

    def __repr__(self) -> str:
        return f"SqliteMetaStore({self.path!r})"

    def _open(self, busy_timeout_s: float = META_BUSY_TIMEOUT_S) -> sqlite3.Connection:
        return sqlite3.connect(
            self.path,
            timeout=busy_timeout_s,  # sets sqlite's busy_timeout
            isolation_level=None,  # we issue BEGIN/COMMIT ourselves
            check_same_thread=False,  # trio's worker threads take turns
        )

    def _connect(self) -> None:
        with _operating_errors():
            _private(self.path)
            conn = self._open()
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":  # e.g. a filesystem without shared memory
                conn.close()
                raise err.ConfigError(f"{self.path}: sqlite cannot use WAL (journal_mode={mode})")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # checkpoints run in a thread (_lead)
            conn.execute("PRAGMA busy_timeout = 0")  # inline groups never wait; a thread group sets it
        self._conn = conn

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        assert conn is not None  # the base class disconnects only a connected store
        readers, self._readers = self._readers, []
        if self._inline is not None:
            readers.append(self._inline)
            self._inline = None
        for reader in readers:  # readers first: the last connection checkpoints
            reader.close()
        with contextlib.suppress(sqlite3.Error):  # best effort: planner statistics
            conn.execute("PRAGMA optimize")
        conn.close()  # the last connection checkpoints and removes the WAL

    async def _run(
        self,
        body: Callable[..., Any],
        *args: Any,
        write: bool,
        durable: bool = False,
        dirs: tuple[int, ...] = (),
        quick: bool = False,
    ) -> Any:
        """Reads on a reader connection; writes through the group commit.

        A ``quick`` read (a few rows by key) runs right here on the trio
        thread (``_read_inline``), never waiting for a lock: a thread hop
        costs 0.3-1 ms on a busy 2-core machine, the read itself about 0.1 ms
        (WAL pages are in memory).  Should it find the database busy
        (another daemon recovering the WAL), it waits in a thread like any
        other read.

        Not cancellable once queued, like the base class: a write's caller
        waits (shielded) for the group that holds it, at most one group
        behind the one syncing now.
        """
        assert self._connected, "MetaStore.init() was not called, or close() was"
        self.calls[body.__name__] += 1
        if not write:
            if quick:
                await trio.lowlevel.checkpoint()
                try:
                    return self._read_inline(body, args)
                except err.MetaUnavailable:
                    pass  # busy: wait for it in a thread
            return await trio.to_thread.run_sync(self._read, body, args, limiter=self._read_limiter)
        mine = _Queued(body, args, durable)
        self._queue.append(mine)
        with trio.CancelScope(shield=True):
            if self._leading:
                await mine.wake.wait()  # committed in a group, or it leads the next one
            if mine.outcome is None:
                await self._lead()
        assert mine.outcome is not None
        result = mine.outcome.unwrap()
        if durable:
            with trio.CancelScope(shield=True):
                await self._synced(mine.group)
        return result

    async def _lead(self) -> None:
        """Commit the queue's first ``META_SQLITE_GROUP_MAX`` transactions as one
        group, then wake their callers and hand the lead to the next in line.

        The group runs right here on the trio thread: a commit without fsync
        is a few page writes to the OS cache, cheaper than the thread hop.
        Only when another daemon holds the write lock does it wait for it in
        a thread.  WAL checkpoints (which write and sync the database file)
        run in a thread every ``META_SQLITE_CHECKPOINT_COMMITS`` groups.
        """
        self._leading = True
        group, self._queue = self._queue[:META_SQLITE_GROUP_MAX], self._queue[META_SQLITE_GROUP_MAX:]
        try:
            self._groups += 1
            for queued in group:
                queued.group = self._groups
            if not self._commit_group(group, inline=True):
                await trio.to_thread.run_sync(self._commit_group, group, False, limiter=self._limiter)
            self._committed_groups = self._groups
            if self._groups - self._checkpointed >= META_SQLITE_CHECKPOINT_COMMITS:
                self._checkpointed = self._groups
                await trio.to_thread.run_sync(self._checkpoint, limiter=self._limiter)
        finally:
            for queued in group:
                if queued.outcome is None:  # the commit never ran: cannot happen, but never hang a caller
                    queued.outcome = outcome.Error(err.AiturboError("metadata group commit did not run"))
                queued.wake.set()
            if self._queue:
                self._queue[0].wake.set()  # it leads the next group; _leading stays
            else:
                self._leading = False

    async def _synced(self, group: int) -> None:
        """Return once group number ``group`` is on disk.

        One fsync of the WAL covers every group committed before it began
        (not one still committing in a thread), so durable callers that
        arrive while one runs share the next; the fsync runs in a thread and
        holds no lock: writers go on meanwhile.
        """
        while self._synced_group < group:
            running = self._syncing
            if running is not None:
                await running.wait()
                continue
            target = self._committed_groups
            self._syncing = done = trio.Event()
            try:
                await trio.to_thread.run_sync(self._fsync_wal)
                self._synced_group = max(self._synced_group, target)
            finally:
                self._syncing = None
                done.set()

    def _checkpoint(self) -> None:
        """Copy the WAL into the database (PASSIVE: never waits for readers)."""
        assert self._conn is not None
        with _operating_errors():
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def _fsync_wal(self) -> None:
        """Put every commit so far on disk.  Committed transactions are in
        the WAL file (synchronous=NORMAL wrote them without fsync), or,
        checkpointed, in the database file, which a checkpoint syncs."""
        with _operating_errors():
            try:
                fd = os.open(self.path + "-wal", os.O_RDONLY)
            except FileNotFoundError:
                return  # nothing since the last checkpoint
            try:
                os.fsync(fd)
                wal = os.fstat(fd).st_ino
            except OSError as exc:
                raise err.AiturboError(f"metadata database: fsync of its WAL: {exc}") from exc
            finally:
                os.close(fd)
            if wal != self._wal_synced:
                # A new WAL file: its directory entry must be on disk too, or a crash loses it with
                # every commit it holds.
                fsync_dir(os.path.dirname(os.path.abspath(self.path)))
                self._wal_synced = wal

    async def sync(self) -> None:
        with trio.CancelScope(shield=True):
            await self._synced(self._committed_groups)

    def _read_inline(self, body: Callable[..., Any], args: tuple) -> Any:
        """Run a quick read body in autocommit mode: each statement sees the
        latest commit.  No BEGIN/COMMIT (they cost as much as the read): no
        commit of this daemon can come between two statements, its writes
        run on this thread too (or, busy, after the read started waiting)."""
        with _operating_errors():
            if self._limiter.borrowed_tokens == 0:
                # The writer is idle (no thread has it): its page cache is
                # current, where another connection's would be re-read from
                # the OS after every commit.
                conn = self._conn
            else:
                conn = self._inline
                if conn is None:
                    conn = self._inline = self._open(busy_timeout_s=0)  # never block the trio thread on a lock
                    conn.execute("PRAGMA query_only = ON")
            assert conn is not None
            cursor = conn.cursor()
            try:
                return body(Tx(cursor, self._sql), *args)
            finally:
                cursor.close()

    def _read(self, body: Callable[..., Any], args: tuple) -> Any:
        """Run a read-only body on an idle reader connection (opened on first need)."""
        with _operating_errors():
            try:
                conn = self._readers.pop()
            except IndexError:
                conn = self._open()
                conn.execute("PRAGMA query_only = ON")
            try:
                return self._in_transaction(conn, body, args, write=False)
            finally:
                self._readers.append(conn)

    def _commit_group(self, group: list[_Queued], inline: bool) -> bool:
        """Run ``group`` as one transaction, each body in a savepoint; one COMMIT.

        Sets each member's outcome: its body's result or error once COMMIT
        succeeded, or the transaction's error for all of them.  ``inline``
        (the trio thread): give up at once, returning False with nothing
        run, if another connection holds the write lock.
        """
        conn = self._conn
        assert conn is not None, "MetaStore.init() was not called, or close() was"
        results: list[outcome.Outcome] = []
        try:
            with _operating_errors():
                if not inline:
                    conn.execute(f"PRAGMA busy_timeout = {int(META_BUSY_TIMEOUT_S * 1000)}")
                try:
                    try:
                        conn.execute("BEGIN IMMEDIATE")
                    except sqlite3.OperationalError as exc:
                        if inline and (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF == sqlite3.SQLITE_BUSY:
                            return False
                        raise
                    with _committed(conn) as cursor:
                        for queued in group:
                            conn.execute("SAVEPOINT member")
                            result = outcome.capture(self._member, queued, Tx(cursor, self._sql))
                            if isinstance(result, outcome.Error):
                                conn.execute("ROLLBACK TO member")
                            conn.execute("RELEASE member")
                            results.append(result)
                finally:
                    if not inline:
                        conn.execute("PRAGMA busy_timeout = 0")
        except BaseException as exc:  # noqa: BLE001 - the group's shared failure is each member's
            for queued in group:
                queued.outcome = outcome.Error(exc)
            return True
        for queued, result in zip(group, results):
            queued.outcome = result
        return True

    @staticmethod
    def _member(queued: _Queued, tx: Tx) -> Any:
        with _operating_errors():
            return queued.body(tx, *queued.args)

    def _in_transaction(
        self, conn: sqlite3.Connection, body: Callable[..., Any], args: tuple, write: bool
    ) -> Any:
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        with _committed(conn) as cursor:
            return body(Tx(cursor, self._sql), *args)


def from_url(url: str) -> SqliteMetaStore:
    """A store for ``sqlite:///abs/path.db`` (the path must be absolute)."""
    path = url.removeprefix("sqlite://")
    if not path.startswith("/") or path == url:
        raise err.ConfigError(f"metadata URL {url!r}: expected sqlite:///absolute/path.db")
    return SqliteMetaStore(path)
