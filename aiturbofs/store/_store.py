"""The chunk store: a chunk by its key, from the pool, a peer, or the backend, verified.

The one place both the read side (vfs) and the persister ask for a chunk's
bytes, below both of them.  ``read`` answers from the staging pool (memory,
then the spill store), and on a miss walks the tiers (``fetch``): the
grouped read round's chain predecessor, the DRAM of the nodes that hold the
version (``row.holders``, from the inode the caller already has: no database
round trip per chunk), then the backend, verified against the chunk's
BLAKE3.  Concurrent misses of one key are one fetch (the pool's
``Reads``).  The persister asks the same walk for chunks of an earlier
version it must upload again (``lease_previous``).

Chunks of objects imported without a manifest are read by their *names*
(``read_named``, ``_named``): the node that fetches one hashes it, and
``content_key`` answers what a name's bytes hash to.

The store also owns ``ns_lock``, held while backend objects are published,
moved, deleted and their keys recorded (the persister), and while a
directory is listed against the rows (the importer): under it every row's
backend keys are where its objects are.

Backend reads for a reader retry transient errors a few times within a
deadline (``read_range``): the backend layer itself never retries.  The
store says whether the backend answers through ``health``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import trio
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from .. import chunk
from .._errors import (
    BackendNotFound,
    BackendUnreachable,
    BrokenFile,
    IntegrityError,
    SourceChanged,
    TransientBackendError,
)
from .._limits import (
    BACKEND_CHECK_TIMEOUT_S,
    CHUNK_BYTES,
    PERSIST_BACKOFF_JITTER,
    READ_BACKEND_TIMEOUT_S,
    READ_RETRY_ATTEMPTS,
    READ_RETRY_FIRST_S,
)
from .._threads import background
from ._named import NamedHashes, external_key

if TYPE_CHECKING:
    from ..backend import Backend
    from ..cluster import ClusterPort
    from ..meta import InodeRow, MetaStore
    from ..staging import Range, StagingPool
    from ._health import BackendHealth

log = logging.getLogger(__name__)


def _read_backoff_s(state: RetryCallState) -> float:
    """The backoff after try ``state.attempt_number``: READ_RETRY_FIRST_S, doubling."""
    return READ_RETRY_FIRST_S * 2 ** (state.attempt_number - 1)


def _read_wait_s(state: RetryCallState) -> float:
    return _read_backoff_s(state) * random.uniform(1.0 - PERSIST_BACKOFF_JITTER, 1.0)  # jittered like persist retries


class ChunkStore:
    """Chunks by key for readers and for the persister (see module doc)."""

    def __init__(self, meta: MetaStore, backend: Backend, pool: StagingPool, cluster: ClusterPort,
                 health: BackendHealth, *, record_error: Callable[[str], None]):
        self.meta = meta
        self.backend = backend
        self.pool = pool
        self.cluster = cluster
        self.health = health
        self._record_error = record_error
        self.ns_lock = trio.Lock()  # see module doc; the persister's modules say who takes it where
        self.named = NamedHashes()
        self.bytes_fetched = 0  # read from the backend (status: persist.bytes_fetched)
        self.read_retries = 0  # backend reads retried for a reader

    # ------------------------------------------------------------ reads through the pool
    async def read(self, ino: int, index: int, key: bytes, length: int, row: InodeRow | None, *,
                   into: Range | None = None, start: int = 0, count: int | None = None):
        """Bytes ``[start, start + count)`` of sealed chunk ``index`` of inode ``ino`` (``row``: its row, if
        the caller has it), valid until the next await; a fetched chunk is cached in ``into`` if given."""
        return await self.pool.read(key, lambda: self.fetch(ino, index, key, length, row),
                                    into=into, start=start, count=count)

    def lease_previous(self, row: InodeRow, index: int, key: bytes, length: int) -> AbstractAsyncContextManager:
        """A chunk of ``row``'s version held for an ``async with``: from the pool, else ``previous``."""
        return self.pool.lease(key, lambda: self.previous(row, index, key, length))

    def lease_held(self, key: bytes, holders: list[str], what: str) -> AbstractAsyncContextManager:
        """Chunk ``key`` held for an ``async with``: from the pool, else from the DRAM of one of ``holders``
        (for ``what``, named in the error when none has it)."""
        async def fetch() -> bytes:
            data = await self.cluster.fetch(key, holders)
            if data is None:
                raise IntegrityError(f"chunk {key.hex()[:16]}… for {what} is on no holder")
            return data

        return self.pool.lease(key, fetch)

    async def read_named(self, row: InodeRow, index: int, length: int, *, into: Range | None = None,
                         start: int = 0, count: int | None = None):
        """Named chunk ``index`` of ``row``'s imported object (``_named``), like ``read``.

        Returns (bytes valid until the next await, the BLAKE3 of the chunk if
        this call fetched and hashed it, else None).  Raises
        ``SourceChanged`` when the object is no longer the version imported.
        """
        name = external_key(row, index)
        hashed: list[bytes] = []

        async def fetch() -> bytes:
            digest, data = await self._fetch_named(row, index, name, length)
            hashed.append(digest)
            return data

        data = await self.pool.read(name, fetch, into=into, start=start, count=count)
        return data, (hashed[0] if hashed else None)

    def content_key(self, name: bytes) -> bytes | None:
        """The BLAKE3 of a named chunk's bytes, if this node has read it."""
        return self.named.get(name)

    # ------------------------------------------------------------ the walk of a miss
    async def fetch(self, ino: int, index: int, key: bytes, length: int, row: InodeRow | None = None) -> bytes:
        """Sealed chunk ``index`` of inode ``ino``, not from the pool: chain, holders, backend (verified)."""
        data = await self.cluster.round_fetch(ino, key)  # a grouped read: from our chain predecessor
        if data is not None:
            return data
        if row is None:
            row = await self.meta.get_inode(ino)
        data = await self._from_peers(row, key)  # the distributed cache: holders' DRAM before storage
        if data is not None:
            return data
        if not row.backend_keys:
            row = await self.meta.get_inode(ino)  # the in-memory row may predate the first publish
            if not row.backend_keys:
                raise IntegrityError(f"chunk {index} of inode {ino} is in neither DRAM, spill nor the backend")
        try:
            return await self.read_verified(row.backend_keys, index, key, length)
        except IntegrityError:
            # A rename may be moving the object right now, to a name the file
            # may no longer have (renamed again, its directory renamed).  This
            # node moves objects and records their keys under ns_lock: read
            # under it, the recorded keys are where they are.  Another node's
            # moves land at one of the current names.  Reads are verified, so
            # trying those names cannot return other bytes.
            async with self.ns_lock:
                latest = await self.meta.get_inode(ino)
                paths = await self.meta.paths_of(ino)
                return await self.read_verified(list(dict.fromkeys([*latest.backend_keys, *paths])), index, key, length)

    async def previous(self, row: InodeRow, index: int, key: bytes, length: int) -> bytes:
        """A chunk of ``row``'s version the pool no longer has: from a peer's pool or the previous backend version."""
        data = await self._from_peers(row, key)
        if data is not None:
            return data
        if not row.backend_keys:
            raise IntegrityError(f"chunk {index} of inode {row.ino} is in neither DRAM, spill nor the backend")
        return await self.read_verified(row.backend_keys, index, key, length)

    async def _from_peers(self, row: InodeRow, key: bytes) -> bytes | None:
        cluster = self.cluster
        others = [h for h in row.holders if h != cluster.owner]
        return await cluster.fetch(key, others) if others else None

    async def _fetch_named(self, row: InodeRow, index: int, name: bytes, length: int) -> tuple[bytes, bytes]:
        """(BLAKE3, bytes) of a named chunk: from the read chain's predecessor, else the backend.

        Verified against the hash the chain carried, or hashed here.
        """
        got = await self.cluster.round_fetch_named(row.ino, name)
        if got is not None:
            digest, data = got
        else:
            keys = row.backend_keys
            if not keys:
                raise BrokenFile(f"inode {row.ino} has no data in the backend")
            try:
                data = await self.read_range(keys[0], index * CHUNK_BYTES, length, if_etag=row.backend_etag)
            except SourceChanged as exc:
                self._record_error(f"{keys[0]} changed in the backend since it was imported: {exc}")
                raise
            if len(data) != length:
                raise BrokenFile(f"{keys[0]} is shorter than expected (changed in the backend?)")
            self.bytes_fetched += length
            digest = await trio.to_thread.run_sync(background, chunk.digest, data)
        self.named.learn(name, digest)
        return digest, data

    # ------------------------------------------------------------ the backend, for a reader
    async def read_range(self, key: str, offset: int, length: int, *, if_etag: str | None = None) -> bytes:
        """``backend.read_range`` for a reader: transient errors are retried a few times.

        A reader blocked on a chunk gets READ_RETRY_ATTEMPTS tries, backing
        off, within READ_BACKEND_TIMEOUT_S in all, before the error reaches it
        as EIO.  One 503 must not fail a read, and a backend that stopped
        answering must not hold it for minutes: while the backend is
        unavailable a read gets one try of at most BACKEND_CHECK_TIMEOUT_S.
        Raises ``TransientBackendError``; ``BackendUnreachable`` (no answer
        at all) also marks the backend unavailable.
        """
        health = self.health
        attempts, timeout_s = ((READ_RETRY_ATTEMPTS, READ_BACKEND_TIMEOUT_S) if health.available
                               else (1, BACKEND_CHECK_TIMEOUT_S))
        try:
            with trio.fail_after(timeout_s):
                data = await self._read_with_retries(key, offset, length, attempts, if_etag)
        except trio.TooSlowError:
            exc = BackendUnreachable(f"read {key!r}: no answer within {timeout_s:g} s")
            health.mark_down(str(exc))
            raise exc from None
        except BackendUnreachable as exc:
            health.mark_down(str(exc))
            raise
        health.mark_up()
        return data

    async def _read_with_retries(self, key: str, offset: int, length: int, attempts: int, if_etag: str | None) -> bytes:
        def note_retry(state: RetryCallState) -> None:
            assert state.outcome is not None
            self.read_retries += 1
            log.info("read_retry key=%s offset=%d error=%r retry_in_s=%.1f",
                     key, offset, str(state.outcome.exception()), _read_backoff_s(state))

        # One per read: tenacity keeps an async run's state on the object, and
        # every task of the trio thread would share one.
        retries = AsyncRetrying(
            stop=stop_after_attempt(attempts),
            wait=_read_wait_s,
            retry=retry_if_exception_type(TransientBackendError),
            before_sleep=note_retry,
            sleep=trio.sleep,
            reraise=True,  # the last error as it is, not a RetryError
        )
        async for attempt in retries:
            with attempt:
                return await self.backend.read_range(key, offset, length, if_etag=if_etag)
        raise AssertionError("unreachable")

    async def read_verified(self, backend_keys: list[str], index: int, key: bytes, length: int) -> bytes:
        """Chunk ``index`` from the first of ``backend_keys`` whose bytes hash to ``key``."""
        last: Exception | None = None
        for bkey in backend_keys:
            try:
                data = await self.read_range(bkey, index * CHUNK_BYTES, length)
                chunk.verify(data, key, f"{bkey} chunk {index}")
                self.bytes_fetched += len(data)
                return data
            except (IntegrityError, BackendNotFound) as exc:
                # Not corruption by itself: an object may hold another version of the file (the
                # previous one, read for a chunk the pool let go), or have moved.  Only when no copy
                # has the bytes does the caller get the error (and it is logged there).
                log.info("%s; trying the next copy", exc)
                last = exc
        if last is None:
            raise IntegrityError(f"chunk {index} has no copy in the backend (the file has no object there)")
        raise IntegrityError(str(last))
