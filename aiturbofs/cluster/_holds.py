"""The replicas this node keeps for other nodes' files: received, held, released, recovered.

A peer staging a file puts its chunks here (``receive``: each is pinned in
the pool and kept in a backing file of its own), then asks this node to
``hold`` them for the file's inode.  A hold keeps them pinned until the
shared metadata says the file is durable (or gone): ``release_done``, run by
the node's housekeeping, which also releases chunks no hold claimed within
``CLUSTER_HOLD_PENDING_S``.  After a restart, ``recover`` holds again the
replicas a previous run kept for files not yet durable.
"""

from __future__ import annotations

import logging
import time

import trio

from .. import chunk
from .._errors import NotFound
from .._limits import CLUSTER_HOLD_PENDING_S
from ..meta import STATE_BROKEN, STATE_DURABLE, STATE_PERSISTING, STATE_STAGED
from ..staging import BackingArea, Pins, StagingPool, content_key_of

log = logging.getLogger("aiturbofs.cluster")


class ReplicaHolds:
    """Replica chunks pinned on this node for other nodes' files (see module doc)."""

    def __init__(self, *, node: str, meta, pool: StagingPool, staging: BackingArea):
        self.node = node
        self.meta = meta
        self.pool = pool
        self.staging = staging  # replicas received are kept in backing files of their own
        self._holds: dict[int, Pins] = {}  # inode -> replica chunks pinned here for it (one pin per chunk)
        self._pending: dict[bytes, list[float]] = {}  # received chunks no hold claimed yet

    def __len__(self) -> int:
        """How many files this node holds replicas for."""
        return len(self._holds)

    async def receive(self, key: bytes, data: bytearray) -> None:
        """A peer put chunk ``key`` here: pinned until a hold claims it (or it expires)."""
        await self.pool.store(key, data, into=self.staging.replica(key).range(0))
        self._pending.setdefault(key, []).append(time.monotonic())

    def hold(self, ino: int, keys: list[bytes]) -> None:
        """Turn received chunks into replicas of ``ino``: pinned until it is durable."""
        pins = self._pins(ino)
        held = set(pins.keys)
        for key in keys:
            times = self._pending.get(key)
            if not times:
                continue  # never arrived (or already expired): the sender counted it as failed
            times.pop(0)
            if not times:
                del self._pending[key]
            if key in held:
                self.pool.unpin(key)  # one pin per file is enough
            else:
                held.add(key)
                pins.keys.append(key)  # the pin store() took is the hold's now

    async def recover(self) -> None:
        """After a restart: the replicas a previous run kept here for peers' files not yet durable are held again.

        Each is verified (BLAKE3) against its name first.  What no such file
        needs is removed with the rest of what the previous run left
        (``BackingArea.sweep``, after the persister's own recovery).
        """
        found = self.staging.found_replicas
        if not found:
            return
        restored = 0
        for row in await self.meta.inodes_in_states([STATE_STAGED, STATE_PERSISTING]):
            if self.node not in row.holders or row.owner == self.node or row.nlink == 0 or not row.manifest:
                continue
            first: dict[bytes, int] = {}  # each chunk of the file, at its first index
            for index, key in enumerate(chunk.unpack_manifest(row.manifest)[: chunk.chunk_count(row.size)]):
                if key != chunk.HOLE:
                    first.setdefault(key, index)
            for key, index in first.items():
                length = chunk.chunk_length(row.size, index)
                if self.pool.has(key):
                    self.pool.pin(key)
                elif key in found and await self._replica_verified(key, length):
                    self.pool.recover_replica(key, self.staging.replica(key).range(0), length)
                else:
                    continue  # not kept here (another holder has it), or lost
                self._pins(row.ino).keys.append(key)
                restored += 1
        if restored:
            log.info("recovered replicas=%d for files of other nodes not yet durable", restored)

    async def _replica_verified(self, key: bytes, length: int) -> bool:
        """Does the replica file a previous run left for ``key`` still hash to it?"""
        try:
            return await trio.to_thread.run_sync(content_key_of, self.staging.replica(key).path, 0, length) == key
        except OSError as exc:
            log.warning("replica %s… not recovered: %s", key.hex()[:16], exc)
            return False

    def _pins(self, ino: int) -> Pins:
        """The pins this node holds for ``ino``'s replicas (made empty on first use)."""
        pins = self._holds.get(ino)
        if pins is None:
            pins = self._holds[ino] = Pins(self.pool)
        return pins

    async def release_done(self) -> None:
        """Release the holds of files now durable (or gone), and received chunks no hold claimed in time."""
        for ino, pins in list(self._holds.items()):
            try:
                row = await self.meta.get_inode(ino)
                done = row.nlink == 0 or row.state == STATE_BROKEN or (
                    row.state == STATE_DURABLE and row.persisted_version == row.version
                )
            except NotFound:
                done = True
            if done and self._holds.get(ino) is pins:
                del self._holds[ino]
                pins.release()
        cutoff = time.monotonic() - CLUSTER_HOLD_PENDING_S
        for key, times in list(self._pending.items()):
            while times and times[0] < cutoff:
                times.pop(0)
                self.pool.unpin(key)
                log.warning("chunk %s… was received but never claimed by a file: released", key.hex()[:16])
            if not times:
                del self._pending[key]
