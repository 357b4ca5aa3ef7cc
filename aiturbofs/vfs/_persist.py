"""The persister: future 1.  Makes the backend match the namespace.

Each job is one inode, and the job *reconciles*: it compares what the
metadata engine says (current paths, committed version, state) with what the
backend holds (``backend_keys`` at ``persisted_version``) and does what is
missing — upload the committed version (multipart, chunks read from the pool,
the spill store or the previous backend object, each verified by BLAKE3),
move or copy after renames and hard links, delete after unlink — then loops
until nothing changed meanwhile.  That is why renaming or deleting a file
while it persists leaves no ghost objects and loses no rename.

Transient backend errors are retried with capped, jittered exponential
backoff for the retry window (a file becoming durable wakes the others
early: the backend answers again); then, or on a permanent error, the file
is marked ``broken``.
Operations on one backend key are serialised by a per-key lock, and a key is
only deleted if no live inode's path names it.
"""

import collections
import errno
import functools
import itertools
import logging
import os
import random
import secrets
import stat
import time
from contextlib import asynccontextmanager

import trio

from .. import chunk
from .._errors import (
    AiturboError,
    BackendError,
    IntegrityError,
    MetaUnavailable,
    NotFound,
    NotSupported,
    PeerBroken,
    PeerClosed,
    PeerSlow,
    RemoteError,
    TransientBackendError,
)
from .._limits import (
    CHUNK_BYTES,
    CLUSTER_SOURCE_POLL_S,
    CLUSTER_SOURCE_WAIT_S,
    DIRS_TO_CLEAN_MAX,
    PEER_UPLOAD_PART_TIMEOUT_S,
    PERSIST_BACKOFF_FIRST_S,
    PERSIST_BACKOFF_JITTER,
    PERSIST_BACKOFF_MAX_S,
    PERSIST_FILES_IN_FLIGHT,
    PERSIST_PARTS_IN_FLIGHT,
    PERSIST_PARTS_UNPOOLED_MAX,
    PERSIST_SPARE_FILES_MAX,
    PERSIST_WIDE_PARTS_IN_FLIGHT,
    RENAME_READDIR_BATCH_ENTRIES,
)
from .._nursery import open_nursery
from ..backend import NodeAttrs, ObjectInfo
from ..meta import ROOT_INO, STATE_BROKEN, STATE_DURABLE, STATE_PERSISTING, STATE_STAGED
from ..staging import content_key_of
from ._cluster import CopySource, PersistHints
from ._content import room

log = logging.getLogger(__name__)

DRAIN_LOG_PERIOD_S = 5.0
# How long a backend key removed or moved away is remembered, so that an
# import whose listing started before the removal does not bring it back.
VACATED_KEEP_S = 600.0
# A file whose backend name another file still has to move away from waits
# this long before it tries again (see ``_defer``).
DEFER_RETRY_S = 0.1
# Hidden name prefix of an object moved out of the way (see ``_defer``).
ASIDE_PREFIX = ".aiturbo-aside."
# A publish or move refused because a directory (or a file, in the path) is
# in the way: a renamed directory not yet emptied, or one not yet removed.
# That clears once the other files have moved, so the file waits (_defer).
_CONFLICT_ERRNOS = frozenset({errno.EISDIR, errno.ENOTEMPTY, errno.ENOTDIR, errno.EEXIST})


def _jittered(backoff_s: float) -> float:
    """How long a retry sleeps.  Jittered: every file an outage failed at once
    would otherwise retry in step, a burst of PERSIST_FILES_IN_FLIGHT uploads
    at each doubling and all of them together when the service comes back."""
    return backoff_s * random.uniform(1.0 - PERSIST_BACKOFF_JITTER, 1.0)


class _Deferred(Exception):
    """Another file must move its object away from our name first."""


class _PartPlan:
    """Cluster: how one upload's parts are made (see ``Persister._part_plan``)."""

    __slots__ = ("hints", "sources", "target", "wait_until", "token", "waiting")

    def __init__(self, hints: PersistHints, sources: dict[int, CopySource], target: str, wait_until: float):
        self.hints = hints
        self.sources = sources
        self.wait_until = wait_until
        self.target = target
        self.token: str | None = None  # lets other nodes write parts of this upload
        self.waiting = 0  # parts waiting for another file's durable copy

    @property
    def wait(self) -> set[int]:
        return self.hints.wait


class Persister:
    """Background reconciliation of inodes with the backend (see module doc)."""

    def __init__(self, fs):
        self.fs = fs
        self.meta = fs.meta
        self.backend = fs.backend
        self.pool = fs.pool
        self._pending: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._running: set[int] = set()
        self._rerun: set[int] = set()
        # Backend directories of removed directories, oldest first (see
        # enqueue_dir_cleanup); a path queued twice is cleaned once.
        self._dirs_to_clean: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._work = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._key_locks: dict[str, list] = {}
        self._vacated: dict[str, float] = {}  # backend key/dir -> monotonic time it went away
        # Held while backend objects are published, moved, deleted and their
        # keys recorded: every inode's backend_keys then match the backend
        # whenever another job looks (see _holder).  Uploads send their data
        # without it and take it only to publish.
        self.ns_lock = trio.Lock()
        # Queued inodes whose names changed (see enqueue) -> (live, backend_keys)
        # as last read, or a fresh ``object()`` until read; only the inode's
        # own job changes its keys, and a job start or a new enqueue forgets them.
        self._moved: dict[int, object] = {}
        self._defers: dict[int, int] = {}  # inode -> deferrals in a row (see _defer)
        self._trying: dict[int, int] = {}  # inode -> the version its running job uploads
        # Cluster: how the round plan splits an inode's upload, for one version.
        self._hints: dict[int, tuple[int, PersistHints]] = {}
        self._copy_warned = False
        self.bytes_copied = 0  # materialised by server-side copy (dedup), not sent
        self.bytes_uploaded_for_peers = 0  # parts of other nodes' uploads sent from here
        self.bytes_uploaded = 0
        self.files_durable = 0
        self.files_broken = 0
        self.retries = 0
        # Set (and replaced) whenever a file became durable: jobs sleeping in
        # backoff then retry at once instead of at the end of a sleep that may
        # have grown to PERSIST_BACKOFF_MAX_S while the backend was down.
        self._backend_answers = trio.Event()
        self._full_since: float | None = None  # the backend answers "full" (ENOSPC) since then
        # A chunk no longer in DRAM (spilled, or evicted after an earlier
        # version went durable) is read back into a buffer outside the pool's
        # budget when the pool is full of staged data: with every file and
        # part in flight doing that, the daemon could hold 16 such chunks
        # (128 MiB) beyond ``-o dram``.  This bounds them (see docs/memory.md).
        self._unpooled_parts = trio.Semaphore(PERSIST_PARTS_UNPOOLED_MAX)
        # Wide parts (files of more chunks than the backend has parts) are
        # assembled in a buffer of their own, outside the pool: bounded node-wide.
        self._wide_parts = trio.Semaphore(PERSIST_WIDE_PARTS_IN_FLIGHT)
        self._nursery: trio.Nursery | None = None
        self._files_waiting = 0  # files in flight whose parts wait for another file's copy
        self._spares = 0  # spare uploads running (see _waiting_for_source)

    # ------------------------------------------------------------------ queue
    def set_hints(self, ino: int, version: int, hints: PersistHints | None) -> None:
        """Remember how the round plan splits the upload of ``ino`` at ``version``."""
        if hints is None:
            self._hints.pop(ino, None)
        else:
            self._hints[ino] = (version, hints)

    def enqueue(self, ino: int, *, moved: bool = False) -> None:
        """Reconcile ``ino`` soon.  ``moved``: its names changed (rename, link,
        unlink), so its backend objects may sit at names it no longer has
        until this job moves or deletes them (see ``_holder``)."""
        if moved:
            self._moved[ino] = object()
        if ino in self._running:
            self._rerun.add(ino)
        else:
            self._pending[ino] = None
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake()

    async def enqueue_tree(self, dir_ino: int, old_path: str | None = None) -> None:
        """Reconcile every file below a renamed directory.

        ``old_path``: the directory's backend path before the rename.  Its
        backend directories are then removed where empty, deepest first (the
        ones still holding files go when the last file has moved out, see
        ``_prune_dirs``); an empty one left behind showed up again at import.
        """
        stack = [(dir_ino, old_path)]
        old_dirs = []
        while stack:
            ino, old = stack.pop()
            if old is not None:
                old_dirs.append(old)
            async for name, row in self.meta.children(ino, RENAME_READDIR_BATCH_ENTRIES):
                if row.state is not None:  # a file, or a node the backend keeps (a directory's marker too)
                    self.enqueue(row.ino, moved=True)
                if stat.S_ISDIR(row.mode):  # not a bit test: sockets and block devices share the bit
                    stack.append((row.ino, None if old is None else f"{old}/{os.fsdecode(name)}"))
        for old in reversed(old_dirs):  # children were found after their parents
            self.enqueue_dir_cleanup(old)

    def enqueue_dir_cleanup(self, path: str) -> None:
        """Remove the (now empty) backend directory of a removed directory.

        At most DIRS_TO_CLEAN_MAX wait (the backend may hang for a long
        outage while a job removes directories): beyond that a cleanup is
        dropped with a log line, which leaves an empty backend directory
        behind, as a failed removal does (the next import may show it again).
        """
        if path not in self._dirs_to_clean and len(self._dirs_to_clean) >= DIRS_TO_CLEAN_MAX:
            log.warning("backend directory %s left in place: %d directory removals already wait for the backend",
                        path, len(self._dirs_to_clean))
            return
        self._dirs_to_clean[path] = None
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake()

    def _wake(self) -> None:
        # Whoever signals replaces the event, so every waiter of this
        # generation wakes.  (Waiters replacing it themselves left the other
        # workers and the dir cleaner waiting on orphaned events: the cleaner
        # then never ran again and unmount's drain waited forever.)
        self._work.set()
        self._work = trio.Event()

    def queue_length(self) -> int:
        return len(self._pending) + len(self._running)

    def queued(self) -> list[int]:
        return list(self._running) + list(self._pending)

    def backend_answered(self) -> None:
        """A file got through, or the backend answers a probe: jobs sleeping in backoff retry now."""
        self._backend_answers.set()
        self._backend_answers = trio.Event()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(PERSIST_FILES_IN_FLIGHT):
                nursery.start_soon(self._worker)
            nursery.start_soon(self._dir_cleaner)
            task_status.started()

    async def _next(self) -> int:
        while not self._pending:
            if not self._running and not self._dirs_to_clean:
                self._idle.set()
            await self._work.wait()
        ino, _ = self._pending.popitem(last=False)
        return ino

    async def _worker(self) -> None:
        while True:
            await self._persist_one(await self._next())

    async def _spare_worker(self) -> None:
        """Persist queued files while files in flight wait for sources; then exit."""
        try:
            while self._pending and self._files_waiting > 0:
                ino, _ = self._pending.popitem(last=False)
                await self._persist_one(ino)
        finally:
            self._spares -= 1
            self._wake()

    def _waiting_for_source(self, parts: "_PartPlan", delta: int) -> None:
        """Count files whose upload only waits for another file's copy; start spares for the queue.

        A node persists PERSIST_FILES_IN_FLIGHT files at once.  When all of
        them wait for a chunk that a file still queued here will upload (a
        KV-cache prefix shared by many files of one node), nothing moved
        until the waits ran out; a spare upload takes the queued file.
        """
        before = parts.waiting
        parts.waiting += delta
        if (before == 0) != (parts.waiting == 0):
            self._files_waiting += 1 if parts.waiting else -1
        while (self._nursery is not None and self._pending and self._spares < self._files_waiting
               and self._spares < PERSIST_SPARE_FILES_MAX):
            self._spares += 1
            self._nursery.start_soon(self._spare_worker)

    async def _persist_one(self, ino: int) -> None:
        self._running.add(ino)
        if ino in self._moved:
            self._moved[ino] = object()
        try:
            await self._persist_with_retry(ino)
        except Exception as exc:  # a bug: keep persisting the other files
            log.exception("BUG while persisting inode %d", ino)
            self.fs.record_error(f"internal error persisting inode {ino}: {exc!r}")
        finally:
            self._running.discard(ino)
            self._trying.pop(ino, None)
            if ino in self._rerun:
                self._rerun.discard(ino)
                self._pending[ino] = None
            else:
                self._moved.pop(ino, None)  # reconciled: its objects are at its names
                self._defers.pop(ino, None)
                if ino not in self._pending:
                    self._hints.pop(ino, None)  # its version is done (durable, broken or gone)
            self._wake()

    async def _dir_cleaner(self) -> None:
        while True:
            while not self._dirs_to_clean:
                await self._work.wait()
            path = next(iter(self._dirs_to_clean))  # popped when done: drain waits for it
            try:
                async with self.ns_lock:
                    if not await self._is_dir_of_namespace(path):  # made again meanwhile: it is that one's now
                        await self.backend.remove_dir(path)
                        self._note_vacated(path)
            except BackendError as exc:
                log.info("backend directory %s not removed: %s", path, exc)
            self._dirs_to_clean.pop(path, None)
            self._wake()

    async def drain(self, timeout_s: float) -> list[int]:
        """Wait until the queue is empty; returns inodes still queued at the deadline."""
        started = time.monotonic()
        with trio.move_on_after(timeout_s):
            while not self._idle.is_set():
                with trio.move_on_after(DRAIN_LOG_PERIOD_S):
                    await self._idle.wait()
                if not self._idle.is_set():
                    log.info(
                        "drain_progress files=%d s=%.0f uploaded_bytes=%d",
                        self.queue_length(), time.monotonic() - started, self.bytes_uploaded,
                    )
        left = self.queued()
        # Trust the metadata, not only the queue: a file a bug dropped from the
        # queue is still staged there, and must not be reported durable.
        for row in await self.meta.inodes_in_states([STATE_STAGED, STATE_PERSISTING]):
            if row.nlink > 0 and row.ino not in left and self._mine(row):
                left.append(row.ino)
        return left

    def _mine(self, row) -> bool:
        """Is this node the one to persist ``row``?  (Always, on a single node.)"""
        cluster = self.fs.cluster
        return cluster is None or row.owner in (None, cluster.node)

    async def take_over(self, dead: set[str]) -> None:
        """Cluster: persist the staged files of dead nodes from the replicas here.

        The first live holder of a file claims it (a compare-and-set on its
        owner, so exactly one node does).  A file whose every holder is dead
        lost its last DRAM copy before it became durable: it is broken.
        """
        me = self.fs.cluster.node
        for row in await self.meta.inodes_in_states([STATE_STAGED, STATE_PERSISTING]):
            if row.owner is None or row.owner not in dead or row.nlink == 0:
                continue
            name = await self._name(row.ino)
            if not stat.S_ISREG(row.mode):
                # A node's row is all there is to it: any live node writes it
                # (the compare-and-set lets exactly one take it).
                if await self.meta.claim_owner(row.ino, row.version, row.owner, me):
                    log.warning("taken_over path=%s dead_owner=%s (a node: writing it from here)", name, row.owner)
                    self.enqueue(row.ino)
                continue
            live = [h for h in row.holders if h not in dead]
            if not live:
                if await self.meta.set_state(row.ino, STATE_BROKEN, if_version=row.version):
                    self._record_broken(name, f"every node holding it ({', '.join(row.holders)}) died before it was durable")
                    self.fs._notify_state(row.ino)
                continue
            if live[0] == me and await self.meta.claim_owner(row.ino, row.version, row.owner, me):
                log.warning("taken_over path=%s size=%d dead_owner=%s (persisting it from the replica here)", name, row.size, row.owner)
                self.enqueue(row.ino)

    # ------------------------------------------------------------- recovery
    async def recover(self) -> None:
        """After a restart: resume persists whose chunks survived in backing files or spill.

        A chunk counts as found where its bytes hash (BLAKE3) to the
        manifest: in the file's own backing file, the spill store, or (a
        chunk deduplicated into another file's range) another backing file
        the previous run left.
        """
        cluster = self.fs.cluster
        staging = self.fs.staging
        rows = []
        for row in await self.meta.inodes_in_states([STATE_STAGED, STATE_PERSISTING]):
            if not self._mine(row):
                continue  # another node's file (shared metadata)
            if not stat.S_ISREG(row.mode):
                self.enqueue(row.ino)  # a node: everything it needs is in its row
                continue
            rows.append(row)
        held: list[bytes] = []
        wanted = {}  # key -> length, of chunks in no row's own range
        for row in rows:
            backing = staging.existing(row.ino)
            for index, k in enumerate(chunk.unpack_manifest(row.manifest or b"")):
                if k == chunk.HOLE or self.pool.has(k) or k in self.pool.spill:
                    continue
                length = chunk.chunk_length(row.size, index)
                if backing is None or not await self._recover_range(backing, index, k, length, held):
                    wanted[k] = length
        for ino in sorted(staging.found - {row.ino for row in rows}):
            if not wanted:
                break
            await self._recover_from_orphan(staging.file(ino), wanted, held)
        for row in rows:
            keys = chunk.unpack_manifest(row.manifest or b"")
            present = [k for k in keys if k != chunk.HOLE]
            missing = [k for k in present if not self.pool.has(k) and k not in self.pool.spill]
            if cluster is not None and missing and any(h != cluster.node for h in row.holders):
                log.info("recovering ino=%d from=replicas chunks=%d", row.ino, len(missing))
                missing = []
            if missing and await self._recover_from_backend(row):
                continue
            if missing and not row.backend_keys:
                await self.meta.set_state(row.ino, STATE_BROKEN)
                self._record_broken(await self._name(row.ino), f"{len(missing)} of its {len(present)} chunk(s) "
                                    "were lost when the daemon stopped (not in its backing file, nor in spill)")
                continue
            pinned = set()
            for index, k in enumerate(keys):
                if k == chunk.HOLE:
                    continue
                if self.pool.has(k):
                    self.pool.pin(k)
                elif not self.pool.recover_spilled(k):
                    continue
                pinned.add(index)
            self.fs.adopt_recovered(row, pinned, staging.existing(row.ino))
            log.info("recovered ino=%d size=%d chunks=%d of %d (persisting it)", row.ino, row.size, len(pinned), len(present))
            self.enqueue(row.ino)
        for k in held:
            self.pool.hold(k, -1)
        for row in await self.meta.orphans():
            self.enqueue(row.ino, moved=True)
        for k in self.pool.spill.keys():
            if not self.pool.pinned(k):
                self.pool.spill.discard(k)
        staging.sweep()

    async def _recover_range(self, backing, index: int, key: bytes, length: int, held: list[bytes]) -> bool:
        """Take chunk ``index`` of a backing file the previous run left if it still holds ``key``."""
        rng = backing.range(index)
        if rng.entry is not None:
            return False
        try:
            found = await trio.to_thread.run_sync(content_key_of, backing.path, rng.offset, length)
        except OSError as exc:
            log.warning("recovery: cannot read %s: %s", backing.path, exc)
            return False
        if found != key or self.pool.has(key):
            return found == key
        charge = room(length, index)
        self.pool.count_recovered(charge)
        self.pool.adopt_range(key, rng, length, charge, pin=False)
        self.pool.hold(key, +1)  # until the rows that need it are pinned
        held.append(key)
        return True

    async def _recover_from_orphan(self, backing, wanted: dict, held: list[bytes]) -> None:
        """Look for ``wanted`` chunks in the backing file of a file removed before the crash."""
        lengths = set(wanted.values())
        for index in range(chunk.chunk_count(backing.size)):
            for length in lengths:
                try:
                    found = await trio.to_thread.run_sync(content_key_of, backing.path, index * CHUNK_BYTES, length)
                except OSError:
                    return
                if wanted.get(found) == length and await self._recover_range(backing, index, found, length, held):
                    del wanted[found]
                    break

    async def _recover_from_backend(self, row) -> bool:
        """Mark ``row`` durable if one of its names in the backend holds exactly
        its version: same size, and every chunk hashes (BLAKE3) to its
        manifest.  The host went down between the upload and the sync of the
        ``durable`` state: the bytes made it, so the file is not broken.
        """
        paths = await self.meta.paths_of(row.ino) if row.nlink > 0 else []
        for key in paths:
            try:
                info = await self._holds_version(key, row)
            except (BackendError, IntegrityError) as exc:
                log.info("recovery: %s not checked in the backend: %s", key, exc)
                continue
            if info is None:
                continue
            stale = [k for k in row.backend_keys if k not in paths]  # deleted by the reconcile below
            if not await self.meta.set_state(row.ino, STATE_DURABLE, if_version=row.version, backend_keys=[key, *stale],
                                             persisted_version=row.version, backend_etag=info.etag):
                return False
            log.warning("recovered ino=%d size=%d from=backend key=%s (uploaded before the daemon stopped)",
                        row.ino, row.size, key)
            self.enqueue(row.ino, moved=True)  # its other names, its stale objects
            return True
        return False

    async def _holds_version(self, key: str, row) -> ObjectInfo | None:
        """The object at ``key`` if its bytes are exactly ``row``'s version, else None."""
        info = await self.backend.stat(key)
        if info is None or info.is_dir or info.size != row.size:
            return None
        keys = chunk.unpack_manifest(row.manifest or b"")
        for index in range(chunk.chunk_count(row.size)):
            data = await self.fs.fetcher.read_range(key, index * CHUNK_BYTES, chunk.chunk_length(row.size, index))
            if index >= len(keys) or await trio.to_thread.run_sync(chunk.content_key, data) != keys[index]:
                return None
        return info

    # ------------------------------------------------------------ one job
    async def _persist_with_retry(self, ino: int) -> None:
        deadline = time.monotonic() + self.fs.options.persist_retry_window_s
        backoff = PERSIST_BACKOFF_FIRST_S
        while True:
            try:
                await self._reconcile(ino)
                return
            except NotFound:
                return  # the inode is gone: nothing left to persist
            except TransientBackendError as exc:
                self._note_full(exc)
                if time.monotonic() + backoff > deadline:
                    await self._mark_broken(ino, f"backend unavailable for the whole retry window: {exc}")
                    return
                self.retries += 1
                sleep_s = _jittered(backoff)
                log.warning("persist_retry path=%s error=%r retry_in_s=%.1f", await self._name(ino), str(exc), sleep_s)
                with trio.move_on_after(sleep_s):
                    await self._backend_answers.wait()  # another file got through: so may this one
                backoff = min(backoff * 2, PERSIST_BACKOFF_MAX_S)
            except MetaUnavailable as exc:
                # Not the file's fault, and recording 'broken' needs the metadata
                # too: wait for the engine however long it takes (no deadline).
                self.retries += 1
                sleep_s = _jittered(backoff)
                log.warning("persist_retry ino=%d error=%r retry_in_s=%.1f (metadata engine)", ino, str(exc), sleep_s)
                await trio.sleep(sleep_s)
                backoff = min(backoff * 2, PERSIST_BACKOFF_MAX_S)
            except (BackendError, IntegrityError) as exc:
                await self._mark_broken(ino, str(exc))
                return

    def _note_full(self, exc: TransientBackendError) -> None:
        """A backend that keeps saying it is full reaches writers as ENOSPC.

        A full cache only makes writers wait; a full backend would make them
        wait for as long as it stays full (hours: the retry window), in D
        state.  After ``full_backend_wait_s`` of "full" answers with no file
        getting through, writers that need memory get ENOSPC; staged data
        keeps retrying, and the first file that becomes durable lifts it.
        """
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return
        now = time.monotonic()
        if self._full_since is None:
            self._full_since = now
            log.warning("the backend is full (%s): staged files retry; writers get ENOSPC after %.0f s of this",
                        exc, self.fs.options.full_backend_wait_s)
        if now - self._full_since >= self.fs.options.full_backend_wait_s:
            self.pool.refuse_waits(f"the backend has been full for {now - self._full_since:.0f} s: {exc}")

    def backend_full_s(self) -> float | None:
        """For how long the backend has answered "full" (None: it has not)."""
        return None if self._full_since is None else time.monotonic() - self._full_since

    async def _name(self, ino: int) -> str:
        """A path of ``ino`` for a log line (``inode N`` when it has none)."""
        try:
            paths = await self.meta.paths_of(ino)
        except AiturboError:
            paths = []
        return paths[0] if paths else f"inode {ino}"

    def _record_broken(self, name: str, why: str) -> None:
        """The error ``aiturbo status`` shows and its ``broken path= reason=`` log line."""
        self.fs.record_error(f"{name} is broken: {why}", event=f"broken path={name} reason={why!r}")

    async def _mark_broken(self, ino: int, why: str) -> None:
        """Mark the version whose upload failed broken; a newer one is persisted instead.

        A commit may land between the failure and this (every await here is
        a chance): marking the inode's current version would break and
        unpin a good version that was never tried.
        """
        failed = self._trying.get(ino)
        try:
            row = await self.meta.get_inode(ino)
        except NotFound:
            return  # removed meanwhile: nothing left to mark
        name = await self._name(ino)
        if failed is None:
            failed = row.version
        if row.version != failed or not await self.meta.set_state(ino, STATE_BROKEN, if_version=failed):
            log.info("persist of %s version %d failed (%s); version %d was committed since: persisting that",
                     name, failed, why, (await self.meta.get_inode(ino)).version)
            self.enqueue(ino)  # reruns after this job
            return
        self.files_broken += 1
        self._record_broken(name, why)
        row = await self.meta.get_inode(ino)
        await self.fs.on_persisted(ino, row)

    async def _reconcile(self, ino: int) -> None:
        while True:
            row = await self.meta.get_inode(ino)
            paths = await self.meta.paths_of(ino) if row.nlink > 0 else []
            if not paths:
                await self._delete_all(row)
                return
            if row.state is None:
                return  # a node the backend does not keep: nothing there
            if row.state == STATE_BROKEN:
                return
            if not stat.S_ISREG(row.mode):
                if not await self._publish_node(row.ino):
                    await self._defer(row, paths)
                return
            if row.state != STATE_DURABLE or row.persisted_version != row.version:
                if not self._mine(row):
                    return  # its owner uploads it (and then reconciles the names it finds)
                self._trying[ino] = row.version  # what _mark_broken marks if this fails for good
                try:
                    uploaded = await self._upload_version(row, paths)
                except (BackendError, IntegrityError):
                    if (await self.meta.get_inode(ino)).version != row.version:
                        # Superseded meanwhile (truncated or rewritten: the old
                        # version's chunks may be gone): upload the new version
                        # rather than mark it broken for the old one's failure.
                        continue
                    raise
                if not uploaded:
                    await self._defer(row, paths)
                    return
                continue
            if sorted(row.backend_keys) != sorted(paths):
                if not await self._relocate(row, paths):
                    await self._defer(row, paths)
                    return
                continue
            return

    async def _publish_node(self, ino: int) -> bool:
        """A symlink, directory or special file: write its backend form at each
        of its names and remove it from the names it no longer has (there is
        no data to move: writing it again is cheaper than a copy).  False if
        another file must move its object away from one of our names first.
        """
        async with self.ns_lock:
            row = await self.meta.get_inode(ino)
            paths = await self.meta.paths_of(ino) if row.nlink > 0 else []
            if not paths or row.state is None or row.state == STATE_BROKEN:
                return True  # the reconcile loop deletes it, or there is nothing to do
            current = row.state == STATE_DURABLE and row.persisted_version == row.version
            if current and sorted(row.backend_keys) == sorted(paths):
                return True
            if stat.S_IFMT(row.mode) not in self.backend.node_kinds:
                # Made when another backend was mounted on this metadata.
                log.info("node_metadata_only path=%s mode=%o (%s cannot hold it)", paths[0], row.mode, self.backend.url)
                await self.meta.set_attrs(ino, state=None)
                return True
            if row.state != STATE_PERSISTING and await self.meta.set_state(ino, STATE_PERSISTING, if_version=row.version):
                self.fs._notify_state(ino)
            is_dir = stat.S_ISDIR(row.mode)
            node = NodeAttrs(row.mode, row.uid, row.gid, row.mtime_ns, row.rdev, row.target)
            done = [k for k in paths if current and k in row.backend_keys]
            for dst in paths:
                if dst in done:
                    continue
                # A directory shares its name with the objects below it: only
                # an object at its key or above it is in its way.
                placed = await self._free_for(dst, ino, below=not is_dir)
                if placed:
                    async with self._key_lock(dst):
                        placed = await self._place(self.backend.write_node, dst, dst, node)
                if not placed:
                    # Where our forms are so far: the stale ones go once we may write.
                    await self.meta.set_attrs(ino, backend_keys=sorted(set(row.backend_keys) | set(done)))
                    return False
                done.append(dst)
            for stale in row.backend_keys:
                if stale not in done:
                    if is_dir:
                        await self._remove_dir_key(stale)
                    else:
                        await self._delete_key(stale, ino)
            await self.meta.set_state(ino, STATE_DURABLE, if_version=row.version, backend_keys=done,
                                      persisted_version=row.version, sync=False)
        await self.meta.sync()  # outside ns_lock: nodes in flight share the fsync
        self.backend_answered()
        log.info("persisted_node path=%s mode=%o", ",".join(done), row.mode)
        await self.fs.on_persisted(ino, await self.meta.get_inode(ino))
        return True

    async def _remove_dir_key(self, key: str) -> None:
        """A directory moved away from ``key``: its backend directory (marker)
        goes where empty, and so do the emptied ones above it.  With ``ns_lock``."""
        if await self._is_dir_of_namespace(key):
            return  # another directory has that name now
        try:
            await self.backend.remove_dir(key)  # does nothing unless empty: files still moving out
        except BackendError as exc:
            log.info("backend directory %s not removed: %s", key, exc)
            return
        self._note_vacated(key)
        await self._prune_dirs(key)

    async def _is_dir_of_namespace(self, key: str) -> bool:
        row = await self._lookup_path(key)
        return row is not None and stat.S_ISDIR(row.mode)

    async def _holder(self, key: str, ino: int, *, below: bool = True) -> int | None:
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
        for other in list(self._moved):
            if other == ino:
                continue
            holds, keys = await self._moved_keys(other)
            # also objects below ``key`` (a backend directory still in use
            # there) or at a directory above it (a file where one is needed)
            if holds and any(k == key or (below and k.startswith(key + "/")) or k in above for k in keys):
                return other
        return None

    async def _place(self, op, key: str, *args) -> bool:
        """Run ``op(*args)`` that writes ``key`` (publish, move, copy); False if
        something is in the way there (see _CONFLICT_ERRNOS).  An empty
        directory left at ``key`` is removed and the write tried again."""
        for attempt in range(2):
            try:
                await op(*args)
                return True
            except BackendError as exc:
                if exc.errno not in _CONFLICT_ERRNOS or isinstance(exc, TransientBackendError):
                    raise
                log.info("%s is in the way (%s); waiting for it to go", key, exc)
                if attempt == 0:
                    try:
                        await self.backend.remove_dir(key)  # does nothing unless an empty directory
                    except BackendError:
                        return False
        return False

    async def _moved_keys(self, ino: int) -> tuple[bool, list[str]]:
        """(holds its keys: linked, not broken, not a directory; backend keys) of a moved inode, cached.

        A directory's old form is no file's only copy: names below it may be
        written or deleted, and a file at its very key meets it as a conflict
        (``_place``).
        """
        marker = self._moved.get(ino)
        if isinstance(marker, tuple):
            return marker
        try:
            row = await self.meta.get_inode(ino)
            holds = row.nlink > 0 and row.state != STATE_BROKEN and not stat.S_ISDIR(row.mode)
            known = (holds, list(row.backend_keys))
        except NotFound:
            known = (False, [])
        if ino in self._moved and self._moved[ino] is marker and ino not in self._running:
            self._moved[ino] = known  # not while its job runs: it may change them
        return known

    async def _defer(self, row, paths: list[str]) -> None:
        """Let the holder of one of our names move its object first.

        Our own objects at names another file lives at now are moved aside to
        hidden keys first: when files swap names (a cycle: a->tmp, b->a,
        tmp->b, or RENAME_EXCHANGE) each holds the other's target, and one
        of them has to give way.
        """
        async with self.ns_lock:
            keys = list((await self.meta.get_inode(row.ino)).backend_keys)
            paths = await self.meta.paths_of(row.ino)
            for i, key in enumerate(keys):
                if key in paths or not await self._path_alive(key) or await self._holder(key, row.ino) is not None:
                    continue
                if stat.S_ISDIR(row.mode):
                    continue  # a directory's old form holds other files' objects: it goes once they moved
                head, _, _ = key.rpartition("/")
                aside = f"{head}/" if head else ""
                aside += f"{ASIDE_PREFIX}{secrets.token_hex(8)}"
                # Both names stay locked until the keys are recorded: an import
                # listing meanwhile must not take the hidden name for a new file.
                async with self._key_lock(key), self._key_lock(aside):
                    await self._forget_sources(key)
                    await self.backend.move(key, aside)
                    keys[i] = aside
                    await self.meta.set_attrs(row.ino, backend_keys=keys)
                log.info("moved %s aside to %s: another file takes that name first", key, aside)
        waits = self._defers[row.ino] = self._defers.get(row.ino, 0) + 1
        if waits % 50 == 0:
            log.warning("inode %d has waited %d times for other files to move out of its backend names", row.ino, waits)
        await trio.sleep(min(DEFER_RETRY_S * (1 << min(waits // 20, 6)), PERSIST_BACKOFF_MAX_S))
        self.enqueue(row.ino)  # runs again after this job ends

    async def _upload_version(self, row, paths: list[str]) -> bool:
        """Upload the committed version; False if another file must move first."""
        started = time.monotonic()
        if row.state != STATE_PERSISTING:
            # Not synced: the durable state's sync covers it.  A power cut
            # before that leaves the backend object, if published, newer than
            # the row; the import then takes it as changed outside the mount
            # (its etag is not the row's), so the file reads as that version.
            if not await self.meta.set_state(row.ino, STATE_PERSISTING, if_version=row.version, sync=False):
                return True
            self.fs._notify_state(row.ino)
        if await self._held(paths, row.ino):
            return False  # before sending any data
        target = paths[0]
        try:
            upload = await self._upload(row, target)
        except BackendError as exc:
            if exc.errno not in _CONFLICT_ERRNOS or isinstance(exc, TransientBackendError):
                raise
            log.info("%s: something is in the way (%s); waiting for it to go", target, exc)
            return False
        try:
            async with self.ns_lock:
                # The names may have changed while the data went out: publish
                # only where no other file lives or still keeps its object; a
                # target that is no longer ours is then moved like any rename.
                if not await self._free_for(target, row.ino):
                    raise _Deferred
                published: list[ObjectInfo] = []
                await self._forget_sources(target)  # the object there is replaced
                async with self._key_lock(target):
                    if not await self._place(lambda: self._complete(upload, row.size, published), target):
                        raise _Deferred
                info = published[0]
                done = [target]
                for extra in await self.meta.paths_of(row.ino):
                    if extra not in done and await self._free_for(extra, row.ino):
                        async with self._key_lock(extra):
                            if await self._place(self.backend.copy, extra, target, extra):
                                done.append(extra)
                for stale in row.backend_keys:
                    if stale not in done:
                        await self._delete_key(stale, row.ino)
                # Synced below, once the lock is free: files in flight share
                # one fsync instead of taking turns at it under ns_lock.
                durable = await self.meta.set_state(
                    row.ino, STATE_DURABLE, if_version=row.version, sync=False,
                    backend_keys=done, persisted_version=row.version, backend_etag=info.etag,
                )
                if not durable:
                    # A newer version was committed meanwhile: it is not durable,
                    # but where this one's objects are must still be known (the
                    # stale ones are gone; an unrecorded one came back at import).
                    await self.meta.set_attrs(
                        row.ino, backend_keys=done, persisted_version=row.version, backend_etag=info.etag
                    )
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                try:
                    await upload.abort()  # a no-op once complete() published
                except AiturboError as abort_exc:
                    log.warning("abort of upload to %s failed: %s", paths[0], abort_exc)
            if isinstance(exc, _Deferred):
                return False
            raise
        if durable:
            await self.meta.sync()
            await self._record_sources(row, target, info.etag)
            self.files_durable += 1
            self.backend_answered()
            self.fs.health.mark_up()
            self._full_since = None
            self.pool.accept_waits()
            log.info("persisted path=%s size=%d s=%.2f version=%d", paths[0], row.size, time.monotonic() - started,
                     row.version)
            await self.fs.on_persisted(row.ino, await self.meta.get_inode(row.ino))
        return True

    @staticmethod
    async def _complete(upload, size: int, out: list) -> None:
        out.append(await upload.complete(size))

    async def _free_for(self, key: str, ino: int, *, below: bool = True) -> bool:
        """With ``ns_lock`` held: may ``ino`` write its object at ``key``?  (``below``: see _holder)"""
        owner = await self._lookup_path(key)
        if owner is not None and owner.ino != ino:
            return False  # another file or a directory has that name now
        return await self._holder(key, ino, below=below) is None

    async def _held(self, keys: list[str], ino: int) -> bool:
        for key in keys:
            if await self._holder(key, ino) is not None:
                return True
        return False

    async def _upload(self, row, key: str):
        keys = chunk.unpack_manifest(row.manifest or b"")
        n = chunk.chunk_count(row.size)
        wide = self._chunks_per_part(n)
        if wide > 1:
            return await self._upload_wide(row, key, keys[:n], wide)
        parts = await self._part_plan(row, key, keys[:n])
        upload = await self.backend.open_upload(key)
        order, senders = self._part_order(n, parts)
        # PERSIST_PARTS_IN_FLIGHT per node that sends parts: each node's storage
        # link is busy, not four parts queued on one link while the others idle.
        limiter = trio.Semaphore(PERSIST_PARTS_IN_FLIGHT * senders)
        async with self._aborted_on_error(upload):
            async with open_nursery() as nursery:  # an outage failing every part is one error (one_error)
                for index in order:
                    await limiter.acquire()
                    nursery.start_soon(self._upload_part, upload, row, keys[index], index, limiter, parts)
        return upload  # every part sent; the caller publishes it (complete) or aborts

    @asynccontextmanager
    async def _aborted_on_error(self, upload):
        """Abort ``upload`` (shielded) if the block raises; the error goes on."""
        try:
            yield
        except BaseException:
            with trio.CancelScope(shield=True):
                try:
                    await upload.abort()
                except AiturboError as exc:
                    log.warning("abort of upload to %s failed: %s", upload.key, exc)
            raise

    def _chunks_per_part(self, chunks: int) -> int:
        """Chunks per upload part: 1, or more where the backend has fewer parts than the file chunks."""
        parts_max = getattr(self.backend, "parts_max", None)
        if parts_max is None or chunks <= parts_max:
            return 1
        return -(-chunks // parts_max)

    async def _upload_wide(self, row, key: str, keys: list[bytes], wide: int):
        """Upload a file of more chunks than the backend allows parts, ``wide`` chunks a part.

        S3 takes at most 10,000 parts: with one 8 MiB chunk a part an object
        ends at ~78 GiB, while S3 holds 5 TiB.  Each part's chunks are copied
        into one buffer (PERSIST_WIDE_PARTS_IN_FLIGHT of them node-wide) and
        sent as one part.  Such files get no server-side copies (dedup) nor
        parts sent by other nodes: those work chunk by chunk.
        """
        part_bytes = wide * CHUNK_BYTES
        count = -(-row.size // part_bytes)
        log.info("upload of %s: %d chunks exceed the backend's %d parts; sending %d parts of %d MiB",
                 key, len(keys), self.backend.parts_max, count, part_bytes // (1 << 20))
        upload = await self.backend.open_upload(key, part_bytes=part_bytes)
        async with self._aborted_on_error(upload):
            async with open_nursery() as nursery:
                for index in range(count):
                    await self._wide_parts.acquire()
                    nursery.start_soon(self._upload_wide_part, upload, row, keys, index, wide)
        return upload

    async def _upload_wide_part(self, upload, row, keys: list[bytes], index: int, wide: int) -> None:
        try:
            first = index * wide
            length = min(upload.part_bytes, row.size - first * CHUNK_BYTES)
            if all(k == chunk.HOLE for k in keys[first:first + wide]):
                sent, copied = await upload.zero_part(index, length)  # a hole: nothing to assemble
                self.bytes_uploaded += sent
                self.bytes_copied += copied
                return
            buf = bytearray(length)
            for i in range(first, min(first + wide, len(keys))):
                key = keys[i]
                if key == chunk.HOLE:
                    continue  # zeros already
                n = chunk.chunk_length(row.size, i)
                at = (i - first) * CHUNK_BYTES
                fetch = functools.partial(self.fs.fetcher.previous, row, i, key, n)
                async with self._part_memory(key), self.pool.lease(key, fetch) as view:
                    buf[at:at + n] = view
            await upload.write_part(index, buf)
            self.bytes_uploaded += len(buf)
        finally:
            self._wide_parts.release()

    @staticmethod
    def _part_order(n: int, parts: "_PartPlan | None") -> tuple[list[int], int]:
        """The order to start an upload's parts in, and how many nodes send them.

        The plan gives runs of consecutive parts to one node; started in index
        order, the parts in flight all went to that node's storage link (rank-0
        writer on the testbed: 3.6x the LP bound).  Parts are interleaved across
        the sending nodes instead.  Parts whose bytes another file of the round
        uploads go last: waiting for them must not hold the slots the others need.
        """
        if parts is None:
            return list(range(n)), 1
        queues: dict[str | None, list[int]] = {}
        for i in range(n):
            if i not in parts.wait:
                queues.setdefault(parts.hints.persist.get(i), []).append(i)
        order = []
        for batch in itertools.zip_longest(*queues.values()):
            order += [i for i in batch if i is not None]
        order += sorted(parts.wait)
        return order, max(1, len(queues))

    async def _upload_part(self, upload, row, key: bytes, index: int, limiter, parts: "_PartPlan | None") -> None:
        try:
            length = chunk.chunk_length(row.size, index)
            if key == chunk.HOLE:  # no bytes to read: the backend keeps a hole (or copies zeros)
                sent, copied = await upload.zero_part(index, length)
                self.bytes_uploaded += sent
                self.bytes_copied += copied
                return
            if parts is not None:
                if await self._copy_part(upload, parts, index, key, length):
                    return
                if await self._remote_part(upload, row, parts, index, key, length):
                    return
            lease = self.pool.lease(key, lambda: self.fs.fetcher.previous(row, index, key, length))
            async with self._part_memory(key), lease as view:
                await upload.write_part(index, view)
            self.bytes_uploaded += length
        finally:
            limiter.release()

    @asynccontextmanager
    async def _part_memory(self, key: bytes):
        """Hold one of PERSIST_PARTS_UNPOOLED_MAX slots if ``key`` must be read back into memory."""
        if self.pool.has(key):
            yield  # in DRAM: uploaded from the pool's own memory
            return
        async with self._unpooled_parts:
            yield

    # ------------------------------------------------------- cluster uploads
    async def _part_plan(self, row, target: str, keys: list[bytes]) -> "_PartPlan | None":
        """Cluster: which parts are copied server-side, waited for, or sent by other nodes."""
        if self.fs.cluster is None:
            return None
        found = self._hints.get(row.ino)
        hints = found[1] if found is not None and found[0] == row.version else PersistHints()
        wanted = [k for k in dict.fromkeys(keys) if k != chunk.HOLE]
        known = await self.meta.chunk_sources(wanted) if wanted else {}
        sources = dict(hints.copy)
        for index, k in enumerate(keys):
            src = known.get(k)
            if index not in sources and src is not None and src.backend_key != target:
                sources[index] = CopySource(src.backend_key, src.offset, src.length, src.etag)
        return _PartPlan(hints, sources, target, time.monotonic() + CLUSTER_SOURCE_WAIT_S)

    async def _copy_part(self, upload, parts: "_PartPlan", index: int, key: bytes, length: int) -> bool:
        """Dedup: materialise the part from a durable copy of its chunk; False to send bytes."""
        src = parts.sources.get(index)
        if src is None and index in parts.wait:
            self._waiting_for_source(parts, +1)
            try:
                src = await self._wait_source(key, parts.wait_until)
            finally:
                self._waiting_for_source(parts, -1)
        if src is None or src.length != length:
            return False
        if not self.backend.supports_server_copy:
            if not self._copy_warned:
                self._copy_warned = True
                log.warning("backend %s cannot copy server-side: duplicate chunks are uploaded again", self.backend.url)
            return False
        try:
            await upload.copy_part(index, src.backend_key, src.offset, length, if_etag=src.etag)
        except TransientBackendError:
            raise
        except BackendError as exc:  # changed or gone since it was recorded
            log.info("server-side copy of %s part %d from %s failed (%s); sending the bytes", parts.target, index, src.backend_key, exc)
            return False
        self.bytes_copied += length
        return True

    async def _wait_source(self, key: bytes, until: float) -> CopySource | None:
        """The durable copy another file of the round is making of ``key``, or None in time."""
        while True:
            src = (await self.meta.chunk_sources([key])).get(key)
            if src is not None:
                return CopySource(src.backend_key, src.offset, src.length, src.etag)
            if time.monotonic() >= until:
                log.info("chunk %s… not durable elsewhere in time; sending its bytes", key.hex()[:16])
                return None
            await trio.sleep(CLUSTER_SOURCE_POLL_S)

    async def _remote_part(self, upload, row, parts: "_PartPlan", index: int, key: bytes, length: int) -> bool:
        """The plan gives this part to another node: it sends the bytes; False to send them here."""
        cluster = self.fs.cluster
        node = parts.hints.persist.get(index)
        if node is None or node == cluster.node or not getattr(self.backend, "supports_remote_parts", False):
            return False
        try:
            if parts.token is None:
                parts.token = await upload.token()
            receipt = await cluster.upload_part(node, parts.target, parts.token, index, key, length, row.holders)
        except TransientBackendError:
            raise
        except (PeerBroken, PeerSlow, PeerClosed, RemoteError, NotSupported, BackendError) as exc:
            log.warning("node %r did not upload part %d of %s (%s); sending it from here", node, index, parts.target, exc)
            return False
        upload.add_remote_part(index, length, receipt)
        return True

    async def upload_for_peer(self, backend_key: str, token: str, index: int, key: bytes, length: int, holders: list[str]) -> str:
        """Another node's plan gives us part ``index`` of its upload: send it from our pool."""
        async def fetch() -> bytes:
            data = await self.fs.cluster.fetch(key, holders) if holders else None
            if data is None:
                raise IntegrityError(f"chunk {key.hex()[:16]}… for part {index} of {backend_key} is on no holder")
            return data

        # Bounded here, so that no part write of ours lands after the owner
        # stopped waiting (it waits PEER_UPLOAD_PART_TIMEOUT_S and a margin).
        with trio.move_on_after(PEER_UPLOAD_PART_TIMEOUT_S) as scope:
            async with self.pool.lease(key, fetch) as view:
                if len(view) != length:
                    raise IntegrityError(f"chunk {key.hex()[:16]}… has {len(view)} bytes, the part needs {length}")
                receipt = await self.backend.write_remote_part(backend_key, token, index, view)
        if scope.cancelled_caught:
            raise TransientBackendError(f"part {index} of {backend_key}: not sent within {PEER_UPLOAD_PART_TIMEOUT_S:.0f} s")
        self.bytes_uploaded += length
        self.bytes_uploaded_for_peers += length
        return receipt

    async def _record_sources(self, row, key: str, etag: str | None) -> None:
        """Cluster: chunks of a durable object can be copied from it (dedup later)."""
        if self.fs.cluster is None or row.manifest is None:
            return
        keys = chunk.unpack_manifest(row.manifest)
        entries = [
            (k, i * CHUNK_BYTES, chunk.chunk_length(row.size, i))
            for i, k in enumerate(keys[: chunk.chunk_count(row.size)]) if k != chunk.HOLE
        ]
        await self.meta.record_chunk_sources(key, etag, entries)

    async def _forget_sources(self, key: str) -> None:
        """Before the object at ``key`` changes: its chunks are no dedup source any more.

        (Copies are also conditional on the source's etag, so a source
        forgotten too late costs a fallback upload, never wrong bytes.)
        """
        if self.fs.cluster is not None:
            await self.meta.forget_chunk_sources(key)

    async def _relocate(self, row, paths: list[str]) -> bool:
        """Renamed or linked: move/copy the durable object, no re-upload.

        False (nothing done) if another file must move its object away from
        one of our names first.
        """
        src = row.backend_keys[0] if row.backend_keys else None
        if src is None:
            await self.meta.set_state(row.ino, STATE_STAGED, if_version=row.version)
            return True
        async with self.ns_lock:
            # Decide on what holds now: renames do not wait for this lock.
            row = await self.meta.get_inode(row.ino)
            paths = await self.meta.paths_of(row.ino) if row.nlink > 0 else []
            if (
                not paths or not row.backend_keys or sorted(row.backend_keys) == sorted(paths)
                or row.state != STATE_DURABLE or row.persisted_version != row.version
            ):
                return True  # changed meanwhile (e.g. a new version to upload): the reconcile loop looks again
            src = row.backend_keys[0]
            if await self._held([dst for dst in paths if dst not in row.backend_keys], row.ino):
                return False
            keep = [k for k in row.backend_keys if k in paths]
            current = list(row.backend_keys)  # where our objects are, as we go
            for dst in paths:
                if dst in row.backend_keys:
                    continue
                async with self._key_lock(dst):
                    if keep:
                        placed = await self._place(self.backend.copy, dst, keep[0], dst)
                        if placed:
                            current.append(dst)
                    else:
                        await self._forget_sources(src)
                        placed = await self._place(self.backend.move, dst, src, dst)
                        if placed:
                            current[current.index(src)] = dst
                            keep = [dst]
                if not placed:
                    if current != row.backend_keys:
                        await self.meta.set_attrs(row.ino, backend_keys=current)
                    return False
            for stale in row.backend_keys:
                if stale not in paths:
                    await self._delete_key(stale, row.ino)
            # Recorded whatever the version: the objects did move.  (Only under
            # if_version, a commit racing with the move left backend_keys naming
            # a key that no longer exists, and the next upload could not fetch
            # unchanged chunks from it.)
            fields = {}
            if len(paths) == 1:  # a copy has a new etag: not a change made outside the mount
                info = await self.backend.stat(paths[0])
                fields["backend_etag"] = info.etag if info is not None else row.backend_etag
            await self.meta.set_attrs(row.ino, backend_keys=paths, **fields)
            await self.meta.set_state(row.ino, STATE_DURABLE, if_version=row.version)
        log.info("moved_in_backend from=%s to=%s", ",".join(row.backend_keys), ",".join(paths))
        return True

    async def _delete_all(self, row) -> None:
        async with self.ns_lock:
            for key in row.backend_keys:
                await self._delete_key(key, row.ino)
            if self.fs._cached(row.ino) is None:
                await self.meta.delete_inode(row.ino)
            else:
                await self.meta.set_state(row.ino, row.state, backend_keys=[])

    async def _delete_key(self, key: str, ino: int) -> None:
        """Delete ``ino``'s stale object at ``key`` unless it is another file's now.

        Called with ``ns_lock`` held.
        """
        async with self._key_lock(key):
            owner = await self._lookup_path(key)
            if owner is not None and owner.state is not None and key in owner.backend_keys:
                return  # the file that has this name now put its own object there
            if await self._holder(key, ino) is not None:
                return  # another file's object, about to be moved from here (renamed again)
            # Otherwise the object is stale even if a file has the name now: that
            # file has not written it yet (it does so under this lock, later),
            # and it may be renamed away first, which left the object orphaned
            # for an import to bring back as a deleted file.
            await self._forget_sources(key)
            await self.backend.delete(key)
            self._note_vacated(key)
        await self._prune_dirs(key)

    def _note_vacated(self, key: str) -> None:
        now = time.monotonic()
        self._vacated.pop(key, None)
        self._vacated[key] = now  # insertion order is time order: old ones go from the front
        while self._vacated:
            oldest, when = next(iter(self._vacated.items()))
            if when >= now - VACATED_KEEP_S:
                break
            del self._vacated[oldest]

    async def _prune_dirs(self, key: str) -> None:
        """Remove the backend directories above ``key`` that the namespace no
        longer has, deepest first, where they are now empty.

        They are the old names of renamed or removed directories: the
        directory's own rmdir cleanup may have run before its files were
        moved or deleted, and an import would show them again as ghosts.
        """
        parent = key.rpartition("/")[0]
        while parent:
            row = await self._lookup_path(parent)
            if row is not None and stat.S_ISDIR(row.mode):
                return  # still a directory of the namespace (and so are its ancestors)
            try:
                await self.backend.remove_dir(parent)  # does nothing unless empty
            except BackendError as exc:
                log.info("backend directory %s not removed: %s", parent, exc)
                return
            self._note_vacated(parent)
            parent = parent.rpartition("/")[0]

    async def claimed_keys(self, since: float) -> set[str]:
        """Backend keys the importer must not bring back as new names.

        These are the keys of inodes queued here after a name change (the
        object is about to be moved or deleted: unlinked, renamed), of unlinked inodes
        still open or known to the kernel, keys being worked on, and keys
        removed at or after ``since`` (a ``time.monotonic()``: when the
        importer's listing started, so the listing may still show them).
        """
        keys = set(self._key_locks)
        keys.update(self._dirs_to_clean)  # old names of removed or renamed directories
        keys.update(key for key, when in self._vacated.items() if when >= since)
        for node in list(self.fs._inodes.values()):
            if node.row.nlink == 0:
                keys.update(node.row.backend_keys)
        for ino in list(self._moved):
            keys.update((await self._moved_keys(ino))[1])
        return keys

    async def _lookup_path(self, key: str):
        """The row the namespace has at backend path ``key``, or None."""
        ino = ROOT_INO
        try:
            for name in key.split("/"):
                ino = (await self.meta.lookup(ino, name.encode("utf-8", "surrogateescape"))).ino
            return await self.meta.get_inode(ino)
        except NotFound:
            return None

    async def _path_alive(self, key: str) -> bool:
        row = await self._lookup_path(key)
        return row is not None and row.state is not None

    @asynccontextmanager
    async def _key_lock(self, key: str):
        entry = self._key_locks.get(key)
        if entry is None:
            entry = self._key_locks[key] = [trio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._key_locks[key]
