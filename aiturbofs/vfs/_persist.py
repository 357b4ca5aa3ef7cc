"""The persister: future 1.  Makes the backend match the namespace.

Each job is one inode, and the job *reconciles*: it compares what the
metadata engine says (current paths, committed version, state) with what the
backend holds (``backend_keys`` at ``persisted_version``) and does what is
missing — upload the committed version (multipart, chunks read from the pool,
the spill store or the previous backend object, each verified by BLAKE3),
move or copy after renames and hard links, delete after unlink — then loops
until nothing changed meanwhile.  That is why renaming or deleting a file
while it persists leaves no ghost objects and loses no rename.

Transient backend errors are retried with capped exponential backoff for the
retry window; then, or on a permanent error, the file is marked ``broken``.
Operations on one backend key are serialised by a per-key lock, and a key is
only deleted if no live inode's path names it.
"""

import collections
import logging
import time
from contextlib import asynccontextmanager

import trio

from .. import chunk
from .._errors import AiturboError, BackendError, BackendNotFound, IntegrityError, NotFound, TransientBackendError
from .._limits import (
    CHUNK_BYTES,
    PERSIST_BACKOFF_FIRST_S,
    PERSIST_BACKOFF_MAX_S,
    PERSIST_FILES_IN_FLIGHT,
    PERSIST_PARTS_IN_FLIGHT,
)
from ..meta import ROOT_INO, STATE_BROKEN, STATE_DURABLE, STATE_PERSISTING, STATE_STAGED

log = logging.getLogger(__name__)

DRAIN_LOG_PERIOD_S = 5.0


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
        self._dirs_to_clean: list[str] = []
        self._work = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._key_locks: dict[str, list] = {}
        self.bytes_uploaded = 0
        self.bytes_fetched = 0
        self.files_durable = 0
        self.files_broken = 0
        self.retries = 0

    # ------------------------------------------------------------------ queue
    def enqueue(self, ino: int) -> None:
        if ino in self._running:
            self._rerun.add(ino)
        else:
            self._pending[ino] = None
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._work.set()

    async def enqueue_tree(self, dir_ino: int) -> None:
        """Reconcile every file below a renamed directory."""
        stack = [dir_ino]
        while stack:
            ino = stack.pop()
            offset = 0
            while True:
                entries = await self.meta.readdir(ino, offset, 512)
                if not entries:
                    break
                for _, row, offset in entries:
                    if row.state is not None:
                        self.enqueue(row.ino)
                    elif row.target is None and row.mode & 0o040000:
                        stack.append(row.ino)

    def enqueue_dir_cleanup(self, path: str) -> None:
        """Remove the (now empty) backend directory of a removed directory."""
        self._dirs_to_clean.append(path)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._work.set()

    def queue_length(self) -> int:
        return len(self._pending) + len(self._running)

    def queued(self) -> list[int]:
        return list(self._running) + list(self._pending)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(PERSIST_FILES_IN_FLIGHT):
                nursery.start_soon(self._worker)
            nursery.start_soon(self._dir_cleaner)
            task_status.started()

    async def _next(self) -> int:
        while not self._pending:
            if not self._running and not self._dirs_to_clean:
                self._idle.set()
            await self._work.wait()
            self._work = trio.Event()
        ino, _ = self._pending.popitem(last=False)
        return ino

    async def _worker(self) -> None:
        while True:
            ino = await self._next()
            self._running.add(ino)
            try:
                await self._persist_with_retry(ino)
            except Exception as exc:  # a bug: keep persisting the other files
                log.exception("BUG while persisting inode %d", ino)
                self.fs.record_error(f"internal error persisting inode {ino}: {exc!r}")
            finally:
                self._running.discard(ino)
                if ino in self._rerun:
                    self._rerun.discard(ino)
                    self._pending[ino] = None
                self._work.set()

    async def _dir_cleaner(self) -> None:
        while True:
            while not self._dirs_to_clean:
                await self._work.wait()
            path = self._dirs_to_clean.pop(0)
            try:
                await self.backend.remove_dir(path)
            except BackendError as exc:
                log.info("backend directory %s not removed: %s", path, exc)
            self._work.set()

    async def drain(self, timeout_s: float) -> list[int]:
        """Wait until the queue is empty; returns inodes still queued at the deadline."""
        started = time.monotonic()
        with trio.move_on_after(timeout_s):
            while not self._idle.is_set():
                with trio.move_on_after(DRAIN_LOG_PERIOD_S):
                    await self._idle.wait()
                if not self._idle.is_set():
                    log.info(
                        "drain: %d file(s) still persisting after %.0f s (%d bytes uploaded so far)",
                        self.queue_length(), time.monotonic() - started, self.bytes_uploaded,
                    )
        return self.queued()

    # ------------------------------------------------------------- recovery
    async def recover(self) -> None:
        """After a restart: resume persists whose chunks survived in spill."""
        for row in await self.meta.inodes_in_states([STATE_STAGED, STATE_PERSISTING]):
            keys = [k for k in chunk.unpack_manifest(row.manifest or b"") if k != chunk.HOLE]
            missing = [k for k in keys if k not in self.pool.spill]
            if missing and not row.backend_keys:
                paths = await self.meta.paths_of(row.ino)
                await self.meta.set_state(row.ino, STATE_BROKEN)
                self.fs.record_error(
                    f"{paths[0] if paths else f'inode {row.ino}'} is broken: {len(missing)} of its "
                    f"{len(keys)} chunk(s) were only in DRAM when the daemon stopped"
                )
                continue
            for k in keys:
                if k in self.pool.spill:
                    self.pool.recover_spilled(k)
            self.fs.adopt_recovered(row)
            log.info("recovered inode %d (%d bytes) from spill; persisting it", row.ino, row.size)
            self.enqueue(row.ino)
        for row in await self.meta.orphans():
            self.enqueue(row.ino)
        for k in self.pool.spill.keys():
            if not self.pool.pinned(k):
                self.pool.spill.discard(k)

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
                if time.monotonic() + backoff > deadline:
                    await self._mark_broken(ino, f"backend unavailable for the whole retry window: {exc}")
                    return
                self.retries += 1
                log.warning("persist of inode %d: %s; retrying in %.1f s", ino, exc, backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, PERSIST_BACKOFF_MAX_S)
            except (BackendError, IntegrityError) as exc:
                await self._mark_broken(ino, str(exc))
                return

    async def _mark_broken(self, ino: int, why: str) -> None:
        row = await self.meta.get_inode(ino)
        paths = await self.meta.paths_of(ino)
        await self.meta.set_state(ino, STATE_BROKEN, if_version=row.version)
        self.files_broken += 1
        self.fs.record_error(f"{paths[0] if paths else f'inode {ino}'} is broken: {why}")
        row = await self.meta.get_inode(ino)
        await self.fs.on_persisted(ino, row)
        self._release_pins(ino, row)

    def _release_pins(self, ino: int, row) -> None:
        node = self.fs._cached(ino)
        if node is None or node.content is None or node.content.dirty:
            return
        for slot in node.content.slots:
            if slot is not None and slot.pinned:
                self.pool.unpin(slot.key)
                slot.pinned = False

    async def _reconcile(self, ino: int) -> None:
        while True:
            row = await self.meta.get_inode(ino)
            paths = await self.meta.paths_of(ino) if row.nlink > 0 else []
            if not paths:
                await self._delete_all(row)
                return
            if row.state == STATE_BROKEN:
                return
            if row.state != STATE_DURABLE or row.persisted_version != row.version:
                await self._upload_version(row, paths)
                continue
            if sorted(row.backend_keys) != sorted(paths):
                await self._relocate(row, paths)
                continue
            return

    async def _upload_version(self, row, paths: list[str]) -> None:
        if row.state != STATE_PERSISTING:
            if not await self.meta.set_state(row.ino, STATE_PERSISTING, if_version=row.version):
                return
            self.fs._notify_state(row.ino)
        async with self._key_lock(paths[0]):
            info = await self._upload(row, paths[0])
        for extra in paths[1:]:
            async with self._key_lock(extra):
                await self.backend.copy(paths[0], extra)
        for stale in row.backend_keys:
            if stale not in paths:
                await self._delete_key(stale)
        if await self.meta.set_state(
            row.ino, STATE_DURABLE, if_version=row.version,
            backend_keys=paths, persisted_version=row.version, backend_etag=info.etag,
        ):
            self.files_durable += 1
            log.info("durable: %s (%d bytes, version %d)", paths[0], row.size, row.version)
            await self.fs.on_persisted(row.ino, await self.meta.get_inode(row.ino))

    async def _upload(self, row, key: str):
        keys = chunk.unpack_manifest(row.manifest or b"")
        n = chunk.chunk_count(row.size)
        upload = await self.backend.open_upload(key)
        limiter = trio.Semaphore(PERSIST_PARTS_IN_FLIGHT)
        try:
            async with trio.open_nursery() as nursery:
                for index in range(n):
                    await limiter.acquire()
                    nursery.start_soon(self._upload_part, upload, row, keys[index], index, limiter)
            info = await upload.complete(row.size)
        except BaseException:
            with trio.CancelScope(shield=True):
                try:
                    await upload.abort()
                except AiturboError as exc:
                    log.warning("abort of upload to %s failed: %s", key, exc)
            raise
        return info

    async def _upload_part(self, upload, row, key: bytes, index: int, limiter) -> None:
        try:
            length = chunk.chunk_length(row.size, index)
            if key == chunk.HOLE:
                await upload.write_part(index, bytes(length))
            else:
                async with self.pool.lease(key, lambda: self._fetch_previous(row, index, key, length)) as view:
                    await upload.write_part(index, view)
            self.bytes_uploaded += length
        finally:
            limiter.release()

    async def _fetch_previous(self, row, index: int, key: bytes, length: int) -> bytes:
        """A chunk the pool no longer has: from the previous backend version."""
        if not row.backend_keys:
            raise IntegrityError(f"chunk {index} of inode {row.ino} is in neither DRAM, spill nor the backend")
        return await self._read_verified(row.backend_keys, index, key, length)

    async def fetch_chunk(self, ino: int, index: int, key: bytes, length: int) -> bytes:
        """Read path: a sealed chunk missing from the pool, from the backend."""
        row = await self.meta.get_inode(ino)
        if not row.backend_keys:
            raise IntegrityError(f"chunk {index} of inode {ino} is in neither DRAM, spill nor the backend")
        return await self._read_verified(row.backend_keys, index, key, length)

    async def _read_verified(self, backend_keys: list[str], index: int, key: bytes, length: int) -> bytes:
        last: Exception | None = None
        for bkey in backend_keys:
            try:
                data = await self.backend.read_range(bkey, index * CHUNK_BYTES, length)
                chunk.verify(data, key, f"{bkey} chunk {index}")
                self.bytes_fetched += len(data)
                return data
            except (IntegrityError, BackendNotFound) as exc:
                log.error("%s", exc)
                last = exc
        raise IntegrityError(str(last))

    async def _relocate(self, row, paths: list[str]) -> None:
        """Renamed or linked: move/copy the durable object, no re-upload."""
        src = row.backend_keys[0] if row.backend_keys else None
        if src is None:
            await self.meta.set_state(row.ino, STATE_STAGED, if_version=row.version)
            return
        keep = [k for k in row.backend_keys if k in paths]
        for dst in paths:
            if dst in row.backend_keys:
                continue
            async with self._key_lock(dst):
                if keep:
                    await self.backend.copy(keep[0], dst)
                else:
                    await self.backend.move(src, dst)
                    keep = [dst]
        for stale in row.backend_keys:
            if stale not in paths:
                await self._delete_key(stale)
        await self.meta.set_state(row.ino, STATE_DURABLE, if_version=row.version, backend_keys=paths)
        log.info("moved in backend: %s -> %s", row.backend_keys, paths)

    async def _delete_all(self, row) -> None:
        for key in row.backend_keys:
            await self._delete_key(key)
        if self.fs._cached(row.ino) is None:
            await self.meta.delete_inode(row.ino)
        else:
            await self.meta.set_state(row.ino, row.state, backend_keys=[])

    async def _delete_key(self, key: str) -> None:
        async with self._key_lock(key):
            if await self._path_alive(key):
                return  # another inode owns that name now; it overwrites the object
            await self.backend.delete(key)

    async def _path_alive(self, key: str) -> bool:
        ino = ROOT_INO
        try:
            for name in key.split("/"):
                ino = (await self.meta.lookup(ino, name.encode("utf-8", "surrogateescape"))).ino
        except NotFound:
            return False
        row = await self.meta.get_inode(ino)
        return row.state is not None

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
