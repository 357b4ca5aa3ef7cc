"""The read side's fetch of a chunk the pool does not hold.

A reader that misses in the pool (``StagingPool.read``, which merges
concurrent misses of one key into one call of this) walks the tiers here:
its grouped read round's chain predecessor, the DRAM of the nodes that hold
the version (``row.holders``, from the inode the reader already has: no
database round trip per chunk), then the backend, verified against the
chunk's BLAKE3.  The persister uses the same walk for chunks of an earlier
version it must upload again (``previous``).

Backend reads for a reader retry transient errors a few times within a
deadline (``read_range``): the backend layer itself never retries.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Protocol

import trio
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from .. import chunk
from .._errors import BackendNotFound, BackendUnreachable, IntegrityError, TransientBackendError
from .._limits import (
    BACKEND_CHECK_TIMEOUT_S,
    CHUNK_BYTES,
    PERSIST_BACKOFF_JITTER,
    READ_BACKEND_TIMEOUT_S,
    READ_RETRY_ATTEMPTS,
    READ_RETRY_FIRST_S,
)

if TYPE_CHECKING:
    from ..backend import Backend
    from ..cluster import ClusterPort
    from ..meta import MetaStore
    from ..persist import Persister
    from ._health import BackendHealth
    from ._inodes import InodeTable

log = logging.getLogger(__name__)


def _read_backoff_s(state: RetryCallState) -> float:
    """The backoff after try ``state.attempt_number``: READ_RETRY_FIRST_S, doubling."""
    return READ_RETRY_FIRST_S * 2 ** (state.attempt_number - 1)


def _read_wait_s(state: RetryCallState) -> float:
    return _read_backoff_s(state) * random.uniform(1.0 - PERSIST_BACKOFF_JITTER, 1.0)  # jittered like persist retries


class FetchHost(Protocol):
    """What the fetch needs of the filesystem: where chunks are, and the rows that say so."""

    meta: MetaStore
    backend: Backend
    cluster: ClusterPort
    health: BackendHealth
    inodes: InodeTable
    persister: Persister  # its ``ns_lock``: object moves and the keys recorded for them


class ChunkFetcher:
    """Chunks from peers or the backend, for readers and for the persister (see module doc)."""

    def __init__(self, fs: FetchHost):
        self.fs = fs
        self.bytes_fetched = 0  # read from the backend (status: persist.bytes_fetched)
        self.read_retries = 0  # backend reads retried for a reader

    async def chunk(self, ino: int, index: int, key: bytes, length: int, row=None) -> bytes:
        """A sealed chunk of inode ``ino`` (``row``: its row, if the caller has it)."""
        fs = self.fs
        data = await fs.cluster.round_fetch(ino, key)  # a grouped read: from our chain predecessor
        if data is not None:
            return data
        if row is None:
            node = fs.inodes.get(ino)
            row = node.row if node is not None else await fs.meta.get_inode(ino)
        data = await self._from_peers(row, key)  # the distributed cache: holders' DRAM before storage
        if data is not None:
            return data
        if not row.backend_keys:
            row = await fs.meta.get_inode(ino)  # the in-memory row may predate the first publish
            if not row.backend_keys:
                raise IntegrityError(f"chunk {index} of inode {ino} is in neither DRAM, spill nor the backend")
        try:
            return await self.read_verified(row.backend_keys, index, key, length)
        except IntegrityError:
            # A rename may be moving the object right now, to a name the file
            # may no longer have (renamed again, its directory renamed).  This
            # node moves objects and records their keys under the persister's
            # ns_lock: read under it, the recorded keys are where they are.
            # Another node's moves land at one of the current names.  Reads
            # are verified, so trying those names cannot return other bytes.
            async with fs.persister.ns_lock:
                latest = await fs.meta.get_inode(ino)
                paths = await fs.meta.paths_of(ino)
                return await self.read_verified(list(dict.fromkeys([*latest.backend_keys, *paths])), index, key, length)

    async def previous(self, row, index: int, key: bytes, length: int) -> bytes:
        """A chunk of ``row``'s version the pool no longer has: from a peer's pool or the previous backend version."""
        data = await self._from_peers(row, key)
        if data is not None:
            return data
        if not row.backend_keys:
            raise IntegrityError(f"chunk {index} of inode {row.ino} is in neither DRAM, spill nor the backend")
        return await self.read_verified(row.backend_keys, index, key, length)

    async def _from_peers(self, row, key: bytes) -> bytes | None:
        cluster = self.fs.cluster
        others = [h for h in row.holders if h != cluster.owner]
        return await cluster.fetch(key, others) if others else None

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
        health = self.fs.health
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
                return await self.fs.backend.read_range(key, offset, length, if_etag=if_etag)
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
