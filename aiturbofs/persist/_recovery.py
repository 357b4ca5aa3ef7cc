"""Recovery after a restart: resume the persists of staged files whose bytes survived.

A chunk counts as found where its bytes hash (BLAKE3) to the manifest: in
the file's own backing file, the spill store, or (a chunk deduplicated into
another file's range) another backing file the previous run left: of a file
removed before the crash, or of a staged file that dropped the chunk
without writing its range (a truncate, a shorter rewrite, a punched hole),
where the chunk stayed for the file that shares it.  A file
none of whose copies survived (and that no replica holds) is broken, unless
its upload made it to the backend before the daemon stopped.
"""

import logging
import stat

import trio

from .. import chunk
from .._errors import BackendError, IntegrityError, NotFound
from .._limits import CHUNK_BYTES
from ..meta import STATE_BROKEN, STATE_DURABLE, STATE_PERSISTING, STATE_STAGED
from ..staging import content_key_of, room_in
from ._host import PersistHost, is_mine
from ._verify import holds_version

log = logging.getLogger("aiturbofs.persist")


class Recovery:
    """One pass at start-up (see module doc)."""

    def __init__(self, host: PersistHost, queue):
        self.host = host
        self.meta = host.meta
        self.backend = host.backend
        self.pool = host.pool
        self._queue = queue  # the Persister: recovered files are queued there

    async def run(self) -> None:
        """Recover every staged file of this node, then remove what no file took."""
        cluster = self.host.cluster
        staging = self.host.staging
        rows = []
        for row in await self.meta.inodes_in_states([STATE_STAGED, STATE_PERSISTING]):
            if not is_mine(self.host.cluster, row):
                continue  # another node's file (shared metadata)
            if not stat.S_ISREG(row.mode):
                self._queue.enqueue(row.ino)  # a node: everything it needs is in its row
                continue
            rows.append(row)
        held: list[bytes] = []
        wanted = {}  # key -> length, of chunks in no row's own range
        for row in rows:
            backings = staging.existing(row.ino)
            for index, k in enumerate(chunk.unpack_manifest(row.manifest or b"")):
                if k == chunk.HOLE or self.pool.has(k) or k in self.pool.spill:
                    continue
                length = chunk.chunk_length(row.size, index)
                for backing in backings:
                    if await self._recover_range(backing, index, k, length, held):
                        break
                else:
                    wanted[k] = length
        # A chunk deduplicated into another file's range stays there when that file drops it without
        # writing the range (a truncate, a shorter rewrite, a punched hole): look in every range no
        # file took, of the files removed before the crash and of the staged ones alike.
        others = staging.orphans({row.ino for row in rows}) + [b for row in rows for b in staging.existing(row.ino)]
        for backing in others:
            if not wanted:
                break
            await self._recover_from_other(backing, wanted, held)
        for row in rows:
            keys = chunk.unpack_manifest(row.manifest or b"")
            present = [k for k in keys if k != chunk.HOLE]
            missing = [k for k in present if not self.pool.has(k) and k not in self.pool.spill]
            if cluster.shared and missing and any(h != cluster.owner for h in row.holders):
                log.info("recovering ino=%d from=replicas chunks=%d", row.ino, len(missing))
                missing = []
            if missing and await self._recover_from_backend(row):
                continue
            if missing and not row.backend_keys:
                await self.meta.set_state(row.ino, STATE_BROKEN)
                self._queue.record_broken(await self._queue.name_of(row.ino), f"{len(missing)} of its {len(present)} chunk(s) "
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
            self.host.adopt_recovered(row, pinned, staging.existing(row.ino))
            log.info("recovered ino=%d size=%d chunks=%d of %d (persisting it)", row.ino, row.size, len(pinned), len(present))
            self._queue.enqueue(row.ino)
        for k in held:
            self.pool.hold(k, -1)
        await self._resume_moves()  # first: an orphan's delete must know which moves may be unrecorded
        for row in await self.meta.orphans():
            self._queue.enqueue(row.ino, moved=True)
        for k in self.pool.spill.keys():
            if not self.pool.pinned(k):
                self.pool.spill.discard(k)
        staging.sweep()

    async def _resume_moves(self) -> None:
        """Queue the renames, links and unlinks the backend had not caught up with when the daemon stopped.

        Their objects still sit at their old names: queued as moved, the
        importer does not take those for new files, and the jobs move them.
        """
        for ino, _gen, dir_path in await self.meta.moves():
            try:
                row = await self.meta.get_inode(ino)
            except NotFound:
                continue
            if not is_mine(self.host.cluster, row):
                continue
            log.info("resuming the backend move of ino=%d%s", ino, f" (directory, was {dir_path})" if dir_path else "")
            self._queue.enqueue(ino, resumed=True)
            if dir_path is not None:
                await self._queue.enqueue_tree(ino, dir_path)

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
        charge = room_in(rng, length)
        self.pool.count_recovered(charge)
        self.pool.adopt_range(key, rng, length, charge, pin=False)
        self.pool.hold(key, +1)  # until the rows that need it are pinned
        held.append(key)
        return True

    async def _recover_from_other(self, backing, wanted: dict, held: list[bytes]) -> None:
        """Look for ``wanted`` chunks in the ranges of ``backing`` that recovery took for nothing yet."""
        lengths = set(wanted.values())
        for index in range(chunk.chunk_count(backing.size)):
            if backing.range(index).entry is not None:
                continue  # its own file's chunk (or one found there already)
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
                info = await holds_version(self.host, key, row)
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
            self._queue.enqueue(row.ino, moved=True)  # its other names, its stale objects
            return True
        return False
