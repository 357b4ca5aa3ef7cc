"""The write path (future 0): a file's bytes while it is written, sealing, and the commit.

``write`` copies into the file's backing file (a tmpfs, ``staging._backing``),
into an open chunk whose room the pool has counted; a chunk that fills up is
hashed in a worker thread and sealed into the pool in place while the writer
goes on (one of all zeros becomes a hole: no memory).  ``commit`` seals the
rest, has the cluster port place the chunks, records the manifest (ordered
chunk hashes, size, state ``staged``) in the metadata engine and hands the
file to the persister (future 1).  The bytes a passthrough writer's kernel
wrote are taken in by ``_kernel_io.absorb`` first, over this writer.

The writer also keeps the pins: a slot sealed since the last commit holds
one, a commit hands them to its version (``VersionPins``), and a durable or
broken version lets them go (``release_pins``).
"""

import logging
import os
import time

import trio

from .. import chunk
from .._errors import FileTooBig, NoSpace
from .._limits import CHUNK_BITS, CHUNK_BYTES, HASH_INLINE_BYTES_MAX, SEAL_QUEUE_MAX
from .._threads import background
from ..cluster import ClusterPort, StageRequest
from ..meta import ROOT_INO, STATE_STAGED, MetaStore
from ..persist import Persister
from ..staging import BackingArea, BackingFile, Pins, Range, StagingPool, content_key_of, punch_hole, room
from ._content import FileContent, Slot, VersionPins, backing_of, let_go, punch
from ._inodes import Inode, InodeTable
from ._kernel_io import being_written
from ._reader import Reader

log = logging.getLogger(__name__)


class Writer:
    """Slots, room, sealing and commits of the files written on this node (see module doc)."""

    def __init__(self, table: InodeTable, meta: MetaStore, pool: StagingPool, staging: BackingArea,
                 cluster: ClusterPort, reader: Reader, persister: Persister, *, size_max: int):
        self.table = table
        self.pool = pool
        self.staging = staging
        # The largest file a write or truncate may make: what the backend can
        # hold (S3: 5 TiB), refused at once (EFBIG) rather than broken at persist.
        self.size_max = size_max
        self._meta = meta
        self._cluster = cluster
        self._reader = reader
        self._persister = persister
        self._seal_send, self._seal_recv = trio.open_memory_channel(SEAL_QUEUE_MAX)

    # ------------------------------------------------ what _kernel_io asks of it
    def backing(self, node: Inode, content: FileContent) -> BackingFile:
        return backing_of(self.staging, node.ino, content)

    def let_go(self, content: FileContent) -> None:
        let_go(self.staging, content)

    def punch(self, rng: Range) -> None:
        punch(rng)

    def kernel_written(self) -> list[Inode]:
        return self.table.kernel_written()

    def cache_key(self, node: Inode, index: int, slot: Slot) -> bytes:
        return self._reader.cache_key(node, index, slot)

    async def read_slot(self, node: Inode, index: int, slot: Slot, length: int, *, cache: bool = True):
        return await self._reader.read_slot(node, index, slot, length, cache=cache)

    # ----------------------------------------------------------------- slots
    def free_slot(self, slot: Slot | None, node: Inode | None = None, *, content: FileContent | None = None,
                  index: int = 0) -> None:
        """Give back a slot's room or pin.

        An open slot's range (chunk ``index`` of ``content``) is punched.  The
        pin of a slot sealed since the last commit is released, unless a
        commit is in flight that may name the chunk: it joins that version's pins.
        """
        if slot is None:
            return
        if slot.is_open:
            charge, slot.charge = slot.charge, 0
            slot.seq += 1  # invalidates a sealer working on it
            if content is None and node is not None:
                content = node.content
            if content is not None and content.backing is not None:
                rng = content.range(index)
                rng.writing = False
                punch(rng)
            self.pool.unreserve(charge)
        elif slot.pinned:
            assert slot.key is not None  # a pin is on a sealed chunk
            slot.pinned = False
            if content is None and node is not None:
                content = node.content
            if content is not None and content.committing is not None:
                content.committing.append(slot.key)
            else:
                self.pool.unpin(slot.key)

    def has_pins(self, node: Inode) -> bool:
        """Whether the inode holds pins: of committed versions, or of slots sealed since the last commit."""
        content = node.content
        return bool(node.pins) or (content is not None and any(s is not None and s.pinned for s in content.slots))

    def drop_content(self, node: Inode) -> None:
        """Let go of everything the inode's content holds: pins, room, its backing file."""
        self.release_pins(node, None)
        content, node.content = node.content, None
        if content is None:
            return
        for i, slot in enumerate(content.slots):
            self.free_slot(slot, content=content, index=i)
            content.slots[i] = None
        let_go(self.staging, content)

    async def release_unused(self, node: Inode) -> None:
        """Free an inode nobody references (no kernel reference, no open): data of unlinked files goes here."""
        if node.lookups or node.opens or node.ino == ROOT_INO:
            return
        if node.row.nlink == 0:
            self.drop_content(node)
            self.table.forget(node.ino)
            self._persister.enqueue(node.ino, moved=True)  # deletes backend copies, then the row
            return
        content = node.content
        if (content is not None and content.dirty) or self.has_pins(node):
            return  # still staged: keep the slots (and their pins) in memory
        if content is not None:
            let_go(self.staging, content)  # what it cached stays in the pool, evictable
        self.table.forget(node.ino)

    def release_pins(self, node: Inode, upto: int | None) -> None:
        """Release the pins of committed versions <= ``upto`` (all of them with None)."""
        keep = []
        for version in node.pins:
            if upto is None or version.version <= upto:
                version.pins.release()
            else:
                keep.append(version)
        node.pins = keep

    def _take_pins(self, node: Inode, content: FileContent, version: int, manifest: bytes, extra: list[bytes]) -> None:
        """After commit of ``version``: the slots' pins (and ``extra``) become the version's.

        A chunk it shares with an older version still pinned gets a pin of
        its own: that older version may turn broken and let its pins go
        while this one still needs the bytes.
        """
        keys = list(extra)
        for slot in content.slots:
            if slot is not None and slot.pinned:
                assert slot.key is not None
                keys.append(slot.key)
                slot.pinned = False
        pins = Pins(self.pool, keys)
        if node.pins:
            older = {k for v in node.pins for k in v.pins.keys}
            for k in (set(chunk.unpack_manifest(manifest)) & older) - set(keys):
                pins.add(k)
        node.pins.append(VersionPins(version, pins))

    # ---------------------------------------------------------------- writes
    async def write(self, node: Inode, offset: int, data) -> int:
        content = node.file
        length = len(data)
        if offset + length > self.size_max:
            raise FileTooBig(f"write past {self.size_max} bytes, the most the backend can hold")
        if offset >= content.size and content.size % CHUNK_BYTES:
            last = (content.size - 1) // CHUNK_BYTES
            slot = content.slot_at(last)
            if last < offset // CHUNK_BYTES and slot is not None and not slot.is_open:
                # The write skips the old short tail chunk, which now grows to a
                # full chunk of zeros: reopen it, as a growing truncate does (its
                # sealed hash covers only the old length: the upload failed and
                # the file was marked broken).
                await self._writable_slot(node, content, last, 0)
        view = memoryview(data)
        for index, start, count, done in chunk.spans(offset, length):
            slot = content.slot_at(index)
            end = start + count
            if slot is None or slot.charge < room(end, index):
                slot = await self._writable_slot(node, content, index, end)
            try:
                content.range(index).pwrite(start, view[done : done + count])
            except OSError as exc:
                raise NoSpace(f"staging area {self.staging.directory}: {exc.strerror}", errno_=exc.errno) from exc
            if end > slot.filled:
                slot.filled = end
            slot.seq += 1
            # The size grows with each span, before the next span may wait for
            # memory: a sealer started on this chunk meanwhile hashes
            # chunk_length(size) bytes, and a size still short of the span's
            # end sealed a short chunk under a full-length file (its upload
            # then failed as a wrong-length part).
            if index * CHUNK_BYTES + end > content.size:
                content.size = index * CHUNK_BYTES + end
            if end == CHUNK_BYTES and slot.filled == CHUNK_BYTES:
                self._seal_soon(node, index, slot)
        content.seq += 1
        node.row.mtime_ns = now_ns()
        return length

    async def zero_range(self, node: Inode, content: FileContent, offset: int, end: int) -> None:
        """Make ``[offset, end)`` (inside the file) read as zeros."""
        if offset >= end:
            return
        if being_written(node):
            # The kernel writes the backing file itself, which holds every chunk while it does:
            # punched there, the change is the kernel's kind, taken in by the next absorb.
            assert content.backing is not None
            punch_hole(content.backing.fd(), offset, end - offset)  # (metadata only: no thread)
            return
        for index, start, count, _ in chunk.spans(offset, end - offset):
            if count < chunk.chunk_length(content.size, index):
                if content.slot_at(index) is not None:  # (a hole reads as zeros already)
                    await self.write(node, index * CHUNK_BYTES + start, bytes(count))
                continue
            async with content.lock:  # after a slot replacement in flight, not under it
                slot = content.slot_at(index)
                if slot is None:
                    continue
                content.slots[index] = None  # a hole
                self.free_slot(slot, node, content=content, index=index)
                content.seq += 1
                if content.backing is not None and content.backing.kernel_opens:
                    # The kernel reads this range as the file: the pool's entry there moves out first.
                    rng = content.range(index)
                    await self._take_out(rng)
                    rng.punch()
        node.row.mtime_ns = now_ns()

    async def _writable_slot(self, node: Inode, content: FileContent, index: int, end: int) -> Slot:
        """An open slot at ``index`` with room for ``end`` bytes (may wait for memory).

        The slot's bytes are chunk ``index``'s range of the backing file.  If
        the pool's entry of the chunk's current bytes is in that range, it is
        moved out (``take_range``: copied first if a version not yet durable
        needs it) and the bytes stay; otherwise they are read in.
        """
        async with content.lock:
            content.ensure_slots(index)
            slot = content.slots[index]
            if slot is not None and slot.is_open:
                return await self._grow(content, index, slot, end)
            need = room(max(end, chunk.chunk_length(content.size, index)), index)
            rng = self.backing(node, content).range(index)
            charge, kept, kept_length = await self.pool.take_range(rng)
            rng.writing = True  # from now on no read-ahead caches a chunk here
            try:
                if charge < need:
                    await self._reserve(content, index, need - charge)
                    charge = need
                if charge >= CHUNK_BYTES and not rng.file.kernel_opens:  # (its size is the file's then)
                    rng.open_for_writing()
                # A truncate (which takes no lock) may have shortened the slots while we waited.
                content.ensure_slots(index)
                slot = content.slots[index]  # may have changed while we waited
                if slot is not None and slot.is_open:
                    self.pool.unreserve(charge)
                    charge = 0
                    return await self._grow(content, index, slot, end)
                valid = chunk.chunk_length(content.size, index)
                if slot is not None and kept is not None and kept == self.cache_key(node, index, slot):
                    filled = min(kept_length, valid)
                    if filled < kept_length:
                        rng.punch(filled)  # a truncate cut the chunk meanwhile
                else:
                    if kept is not None or rng.file.size > rng.offset:
                        rng.punch()  # another version's bytes
                    filled = await self._fill_from(node, index, slot, rng, valid)
            except BaseException:
                self.pool.unreserve(charge)
                rng.writing = False
                raise
            content.ensure_slots(index)
            slot = content.slots[index]
            new = Slot(charge=charge)
            # (a truncate during the fill's await cut the chunk: its old bytes past the cut are gone)
            new.filled = min(filled, chunk.chunk_length(content.size, index))
            if new.filled < filled:
                rng.punch(new.filled)
            content.slots[index] = new
            self.free_slot(slot, node, content=content, index=index)
            return new

    async def _grow(self, content: FileContent, index: int, slot: Slot, end: int) -> Slot:
        """Room in open slot ``index`` for ``end`` bytes (and the chunk's current length)."""
        need = room(max(end, chunk.chunk_length(content.size, index)), index)
        if slot.charge < need:
            await self._reserve(content, index, need - slot.charge)
            slot.charge = need
        return slot

    async def _reserve(self, content: FileContent, index: int, n: int) -> None:
        """Room for ``n`` more bytes of chunk ``index``; when the pool is full, first seal the open chunks of open files.

        A chunk written in part stays open (its room outside the pool's
        reach) until close seals it: random writes over more chunks than the
        budget holds (scattered copies into a sparse file) waited forever.
        Sealed, they are pinned entries like full chunks, which the pool
        spills under pressure; a later write reopens them from there.
        """
        if await self.pool.reserve(n, wait=False):
            return
        for handle in self.table.handles():
            other = handle.inode.content
            if other is None:
                continue
            # Not a file's last chunk: the next write past EOF may grow it,
            # and a chunk sealed short would then be a wrong-length part.
            for i, slot in enumerate(other.slots[: chunk.chunk_count(other.size) - 1]):
                if slot is not None and slot.is_open and not (other is content and i == index):
                    await self._seal(other, i, slot)
        await self.pool.reserve(n)

    async def _fill_from(self, node: Inode, index: int, slot: Slot | None, rng: Range, valid: int) -> int:
        """Write the current bytes of chunk ``index`` into its range; returns bytes filled."""
        if slot is None or valid == 0:
            return 0
        assert not slot.is_open  # an open slot's bytes are in its range already
        data = await self._reader.read_slot(node, index, slot, valid, cache=False)
        try:
            rng.pwrite(0, data)
        except OSError as exc:
            raise NoSpace(f"staging area {self.staging.directory}: {exc.strerror}", errno_=exc.errno) from exc
        return len(data)

    async def truncate(self, node: Inode, content: FileContent, size: int) -> None:
        if size == content.size:
            content.seq += 1
            return
        keep = chunk.chunk_count(size)
        if size < content.size:
            tail = size - ((keep - 1) * CHUNK_BYTES) if keep else 0
            if keep and tail < CHUNK_BYTES:
                slot = content.slot_at(keep - 1)
                if slot is not None and not slot.is_open:
                    slot = await self._writable_slot(node, content, keep - 1, 0)
                if slot is not None and slot.filled > tail:
                    content.range(keep - 1).punch(tail)  # the range past the cut reads as zeros again
                    slot.filled = tail
                    slot.seq += 1
            for i, slot in enumerate(content.slots[keep:], start=keep):
                self.free_slot(slot, node, content=content, index=i)
            del content.slots[keep:]
        else:
            last = chunk.chunk_count(content.size) - 1
            slot = content.slot_at(last) if last >= 0 else None
            if slot is not None and not slot.is_open and chunk.chunk_length(content.size, last) < CHUNK_BYTES:
                # the sealed tail chunk grows: its bytes change (zeros appended)
                await self._writable_slot(node, content, last, 0)
        content.size = size
        content.seq += 1

    async def cut_backing(self, content: FileContent, size: int) -> None:
        """A file the kernel serves was truncated: so is its backing file (the kernel reads it to its end).

        Entries in the ranges past the cut move out first (``take_range``: a
        version not yet durable keeps a copy).
        """
        backing = content.backing
        assert backing is not None
        first = size >> CHUNK_BITS
        for rng in backing.ranges():
            if rng.index >= first:
                await self._take_out(rng)
        os.ftruncate(backing.fd(), size)
        content.absorbed = None

    async def _take_out(self, rng: Range) -> None:
        """The pool's entry in ``rng`` (if any) moves out before the range is cut or punched under the
        kernel (``take_range``: a version not yet durable keeps a copy); its charge is given back."""
        if rng.entry is not None:
            charge, _, _ = await self.pool.take_range(rng)
            self.pool.unreserve(charge)

    # ---------------------------------------------------------------- sealing
    def _seal_soon(self, node: Inode, index: int, slot: Slot) -> None:
        try:
            self._seal_send.send_nowait((node, index, slot, slot.seq))
        except trio.WouldBlock:
            pass  # sealed at commit instead

    async def run_sealer(self) -> None:
        """Seal the chunks writes filled, ahead of the close that would seal them (at low priority)."""
        async for node, index, slot, seq in self._seal_recv:
            content = node.content
            if content is None or content.slot_at(index) is not slot or slot.seq != seq or not slot.is_open:
                continue
            await self._seal(content, index, slot, urgent=False)

    async def _seal(self, content: FileContent, index: int, slot: Slot, *, urgent: bool = True) -> bool:
        """Hash an open slot and hand its range to the pool; False if it changed meanwhile."""
        if not slot.is_open:
            return slot.key is not None  # sealed meanwhile by the other sealer
        length = chunk.chunk_length(content.size, index)
        if length > slot.charge:
            return False  # needs more room: the caller reserves it
        seq = slot.seq
        rng = content.range(index)
        if length > HASH_INLINE_BYTES_MAX:
            # the sealer works ahead at low priority; close()/fsync wait on it
            path, at = rng.file.path, rng.offset
            try:
                if urgent:
                    key = await trio.to_thread.run_sync(content_key_of, path, at, length)
                else:
                    key = await trio.to_thread.run_sync(background, content_key_of, path, at, length)
            except FileNotFoundError:
                return False  # the file is gone (unlinked and dropped meanwhile)
        else:
            key = chunk.content_key(rng.pread(0, length))
        if content.slot_at(index) is not slot or slot.seq != seq or not slot.is_open or chunk.chunk_length(content.size, index) != length:
            return False
        if key == chunk.HOLE:
            # written as zeros: a hole like one never written (no pool memory,
            # no spill, no backend blocks)
            content.slots[index] = None
            self.free_slot(slot, content=content, index=index)
            return True
        charge, slot.charge = slot.charge, 0
        slot.key = key
        slot.pinned = True
        self.pool.adopt_range(key, rng, length, charge)
        return True

    async def _seal_all(self, node: Inode, content: FileContent) -> None:
        while True:
            pending = [(i, s) for i, s in enumerate(content.slots[: chunk.chunk_count(content.size)]) if s is not None and s.is_open]
            if not pending:
                return
            for index, slot in pending:
                if not await self._seal(content, index, slot) and content.slot_at(index) is slot and slot.is_open:
                    if chunk.chunk_length(content.size, index) > slot.charge:
                        await self._writable_slot(node, content, index, chunk.chunk_length(content.size, index))

    # ----------------------------------------------------------------- commit
    async def commit(self, node: Inode, *, sync: bool = False) -> None:
        """Future 0: seal every chunk and commit the manifest as ``staged``.

        ``sync`` (fsync): the commit is on disk when this returns.  Without
        it (close) a host crash may lose the commit, as it loses the DRAM
        bytes; the sync of the file's durable state covers it (docs/design.md,
        "What needs an fsync of the metadata").
        """
        content = node.file
        while content.dirty:
            seq = content.seq
            await self._seal_all(node, content)
            if content.seq != seq:
                continue
            # Sealed slots that are not pinned hold chunks the backend already
            # has (unchanged since the last durable version): the persister
            # fetches them from there if the pool has evicted them.
            manifest = content.manifest()
            freed: list[bytes] = []
            content.committing = freed
            row = None
            try:
                request = await self._stage_request(node, content, manifest)
                placed = await self._cluster.stage(request)
                if content.seq == seq:  # else written meanwhile: seal and place the new bytes
                    row = await self._meta.commit_manifest(
                        node.ino, size=content.size, manifest=manifest, state=STATE_STAGED, mtime_ns=node.row.mtime_ns,
                        sync=sync, owner=self._cluster.owner, holders=placed.holders,
                    )
            finally:
                content.committing = None
                if row is None:
                    for key in freed:
                        self.pool.unpin(key)  # nothing committed names them
            if row is None:
                continue
            self._take_pins(node, content, row.version, manifest, freed)
            content.committed_seq = seq
            node.row = row
            log.info("staged ino=%d version=%d size=%d holders=%s", node.ino, row.version, row.size,
                     ",".join(placed.holders) or "local")
            self.table.notify_state(node.ino)
            self._persister.set_hints(node.ino, row.version, placed.hints)
            self._persister.enqueue(node.ino)
            await self._cluster.committed(request, row.version)

    async def _stage_request(self, node: Inode, content: FileContent, manifest: bytes) -> StageRequest:
        """What the cluster port places before close() returns (a grouped file's path goes in its round report)."""
        group, group_size = await self.table.grouping(node)
        return StageRequest(
            ino=node.ino, path=await self.table.path(node.ino) if group is not None else "", size=content.size,
            manifest=manifest, group=group, group_size=group_size,
        )


def now_ns() -> int:
    return time.time_ns()
