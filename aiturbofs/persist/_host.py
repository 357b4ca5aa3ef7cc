"""What the persister asks of the VFS above it, and the figures it keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..backend import Backend
from ..cluster import ClusterPort
from ..meta import InodeRow, MetaStore
from ..staging import BackingArea, BackingFile, StagingPool
from ..store import ChunkStore


class PersistOptions(Protocol):
    """The options the persister reads."""

    @property
    def persist_retry_window_s(self) -> float: ...

    @property
    def full_backend_wait_s(self) -> float: ...

    @property
    def persist_yield_s(self) -> float: ...


class PersistHost(Protocol):
    """The VFS as the persister sees it (``Filesystem`` implements it)."""

    meta: MetaStore
    backend: Backend
    pool: StagingPool
    staging: BackingArea
    cluster: ClusterPort
    store: ChunkStore  # chunks the pool no longer has, ``verify``'s reads, ``ns_lock``, the backend's health

    # read-only: the filesystem's own is a wider type than this
    @property
    def options(self) -> PersistOptions: ...

    def record_error(self, message: str, event: str | None = None) -> None:
        """An operating error, for the log and ``aiturbo status``."""

    def notify_state(self, ino: int) -> None:
        """``ino``'s state changed: wake whoever waits for it (``aiturbo wait``, fsync)."""

    async def on_persisted(self, ino: int, row: InodeRow) -> None:
        """``row.version`` is durable (or broken): release its pins."""

    def adopt_recovered(self, row: InodeRow, pinned: set[int], backings: list[BackingFile]) -> None:
        """After a restart: hold the recovered pins of a staged file."""

    def kernel_writing(self, ino: int) -> bool:
        """Whether the kernel may be writing the file right now (FUSE passthrough), or changes are taken in
        and not yet committed: a version of it that lost a chunk to such a write is replaced by the commit
        its next flush or release makes."""
        ...

    def writers_active(self) -> bool:
        """Is the application writing (a request that changes files came within PERSIST_YIELD_QUIET_S),
        with nobody waiting for a file to become durable (fsync, sync_close, ``aiturbo wait``)?  A queued
        file's persist then waits for a pause, up to ``persist_yield_s``."""
        ...

    def is_cached(self, ino: int) -> bool:
        """Does the kernel (or an open handle) still know ``ino``?  Its row must then stay."""

    def is_open(self, ino: int) -> bool:
        """Is ``ino`` open (a descriptor or mapping may still read it)?  An unlinked file's objects then stay."""
        ...

    def unlinked_keys(self) -> set[str]:
        """Backend keys of unlinked inodes still open or known to the kernel."""


@dataclass
class PersistStats:
    """The persister's counters (``aiturbo status``, the metrics)."""

    bytes_uploaded: int = 0
    bytes_copied: int = 0  # materialised by server-side copy (dedup), not sent
    bytes_uploaded_for_peers: int = 0  # parts of other nodes' uploads sent from here
    files_durable: int = 0
    attrs_persisted: int = 0  # chmod/chown/utime of durable inodes given to their objects (no data sent)
    files_broken: int = 0
    retries: int = 0
    verify_problems: int = 0  # objects ``aiturbo verify`` found missing, of another size, or with other chunks


def is_mine(cluster: ClusterPort, row) -> bool:
    """Is this node the one to persist ``row``?  (Always, on a single node.)"""
    me = cluster.owner
    return me is None or row.owner in (None, me)
