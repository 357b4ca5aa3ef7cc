"""The persist queue: future 1.  Makes the backend match the namespace, one inode per job.

Inodes are queued as they are committed, renamed, linked or removed; up
to PERSIST_FILES_IN_FLIGHT jobs run at once (plus spares while jobs only
wait for another file's durable copy), an inode enqueued while its job
runs runs once more after it, and each job is the reconciler's
(``_reconcile``, with its key bookkeeping in ``_claims`` and its deletes
in ``_remove``), which sends versions with the upload jobs (``_upload``).

The queue owns the retry policy: transient backend errors are retried with
capped, jittered exponential backoff for the retry window (a file becoming
durable wakes the others early: the backend answers again); then, or on a
permanent error, the file is marked ``broken``.  A backend that keeps
answering "full" reaches writers as ENOSPC.  It also persists the files of
dead nodes whose replica is here (``take_over``), and ``recover`` resumes,
after a restart, what the previous run had staged (``_recovery``).
"""

import collections
import errno
import logging
import os
import random
import stat
import time

import trio

from .._errors import AiturboError, BackendError, IntegrityError, MetaUnavailable, NotFound, TransientBackendError
from .._limits import (
    DIR_ATTRS_SETTLE_S,
    DIRS_SETTLING_MAX,
    DIRS_TO_CLEAN_MAX,
    PERSIST_BACKOFF_FIRST_S,
    PERSIST_BACKOFF_JITTER,
    PERSIST_BACKOFF_MAX_S,
    PERSIST_FILES_IN_FLIGHT,
    PERSIST_SPARE_FILES_MAX,
    PERSIST_YIELD_FREE_MIN,
    PERSIST_YIELD_QUIET_S,
    RENAME_READDIR_BATCH_ENTRIES,
)
from .._nursery import open_nursery
from ..cluster import PersistHints
from ..meta import STATE_BROKEN, STATE_PERSISTING, STATE_STAGED
from ._host import PersistHost, PersistStats, is_mine
from ._reconcile import Reconciler
from ._recovery import Recovery
from ._upload import Uploads
from ._verify import verify_chunks

log = logging.getLogger("aiturbofs.persist")

DRAIN_LOG_PERIOD_S = 5.0


def _jittered(backoff_s: float) -> float:
    """How long a retry sleeps.  Jittered: every file an outage failed at once
    would otherwise retry in step, a burst of PERSIST_FILES_IN_FLIGHT uploads
    at each doubling and all of them together when the service comes back."""
    return backoff_s * random.uniform(1.0 - PERSIST_BACKOFF_JITTER, 1.0)


class Persister:
    """The persist queue and its jobs (see module doc)."""

    def __init__(self, host: PersistHost):
        self.host = host
        self.meta = host.meta
        self.backend = host.backend
        self.pool = host.pool
        self.stats = PersistStats()
        self.uploads = Uploads(host, self.stats, self._files_wait)
        self.reconciler = Reconciler(host, self.stats, self.uploads, self)
        # queued files -> when they were queued (trio time), oldest first
        self._pending: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.running: set[int] = set()
        self._rerun: set[int] = set()
        # Backend directories of removed directories, oldest first (see
        # enqueue_dir_cleanup); a path queued twice is cleaned once.
        self._dirs_to_clean: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Directories whose backend mtime the persister moved -> when they are
        # queued to get it back (trio time; in order, see dir_changed).
        self._dirs_settling: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._work = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        # Set (and replaced) whenever a file became durable: jobs sleeping in
        # backoff then retry at once instead of at the end of a sleep that may
        # have grown to PERSIST_BACKOFF_MAX_S while the backend was down.
        self._backend_answers = trio.Event()
        self._full_since: float | None = None  # the backend answers "full" (ENOSPC) since then
        self._nursery: trio.Nursery | None = None
        self._files_waiting = 0  # files in flight whose parts wait for another file's copy
        self._spares = 0  # spare uploads running (see _files_wait)
        self._draining = False

    # ------------------------------------------------------------ the VFS's calls
    def set_hints(self, ino: int, version: int, hints: PersistHints | None) -> None:
        self.uploads.set_hints(ino, version, hints)

    async def recover(self) -> None:
        """After a restart: resume persists whose chunks survived in backing files or spill."""
        await Recovery(self.host, self).run()

    async def verify(self, ino: int, first: int, count: int) -> dict:
        """``aiturbo verify``: check chunks of ``ino``'s backend objects against its manifest (``_verify``)."""
        answer = await verify_chunks(self.host, ino, first, count)
        self.stats.verify_problems += len(answer["problems"])
        return answer

    async def upload_for_peer(self, backend_key: str, token: str, index: int, key: bytes, length: int, holders: list[str]) -> str:
        return await self.uploads.upload_for_peer(backend_key, token, index, key, length, holders)

    def attrs_pending(self, row) -> bool:
        """Is ``row`` durable but its backend objects lack its current mode, owner or mtime?"""
        return self.reconciler.attrs_pending(row)

    async def claimed_keys(self, since: float) -> set[str]:
        """Backend keys the importer must not bring back as new names (see ``KeyClaims.claimed_keys``)."""
        return await self.reconciler.claimed_keys(since) | set(self._dirs_to_clean)

    def file_got_through(self) -> None:
        """A file became durable: the backend answers, and is not full."""
        self.backend_answered()
        self.host.store.health.mark_up()
        self._full_since = None
        self.pool.accept_waits()

    # ------------------------------------------------------------ the queue
    def enqueue(self, ino: int, *, moved: bool = False, resumed: bool = False) -> None:
        """Reconcile ``ino`` soon.  ``moved``: its names changed (rename, link,
        unlink), so its backend objects may sit at names it no longer has
        until this job moves or deletes them (see ``KeyClaims.holder``);
        ``resumed``: a move the run before a restart had not finished
        (``KeyClaims.settled``)."""
        if moved or resumed:
            self.reconciler.note_moved(ino, resumed=resumed)
        if ino in self.running:
            self._rerun.add(ino)
        else:
            self._pending.setdefault(ino, trio.current_time())  # queued again: it has waited since the first time
            self._start_spares()  # the files in flight may all wait for this one's copy
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake()

    async def enqueue_tree(self, dir_ino: int, old_path: str | None = None) -> None:
        """Reconcile every file below a renamed directory.

        ``old_path``: the directory's backend path before the rename.  Its
        backend directories are then removed where empty, deepest first (the
        ones still holding files go when the last file has moved out, see
        ``Removals._prune_dirs``); an empty one left behind showed up again at import.

        The directory's pending move in the metadata (``meta.moves``) is
        let go once every file below it has one of its own: a restart
        meanwhile walks the tree again.
        """
        move = await self.meta.move_of(dir_ino)
        stack = [(dir_ino, old_path)]
        old_dirs = []
        while stack:
            ino, old = stack.pop()
            if old is not None:
                old_dirs.append(old)
            found = []
            async for name, row in self.meta.children(ino, RENAME_READDIR_BATCH_ENTRIES):
                if row.state is not None:  # a file, or a node the backend keeps (a directory's marker too)
                    found.append(row.ino)
                if stat.S_ISDIR(row.mode):  # not a bit test: sockets and block devices share the bit
                    stack.append((row.ino, None if old is None else f"{old}/{os.fsdecode(name)}"))
            await self.meta.moves_add(found)
            for child in found:
                self.enqueue(child, moved=True)
        for old in reversed(old_dirs):  # children were found after their parents
            self.enqueue_dir_cleanup(old)
        if move is not None and move[1] is not None:
            await self.meta.moves_done(dir_ino, move[0])

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

    def dir_changed(self, ino: int) -> None:
        """The persister changed entries of directory ``ino`` in the backend,
        which moved its mtime: reconcile it (its attributes) once
        DIR_ATTRS_SETTLE_S passed, so the files following into it share that."""
        if ino in self._dirs_settling:
            return
        if len(self._dirs_settling) >= DIRS_SETTLING_MAX:
            self.enqueue(ino)
            return
        self._dirs_settling[ino] = trio.current_time() + DIR_ATTRS_SETTLE_S
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake()

    def dir_settling(self, ino: int) -> bool:
        return ino in self._dirs_settling

    async def _dir_settler(self) -> None:
        while True:
            while not self._dirs_settling:
                await self._work.wait()
            ino, when = next(iter(self._dirs_settling.items()))  # the earliest: all wait equally long
            await trio.sleep_until(when)
            del self._dirs_settling[ino]
            self.enqueue(ino)

    def _wake(self) -> None:
        # Whoever signals replaces the event, so every waiter of this
        # generation wakes.  (Waiters replacing it themselves left the other
        # workers and the dir cleaner waiting on orphaned events: the cleaner
        # then never ran again and unmount's drain waited forever.)
        self._work.set()
        self._work = trio.Event()

    def queue_length(self) -> int:
        return len(self._pending) + len(self.running)

    def queued(self) -> list[int]:
        return list(self.running) + list(self._pending)

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
            nursery.start_soon(self._dir_settler)
            task_status.started()

    async def _next(self) -> int:
        while True:
            while not self._pending:
                if not self.running and not self._dirs_to_clean and not self._dirs_settling:
                    self._idle.set()
                await self._work.wait()
            # The file stays queued while it waits (queue_length and drain count it).
            wait_s = self._yield_s(next(iter(self._pending.values())))
            if wait_s <= 0:
                break
            await trio.sleep(wait_s)
        ino, _ = self._pending.popitem(last=False)
        return ino

    def _yield_s(self, queued_at: float) -> float:
        """How long the next job waits for the application's writes to pause (0: start now).

        Each job's main-thread work (metadata, publish) runs on the thread
        that serves the writers' requests: a checkpoint of many small files
        closes about twice as fast when the uploads wait until the writing
        pauses.  They wait at most ``persist_yield_s`` after the file was
        queued, never while someone waits for durability (the host's
        ``writers_active``), at a drain, or while memory runs short (a writer
        waits for room, or less than PERSIST_YIELD_FREE_MIN of the budget is
        free).  Never longer than PERSIST_YIELD_QUIET_S at a time: the
        conditions are looked at again.
        """
        left = queued_at + self.host.options.persist_yield_s - trio.current_time()
        if (left <= 0 or self._draining or not self.host.writers_active() or self.pool.writers_waiting
                or self.pool.free_fraction() < PERSIST_YIELD_FREE_MIN):
            return 0.0
        return min(left, PERSIST_YIELD_QUIET_S)

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

    def _files_wait(self, delta: int) -> None:
        """Count files whose upload only waits for another file's copy; start spares for the queue.

        A node persists PERSIST_FILES_IN_FLIGHT files at once.  When all of
        them wait for a chunk that a file still queued here will upload (a
        KV-cache prefix shared by many files of one node), nothing moved
        until the waits ran out; a spare upload takes the queued file.
        """
        self._files_waiting += delta
        self._start_spares()

    def _start_spares(self) -> None:
        """A spare upload per file in flight that waits, while files are queued (see ``_files_wait``)."""
        while (self._nursery is not None and self._pending and self._spares < self._files_waiting
               and self._spares < PERSIST_SPARE_FILES_MAX):
            self._spares += 1
            self._nursery.start_soon(self._spare_worker)

    async def _persist_one(self, ino: int) -> None:
        self.running.add(ino)
        self.reconciler.job_started(ino)
        try:
            # A renamed file's pending move (meta.moves), read before the job reads its names: let go once
            # the job made the backend match them (unless it runs again: it waits for another file).
            move = await self.meta.move_of(ino) if ino in self.reconciler.moved else None
            await self._persist_with_retry(ino)
            if move is not None and move[1] is None and ino not in self._rerun:
                await self.meta.moves_done(ino, move[0])
        except MetaUnavailable as exc:  # (the move stays noted: a restart reconciles the file again)
            log.warning("persist of inode %d: pending move not read or let go: %s", ino, exc)
        except Exception as exc:  # a bug: keep persisting the other files
            log.exception("BUG while persisting inode %d", ino)
            self.host.record_error(f"internal error persisting inode {ino}: {exc!r}")
        finally:
            self.running.discard(ino)
            again = ino in self._rerun
            self.reconciler.job_ended(ino, again=again)
            if again:
                self._rerun.discard(ino)
                self._pending[ino] = trio.current_time()
            elif ino not in self._pending:
                self.uploads.hints.pop(ino, None)  # its version is done (durable, broken or gone)
            self._wake()

    async def _dir_cleaner(self) -> None:
        while True:
            while not self._dirs_to_clean:
                await self._work.wait()
            path = next(iter(self._dirs_to_clean))  # popped when done: drain waits for it
            await self.reconciler.clean_dir(path)
            self._dirs_to_clean.pop(path, None)
            self._wake()

    async def drain(self, timeout_s: float) -> list[int]:
        """Wait until the queue is empty; returns inodes still queued at the deadline."""
        started = time.monotonic()
        self._draining = True  # the jobs stop waiting for writers to pause (_yield_s)
        with trio.move_on_after(timeout_s):
            while not self._idle.is_set():
                with trio.move_on_after(DRAIN_LOG_PERIOD_S):
                    await self._idle.wait()
                if not self._idle.is_set():
                    log.info(
                        "drain_progress files=%d s=%.0f uploaded_bytes=%d",
                        self.queue_length(), time.monotonic() - started, self.stats.bytes_uploaded,
                    )
        left = self.queued()
        # Trust the metadata, not only the queue: a file a bug dropped from the
        # queue is still staged there, and must not be reported durable.
        for row in await self.meta.inodes_in_states([STATE_STAGED, STATE_PERSISTING]):
            if row.nlink > 0 and row.ino not in left and is_mine(self.host.cluster, row):
                left.append(row.ino)
        return left

    async def take_over(self, dead: set[str]) -> None:
        """Cluster: persist the staged files of dead nodes from the replicas here.

        The first live holder of a file claims it (a compare-and-set on its
        owner, so exactly one node does).  A file whose every holder is dead
        lost its last DRAM copy before it became durable: it is broken.
        """
        me = self.host.cluster.owner
        for row in await self.meta.inodes_in_states([STATE_STAGED, STATE_PERSISTING]):
            if row.owner is None or row.owner not in dead or row.nlink == 0:
                continue
            name = await self.name_of(row.ino)
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
                    self.record_broken(name, f"every node holding it ({', '.join(row.holders)}) died before it was durable")
                    self.host.notify_state(row.ino)
                continue
            if live[0] == me and await self.meta.claim_owner(row.ino, row.version, row.owner, me):
                log.warning("taken_over path=%s size=%d dead_owner=%s (persisting it from the replica here)", name, row.size, row.owner)
                self.enqueue(row.ino)

    async def _persist_with_retry(self, ino: int) -> None:
        # A loop of its own, not tenacity like the reader's and the PostgreSQL
        # engine's retries: its backoff ends early when another file gets
        # through (``_backend_answers``), the retry window bounds backend
        # errors only (the metadata engine is waited for however long), and
        # each error ends its own way.  In tenacity each of those would be a
        # hook (sleep, stop, retry) reading the last error back.
        deadline = time.monotonic() + self.host.options.persist_retry_window_s
        backoff = PERSIST_BACKOFF_FIRST_S
        while True:
            try:
                await self.reconciler.reconcile(ino)
                return
            except NotFound:
                return  # the inode is gone: nothing left to persist
            except TransientBackendError as exc:
                self._note_full(exc)
                if time.monotonic() + backoff > deadline:
                    await self._mark_broken(ino, f"backend unavailable for the whole retry window: {exc}")
                    return
                self.stats.retries += 1
                sleep_s = _jittered(backoff)
                log.warning("persist_retry path=%s error=%r retry_in_s=%.1f", await self.name_of(ino), str(exc), sleep_s)
                with trio.move_on_after(sleep_s):
                    await self._backend_answers.wait()  # another file got through: so may this one
                backoff = min(backoff * 2, PERSIST_BACKOFF_MAX_S)
            except MetaUnavailable as exc:
                # Not the file's fault, and recording 'broken' needs the metadata
                # too: wait for the engine however long it takes (no deadline).
                self.stats.retries += 1
                sleep_s = _jittered(backoff)
                log.warning("persist_retry ino=%d error=%r retry_in_s=%.1f (metadata engine)", ino, str(exc), sleep_s)
                await trio.sleep(sleep_s)
                backoff = min(backoff * 2, PERSIST_BACKOFF_MAX_S)
            except (BackendError, IntegrityError) as exc:
                await self._mark_broken(ino, exc)
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
                        exc, self.host.options.full_backend_wait_s)
        if now - self._full_since >= self.host.options.full_backend_wait_s:
            self.pool.refuse_waits(f"the backend has been full for {now - self._full_since:.0f} s: {exc}")

    def backend_full_s(self) -> float | None:
        """For how long the backend has answered "full" (None: it has not)."""
        return None if self._full_since is None else time.monotonic() - self._full_since

    async def name_of(self, ino: int) -> str:
        """A path of ``ino`` for a log line (``inode N`` when it has none)."""
        try:
            paths = await self.meta.paths_of(ino)
        except AiturboError:
            paths = []
        return paths[0] if paths else f"inode {ino}"

    def record_broken(self, name: str, why: str) -> None:
        """The error ``aiturbo status`` shows and its ``broken path= reason=`` log line."""
        self.host.record_error(f"{name} is broken: {why}", event=f"broken path={name} reason={why!r}")

    async def _mark_broken(self, ino: int, why: str | Exception) -> None:
        """Mark the version whose upload failed broken; a newer one is persisted instead.

        A commit may land between the failure and this (every await here is
        a chance): marking the inode's current version would break and
        unpin a good version that was never tried.
        """
        lost_to_kernel = isinstance(why, IntegrityError)  # (a chunk missing: written over, see below)
        why = str(why)
        if self.reconciler.attrs_failed(ino):
            # Only a chmod, chown or utime did not reach the backend: the data did.
            # The next change, ``aiturbo wait`` or state query tries again.
            log.warning("attributes of %s not persisted: %s (its data stays durable)", await self.name_of(ino), why)
            return
        failed = self.reconciler.trying.get(ino)
        try:
            row = await self.meta.get_inode(ino)
        except NotFound:
            return  # removed meanwhile: nothing left to mark
        name = await self.name_of(ino)
        if failed is None:
            failed = row.version
        if row.version == failed and lost_to_kernel and self.host.kernel_writing(ino):
            log.info("persist of %s version %d: %s: the kernel is writing it (passthrough); its next flush "
                     "commits what replaces it", name, failed, why)
            return
        if row.version != failed or not await self.meta.set_state(ino, STATE_BROKEN, if_version=failed):
            log.info("persist of %s version %d failed (%s); version %d was committed since: persisting that",
                     name, failed, why, (await self.meta.get_inode(ino)).version)
            self.enqueue(ino)  # reruns after this job
            return
        self.stats.files_broken += 1
        self.record_broken(name, why)
        row = await self.meta.get_inode(ino)
        await self.host.on_persisted(ino, row)
