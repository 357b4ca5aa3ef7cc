"""The PostgreSQL metadata engine: one database shared by the daemons of a cluster.

This module owns the psycopg connections of one store, the transaction
boundaries and their retries; all SQL lives in ``_sql`` and the modules of
its transaction bodies (``_sql_*``).  A store's connections are a
``psycopg_pool.ConnectionPool`` of at most ``META_PG_CONNECTIONS``, each
used by one worker thread at a time (the
capacity limiter lets no more threads in than the pool holds, so a call
never waits for another's connection): with a cluster's round trips, one
connection would hold every FUSE request of a node behind the one in
flight.  The pool keeps one connection open and opens the others, in its
own thread, when calls need them.  The server's ``max_connections`` must
allow that many per daemon.

Isolation: every public method is ONE transaction at SERIALIZABLE.  The
bodies (``_sql_*``) check, then change ("is the name free? insert it"); when
two daemons do that at once, PostgreSQL aborts one of them with a
serialization failure (SQLSTATE 40001) or a deadlock (40P01), or the unique
index on ``(parent, name)`` rejects the second insert (23505).  Such a
transaction is run again from the start, up to ``META_PG_TX_ATTEMPTS_MAX``
times with jittered exponential backoff; the re-run sees the winner's row
and answers, say, ``Exists``.  A transaction that loses every time gives up
with a transient ``AiturboError`` (EIO); a unique violation that persists
through every run is a bug and is raised as it is.

Directories: every namespace change (create, link, unlink, rmdir, rename)
updates its directory's row, so concurrent changes in one directory (every
rank of a job writing its shard into one checkpoint directory) would all
but one abort, again and again.  They queue instead: before BEGIN the
session takes an advisory lock per directory (the inode number is the key;
ascending order, so two renames never deadlock) and holds it to the end of
the transaction.  The lock is for throughput and fairness only; correctness
rests on SERIALIZABLE, which also covers every writer that takes no lock.

Data a serializable transaction read is valid only once it has committed
(PostgreSQL manual, 13.2.3).  So a body that ends in an error (``NotFound``,
``Exists``...) does not just roll back: its writes are undone to a savepoint
taken before it, the transaction COMMITs, and only a successful commit lets
the error through; a failed one runs the body again.  Read-only methods run
``READ ONLY`` and commit the same way, except the reads of one statement
(``ONE_STATEMENT_READS``: an inode, a name, an inode's paths, an xattr), which are sent
alone: the server runs such a statement as a transaction of its own at
the session's default isolation, set to SERIALIZABLE, in one round trip
where BEGIN, the statement and COMMIT took three.  (A second statement
that only tells which error to raise runs as another.)

Connections: ``init`` connects once itself, so that a server that refuses
(down, a wrong password, no such database) fails it at once with the
server's own reason; the pool would only time out.  A lost connection
(server restart, network, an administrator's ``pg_terminate_backend``)
makes the call fail with a transient ``AiturboError`` (EIO).  The pool
never hands it out again (it discards a connection that comes back
closed), and the idle ones, which went down with it, are drained; the
pool opens new ones in its thread, retrying with backoff for
``META_PG_RECONNECT_S``, after which the next call that needs one asks
again.  A call waits at most ``META_PG_CONNECT_TIMEOUT_S`` for a
connection, then fails with EIO: while the server is down a call takes
that long to fail, and a restart shorter than that is ridden out.  A
connection lost during COMMIT leaves the outcome unknown: the caller sees
EIO although the change may have been applied.  Statements (lock waits
included) time out after ``META_PG_STATEMENT_TIMEOUT_S``; TCP keepalives
notice a server that went silent.  Settings given in the URL
(``?connect_timeout=...``) win over these defaults.

Durability: every commit waits for the server's WAL flush (the server's
default ``synchronous_commit=on``), so the ``durable`` flag changes nothing.

Schema: ``init`` serialises daemons that start together on an empty
database with an advisory lock and runs at READ COMMITTED, so the ones that
wait see the schema and the root the first one committed.  Identities (inode
numbers, readdir tokens) come from sequences that start at 2 (the root is 1)
and never hand out a number twice, also not for transactions that aborted.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import trio
from psycopg import errors as pgerr
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_random_exponential

from .. import _errors as err
from .._limits import (
    META_PG_CONNECT_TIMEOUT_S,
    META_PG_CONNECTIONS,
    META_PG_KEEPALIVE_S,
    META_PG_RECONNECT_S,
    META_PG_RETRY_BACKOFF_FIRST_S,
    META_PG_RETRY_BACKOFF_MAX_S,
    META_PG_STATEMENT_TIMEOUT_S,
    META_PG_TX_ATTEMPTS_MAX,
)
from ._sql import ONE_STATEMENT_READS, SqlMetaStore, Tx

# The pool logs every checkout and return at INFO; a daemon's log wants only
# its warnings (a connect that failed, a connection it discarded).
logging.getLogger("psycopg.pool").setLevel(logging.WARNING)

# Errors after which the same transaction, run again, may well succeed.
_CONFLICTS = (pgerr.SerializationFailure, pgerr.DeadlockDetected, pgerr.UniqueViolation)



def _conflicts_exhausted(state: RetryCallState) -> bool:
    """The transaction ran META_PG_TX_ATTEMPTS_MAX times (the limit as it is now, not at import)."""
    return state.attempt_number >= META_PG_TX_ATTEMPTS_MAX


# SQLSTATE classes that are operating conditions, not bugs in our SQL:
# connection, insufficient resources, operator intervention (statement
# timeout, shutdown), system error, internal error (corruption), and
# transaction rollback (statement completion unknown...).
_OPERATING_CLASSES = ("08", "53", "57", "58", "XX", "40")
_READ_ONLY_STANDBY = "25006"  # connected to a hot standby: writes refused

# init() of daemons starting together: one creates the schema, the others wait.
# The two-key form: a key space apart from the one-key directory locks (inode numbers).
_INIT_LOCK_KEY = 0x61697475  # "aitu"; any constant no other client of the database uses

_SAVEPOINT = "body"
_COMMIT = "COMMIT"
_UNDO_AND_COMMIT = f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}; COMMIT"
_ROLLBACK = "ROLLBACK"
_UNLOCK = "SELECT pg_advisory_unlock_all()"  # the session holds no other advisory lock

# TCP keepalives: after META_PG_KEEPALIVE_S idle, probe every META_PG_KEEPALIVE_S,
# give up after 3 lost probes; tcp_user_timeout bounds unacknowledged sends.
_CONNECT_DEFAULTS = {
    "connect_timeout": str(int(META_PG_CONNECT_TIMEOUT_S)),
    "keepalives": "1",
    "keepalives_idle": str(META_PG_KEEPALIVE_S),
    "keepalives_interval": str(META_PG_KEEPALIVE_S),
    "keepalives_count": "3",
    "tcp_user_timeout": str(int(4 * META_PG_KEEPALIVE_S * 1000)),
    "application_name": "aiturbofs",
}


def _to_pyformat(sql: str) -> str:
    """``?`` placeholders as psycopg's ``%s`` (``_sql`` writes no ``%`` and no ``?`` literal)."""
    return sql.replace("?", "%s")


def _begin(isolation: str, write: bool) -> str:
    if write:
        return f"BEGIN ISOLATION LEVEL {isolation}; SAVEPOINT {_SAVEPOINT}"
    return f"BEGIN ISOLATION LEVEL {isolation} READ ONLY"


class PostgresMetaStore(SqlMetaStore):
    """``MetaStore`` in the PostgreSQL database at ``url``."""

    BLOB = "BYTEA"
    INT = "BIGINT"
    IDENTITY = "BIGINT GENERATED BY DEFAULT AS IDENTITY (START WITH 2) PRIMARY KEY"
    READDIR_FROM = "dentries d"

    def __init__(self, url: str, params: dict[str, str]):
        super().__init__(trio.CapacityLimiter(META_PG_CONNECTIONS))
        self.url = url
        # libpq keywords only, none that psycopg.connect() takes for itself (autocommit, ...)
        self._connect_kwargs: dict[str, Any] = {k: v for k, v in _CONNECT_DEFAULTS.items() if k not in params}
        host, port, db = params.get("host", ""), params.get("port", ""), params.get("dbname", "")
        self._where = f"{host or 'localhost'}{':' + port if port else ''}/{db}"
        self._pool: ConnectionPool[psycopg.Connection[Any]] | None = None  # from init() to close()
        # A transaction that lost a conflict runs again after a jittered
        # backoff ("full jitter": uniform(0, first x 2^n), capped), outside
        # the transaction, no locks held.  One per store: tenacity keeps a
        # run's state per thread, and a worker thread runs one transaction at
        # a time.
        self._conflict_retries = Retrying(
            stop=_conflicts_exhausted,
            wait=wait_random_exponential(multiplier=META_PG_RETRY_BACKOFF_FIRST_S, max=META_PG_RETRY_BACKOFF_MAX_S),
            retry=retry_if_exception_type(_CONFLICTS),
            reraise=True,
        )

    def __repr__(self) -> str:
        return f"PostgresMetaStore({self._where!r})"

    # --- connections -------------------------------------------------------------------

    def _connect(self) -> None:
        # The pool connects in its own thread and retries: a server that
        # refuses would show only as a timeout.  One connection of our own
        # gives init the server's reason at once; the pool opens its own.
        probe = self._open()
        try:
            self._configure(probe)
        finally:
            probe.close()
        # A closed pool cannot be opened again: a store that init()s after close() gets a new one.
        self._pool = ConnectionPool(
            self.url,
            kwargs={"autocommit": True, **self._connect_kwargs},
            min_size=1,
            max_size=META_PG_CONNECTIONS,
            open=False,
            configure=self._configure,
            name=f"aiturbofs-meta {self._where}",
            timeout=META_PG_CONNECT_TIMEOUT_S,
            reconnect_timeout=META_PG_RECONNECT_S,
        )
        self._pool.open(wait=False)

    def _open(self) -> psycopg.Connection[Any]:
        try:
            return psycopg.connect(self.url, autocommit=True, **self._connect_kwargs)
        except psycopg.Error as exc:
            raise err.MetaUnavailable(f"metadata database {self._where}: cannot connect: {exc}") from exc

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """The settings of every new connection (the pool calls this too)."""
        try:
            timeout_ms = int(META_PG_STATEMENT_TIMEOUT_S * 1000)
            conn.execute(f"SET statement_timeout = {timeout_ms}", prepare=False)
            # What a statement sent without BEGIN runs at (``ONE_STATEMENT_READS``); every other
            # transaction names its isolation in its BEGIN.
            conn.execute("SET default_transaction_isolation = 'serializable'", prepare=False)
        except psycopg.Error as exc:
            conn.close()  # the pool would not: it only retries
            raise err.AiturboError(f"metadata database {self._where}: {exc}") from exc

    def _disconnect(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()  # connections in use are closed when they come back

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection of the pool for one transaction; back to it after (broken: discarded)."""
        pool = self._pool  # close() may drop it meanwhile: this one takes the connection back
        assert pool is not None, "MetaStore.init() was not called, or close() was"
        try:
            conn = pool.getconn()
        except psycopg.OperationalError as exc:  # PoolTimeout; PoolClosed: close() ran while this call waited
            raise err.MetaUnavailable(f"metadata database {self._where}: cannot connect: {exc}") from exc
        try:
            yield conn
        finally:
            pool.putconn(conn)  # a closed or broken one is not kept; a closed pool closes it

    # --- transactions -------------------------------------------------------------------

    def _tx_init(self, tx: Tx, root_uid: int, root_gid: int, root_mode: int) -> None:
        tx.one("SELECT pg_advisory_xact_lock(?, 0)", _INIT_LOCK_KEY)
        super()._tx_init(tx, root_uid, root_gid, root_mode)

    def _transact(self, body: Callable[..., Any], args: tuple, write: bool, durable: bool) -> Any:
        return self._transact_in_dirs((), body, args, write, durable)

    def _transact_in_dirs(
        self, dirs: tuple[int, ...], body: Callable[..., Any], args: tuple, write: bool, durable: bool
    ) -> Any:
        # init runs at READ COMMITTED: after its advisory lock, its statements
        # must see what a daemon that held the lock before committed.
        isolation = "READ COMMITTED" if body == self._tx_init else "SERIALIZABLE"
        # A one-statement read is sent alone: the server runs it as a transaction of its own at the
        # session's isolation (SERIALIZABLE, ``_configure``), as BEGIN ... COMMIT around it would, in one
        # round trip instead of three.  Its result is returned only once that transaction committed.
        begin = None if not write and not dirs and body in ONE_STATEMENT_READS else _begin(isolation, write)
        keys = sorted(set(dirs))  # one order for every daemon: two renames never deadlock
        try:
            for attempt in self._conflict_retries:
                with attempt:
                    return self._run_once(body, args, begin, write, keys)
        except _CONFLICTS as exc:  # lost every run
            if isinstance(exc, pgerr.UniqueViolation):
                raise  # the same row again and again: our SQL, not a race
            raise err.AiturboError(
                f"metadata database {self._where}: transaction lost {META_PG_TX_ATTEMPTS_MAX} conflicts"
                f" with other writers in a row: {exc}"
            ) from exc
        raise AssertionError("unreachable")

    def _run_once(
        self, body: Callable[..., Any], args: tuple, begin: str | None, write: bool, dirs: list[int]
    ) -> Any:
        """``_attempt`` on a connection of the pool: a conflict is raised as it is, for
        the caller to run the body again; other database errors as ``_errors`` classes."""
        with self._connection() as conn:
            try:
                return self._attempt(conn, body, args, begin, write, dirs)
            except _CONFLICTS:
                raise
            except psycopg.Error as exc:
                mapped = self._operating_error(conn, exc)  # while the connection is still ours
                if mapped is exc:
                    raise
                raise mapped from exc

    def _attempt(
        self,
        conn: psycopg.Connection,
        body: Callable[..., Any],
        args: tuple,
        begin: str | None,
        write: bool,
        dirs: list[int],
    ) -> Any:
        """One run of ``body`` in a transaction begun with ``begin``.

        ``begin`` None: a read of ``ONE_STATEMENT_READS``, whose statement is its own transaction.

        With ``dirs``, the session first takes an advisory lock per directory
        and keeps it to the end of the transaction: the writers of one
        directory then queue, and each one's snapshot (taken at its first
        statement, after the locks) already holds the previous one's commit,
        instead of all but one aborting on the directory's row.  Correctness
        still rests on SERIALIZABLE, which also covers writers without locks.
        """
        if begin is None:
            with conn.cursor() as cursor:
                return body(Tx(cursor, _to_pyformat), *args)
        locked = bool(dirs)
        try:
            if dirs:
                # A statement of its own: sent with BEGIN, it would run inside
                # the transaction and take the snapshot before the wait.
                lock = ", ".join(f"pg_advisory_lock({int(ino)})" for ino in dirs)
                conn.execute(f"SELECT {lock}", prepare=False)
            conn.execute(begin, prepare=False)
            try:
                with conn.cursor() as cursor:
                    try:
                        result = body(Tx(cursor, _to_pyformat), *args)
                    except err.AiturboError:
                        # What the body read is valid only if the transaction
                        # commits: undo its writes, commit, then report the error.
                        conn.execute(_UNDO_AND_COMMIT if write else _COMMIT, prepare=False)
                        raise
                conn.execute(_COMMIT + ("; " + _UNLOCK if locked else ""), prepare=False)
                locked = False
                return result
            except BaseException:
                if not conn.broken and conn.info.transaction_status != TransactionStatus.IDLE:
                    try:
                        conn.execute(_ROLLBACK, prepare=False)
                    except psycopg.Error:
                        conn.close()  # cannot tell its state: never reuse it
                raise
        finally:
            if locked and not (conn.broken or conn.closed):
                try:
                    conn.execute(_UNLOCK, prepare=False)
                except psycopg.Error:
                    conn.close()  # a session lock must not outlive the call: drop the session

    def _operating_error(self, conn: psycopg.Connection, exc: psycopg.Error) -> BaseException:
        """The ``_errors`` class for a database error, or ``exc`` itself for a bug."""
        state = exc.sqlstate or ""
        if conn.broken or conn.closed:
            conn.close()  # the pool discards it when it comes back
            pool = self._pool
            if pool is not None:
                pool.drain()  # the idle ones went down with it (server restart): the pool opens new ones
            return err.MetaUnavailable(f"metadata database {self._where}: connection lost: {exc}")
        if isinstance(exc, pgerr.DiskFull):
            return err.NoSpace(f"metadata database {self._where}: {exc}")
        if isinstance(exc, pgerr.QueryCanceled):
            return err.MetaUnavailable(
                f"metadata database {self._where}: statement timed out or was cancelled: {exc}"
            )
        if not state or state[:2] in _OPERATING_CLASSES or state == _READ_ONLY_STANDBY:
            return err.AiturboError(f"metadata database {self._where}: {exc}")
        return exc


def from_url(url: str) -> PostgresMetaStore:
    """A store for ``postgresql://[user[:password]@]host[:port]/dbname[?param=value...]``."""
    try:
        params = {key: str(value) for key, value in conninfo_to_dict(url).items()}  # parsed from a string: str
    except psycopg.Error as exc:
        raise err.ConfigError(f"metadata URL: {exc}") from None  # the URL may hold a password
    if not params.get("dbname"):
        raise err.ConfigError("metadata URL: expected postgresql://[user@]host[:port]/dbname")
    return PostgresMetaStore(url, params)
