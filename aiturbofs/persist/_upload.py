"""Upload jobs: the bytes of one committed version, sent to the backend as a multipart upload.

``Uploads.send`` sends every part of a version (chunks leased from the
pool, read back from spill, or fetched from peers or the previous backend
object through the read side's tiers, each verified by BLAKE3) and returns
the upload unpublished: the reconciler publishes it under the namespace
lock, or aborts it.  In a cluster the round plan splits the parts: some
are server-side copies of durable chunks (dedup), some wait for another
file of the round to make such a copy, some are sent by other nodes
(``upload_for_peer`` is the receiving end).  Files with more chunks than the
backend has parts are sent in wide parts assembled in a buffer of their own.
"""

import itertools
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import trio

from .. import chunk
from .._errors import (
    AiturboError,
    BackendError,
    IntegrityError,
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
    PEER_UPLOAD_PART_TIMEOUT_S,
    PERSIST_PARTS_COPIED_MAX,
    PERSIST_PARTS_IN_FLIGHT,
    PERSIST_WIDE_PARTS_IN_FLIGHT,
)
from .._nursery import open_nursery
from ..cluster import CopySource, PersistHints
from ._host import PersistHost, PersistStats

log = logging.getLogger("aiturbofs.persist")


class _PartPlan:
    """Cluster: how one upload's parts are made (see ``Uploads._part_plan``)."""

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


class Uploads:
    """Sends versions' parts (see module doc)."""

    def __init__(self, host: PersistHost, stats: PersistStats, on_files_waiting: Callable[[int], None]):
        self.host = host
        self.backend = host.backend
        self.meta = host.meta
        self.pool = host.pool
        self.stats = stats
        # Called with +1/-1 as a file's upload starts/stops waiting only for
        # another file's copy (the queue then starts spare jobs).
        self._on_files_waiting = on_files_waiting
        # Cluster: how the round plan splits an inode's upload, for one version.
        self.hints: dict[int, tuple[int, PersistHints]] = {}
        self._copy_warned = False
        # A part is sent from a copy of its chunk in the heap, outside the
        # pool's budget, unless the pool holds the chunk in a buffer: a
        # backing file's range is copied (it may be punched or written under
        # a map, and the copy is what hashes to the key), and a chunk no
        # longer in DRAM (spilled, or evicted after an earlier version went
        # durable) is read back.  With every file and part in flight doing
        # that, the daemon held 16 such chunks (128 MiB) beyond ``-o dram``.
        # This bounds them (see docs/memory.md).
        self._copied_parts = trio.Semaphore(PERSIST_PARTS_COPIED_MAX)
        # Wide parts (files of more chunks than the backend has parts) are
        # assembled in a buffer of their own, outside the pool: bounded node-wide.
        self._wide_parts = trio.Semaphore(PERSIST_WIDE_PARTS_IN_FLIGHT)

    def set_hints(self, ino: int, version: int, hints: PersistHints | None) -> None:
        """Remember how the round plan splits the upload of ``ino`` at ``version``."""
        if hints is None:
            self.hints.pop(ino, None)
        else:
            self.hints[ino] = (version, hints)

    async def send(self, row, key: str):
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
                self.stats.bytes_uploaded += sent
                self.stats.bytes_copied += copied
                return
            buf = bytearray(length)
            for i in range(first, min(first + wide, len(keys))):
                key = keys[i]
                if key == chunk.HOLE:
                    continue  # zeros already
                n = chunk.chunk_length(row.size, i)
                at = (i - first) * CHUNK_BYTES
                async with self._part_memory(key), self.host.store.lease_previous(row, i, key, n) as view:
                    buf[at:at + n] = view
            await upload.write_part(index, buf)
            self.stats.bytes_uploaded += len(buf)
        finally:
            self._wide_parts.release()

    @staticmethod
    def _part_order(n: int, parts: _PartPlan | None) -> tuple[list[int], int]:
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

    async def _upload_part(self, upload, row, key: bytes, index: int, limiter, parts: _PartPlan | None) -> None:
        try:
            length = chunk.chunk_length(row.size, index)
            if key == chunk.HOLE:  # no bytes to read: the backend keeps a hole (or copies zeros)
                sent, copied = await upload.zero_part(index, length)
                self.stats.bytes_uploaded += sent
                self.stats.bytes_copied += copied
                return
            if parts is not None:
                if await self._copy_part(upload, parts, index, key, length):
                    return
                if await self._remote_part(upload, row, parts, index, key, length):
                    return
            async with self._part_memory(key), self.host.store.lease_previous(row, index, key, length) as view:
                await upload.write_part(index, view)
            self.stats.bytes_uploaded += length
        finally:
            limiter.release()

    @asynccontextmanager
    async def _part_memory(self, key: bytes):
        """Hold one of PERSIST_PARTS_COPIED_MAX slots if the lease of ``key`` is a copy in the heap."""
        if self.pool.lends(key):
            yield  # in a buffer: uploaded from the pool's own memory
            return
        async with self._copied_parts:
            yield

    async def _part_plan(self, row, target: str, keys: list[bytes]) -> _PartPlan | None:
        """Cluster: which parts are copied server-side, waited for, or sent by other nodes."""
        if not self.host.cluster.shared:
            return None
        found = self.hints.get(row.ino)
        hints = found[1] if found is not None and found[0] == row.version else PersistHints()
        wanted = [k for k in dict.fromkeys(keys) if k != chunk.HOLE]
        known = await self.meta.chunk_sources(wanted) if wanted else {}
        sources = dict(hints.copy)
        for index, k in enumerate(keys):
            src = known.get(k)
            if index not in sources and src is not None and src.backend_key != target:
                sources[index] = CopySource(src.backend_key, src.offset, src.length, src.etag)
        return _PartPlan(hints, sources, target, time.monotonic() + CLUSTER_SOURCE_WAIT_S)

    async def _copy_part(self, upload, parts: _PartPlan, index: int, key: bytes, length: int) -> bool:
        """Dedup: materialise the part from a durable copy of its chunk; False to send bytes."""
        src = parts.sources.get(index)
        if src is None and index in parts.wait:
            self._source_wait(parts, +1)
            try:
                src = await self._wait_source(key, parts.wait_until)
            finally:
                self._source_wait(parts, -1)
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
        self.stats.bytes_copied += length
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

    async def _remote_part(self, upload, row, parts: _PartPlan, index: int, key: bytes, length: int) -> bool:
        """The plan gives this part to another node: it sends the bytes; False to send them here."""
        cluster = self.host.cluster
        node = parts.hints.persist.get(index)
        if node is None or node == cluster.owner or not getattr(self.backend, "supports_remote_parts", False):
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
        """Another node's plan gives us part ``index`` of its upload: send it from our pool (else a holder's)."""
        # Bounded here, so that no part write of ours lands after the owner
        # stopped waiting (it waits PEER_UPLOAD_PART_TIMEOUT_S and a margin).
        with trio.move_on_after(PEER_UPLOAD_PART_TIMEOUT_S) as scope:
            async with self.host.store.lease_held(key, holders, f"part {index} of {backend_key}") as view:
                if len(view) != length:
                    raise IntegrityError(f"chunk {key.hex()[:16]}… has {len(view)} bytes, the part needs {length}")
                receipt = await self.backend.write_remote_part(backend_key, token, index, view)
        if scope.cancelled_caught:
            raise TransientBackendError(f"part {index} of {backend_key}: not sent within {PEER_UPLOAD_PART_TIMEOUT_S:.0f} s")
        self.stats.bytes_uploaded += length
        self.stats.bytes_uploaded_for_peers += length
        return receipt

    async def record_sources(self, row, key: str, etag: str | None) -> None:
        """Cluster: chunks of a durable object can be copied from it (dedup later)."""
        if not self.host.cluster.shared or row.manifest is None:
            return
        keys = chunk.unpack_manifest(row.manifest)
        entries = [
            (k, i * CHUNK_BYTES, chunk.chunk_length(row.size, i))
            for i, k in enumerate(keys[: chunk.chunk_count(row.size)]) if k != chunk.HOLE
        ]
        await self.meta.record_chunk_sources(key, etag, entries)

    async def forget_sources(self, key: str) -> None:
        """Before the object at ``key`` changes: its chunks are no dedup source any more.

        (Copies are also conditional on the source's etag, so a source
        forgotten too late costs a fallback upload, never wrong bytes.)
        """
        if self.host.cluster.shared:
            await self.meta.forget_chunk_sources(key)

    def _source_wait(self, parts: _PartPlan, delta: int) -> None:
        """Count a part waiting for another file's copy; the file counts while any of its parts do."""
        before = parts.waiting
        parts.waiting += delta
        if (before == 0) != (parts.waiting == 0):
            self._on_files_waiting(1 if parts.waiting else -1)
