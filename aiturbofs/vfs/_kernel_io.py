"""Files whose bytes the kernel writes and reads itself (FUSE passthrough).

When the FUSE session hands a file's backing file to the kernel, no READ or
WRITE request reaches the daemon: the kernel writes the backing file at
memory speed.  The daemon learns what was written from the backing file
itself, at the points where POSIX lets an observer tell: flush (close),
fsync, truncate, release, and getattr (the size).  This module is that
bookkeeping.

Which opens go to the kernel (``open_kernel``), while a quarter of the pool
is free (the kernel cannot be made to wait for memory; under pressure files
are served through requests, which wait), or at any time for a file whose
backing file is on disk:

* a writer or reader of an empty file (just created, or emptied by O_TRUNC;
  older versions' chunks in its backing file move out first: ``take_range``).
  A writer's file gets its backing file on disk (``-o kernel_writes=disk``,
  the default; ``_to_disk``): the kernel writes it into the page cache,
  which writes back and frees itself, so a file larger than the staging
  tmpfs, or than DRAM, is written without ENOSPC while the disk has room.
  That while the disk has more room than the tmpfs and less than ``dram=``
  of such files waits for the backend (``_disk_has_room``); beyond that, as
  when the backend is full, new files take the paths above;
* a reader or writer of a file whose every chunk is in its own backing file
  (written or read here before), nothing served through requests open; a
  writer first moves out the chunks of versions not yet durable (they get a
  copy), since the kernel writes over them in place;
* any open of a file already open that way: the kernel refuses to mix
  passthrough and cached opens of one inode (ETXTBSY), and while a file is
  open through the kernel all its bytes are in its backing file (the pool
  neither evicts nor punches them).  It also binds every passthrough open
  of an inode to one backing file, so when the file took a newer version
  committed on another node (``Filesystem._take_latest``) the new version's
  chunks are put into that backing file first (``_catch_up``): the
  descriptors open on the old version read the new one from then on.

What the daemon does about the bytes (``absorb``): the backing file's size
is the file's size; every chunk is hashed and compared with its slot (time
stamps alone cannot say "unchanged": a write through a shared mapping moves
none); a changed chunk is sealed in place with its new
key, charged to the pool (even past the budget: the bytes are there; the
spiller makes room), and the commit that follows is the daemon's usual one.
A sealed chunk whose range the kernel may still write is *volatile* in the
pool: hashed again before anyone else reads it, never evicted or spilled.
When the last writer is gone the release hashes every chunk once more (in a
worker thread, at low priority: close() has returned by then) and trusts
the unchanged ones again; a changed one (a write after fsync, a shared
mapping) is sealed anew and committed.  It skips that second hash when
nothing can have changed since the last absorb: the same stamp, and no
O_RDWR writer (which could map the file) nor two writers at once.  The
release counts as an open until then, so a reopen waits for that check
instead of racing it.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import TYPE_CHECKING, Protocol

import trio

from .. import chunk
from .._errors import FileTooBig, NoSpace
from .._limits import HASH_INLINE_BYTES_MAX, KERNEL_CHARGE_POLL_S, PASSTHROUGH_FREE_FRACTION_MIN
from .._threads import background
from ..staging import BackingArea, BackingFile, Range, StagingPool, content_key_of, is_hole, room_in
from ._content import FileContent, Slot
from ._inodes import without_suidgid

if TYPE_CHECKING:
    from ._inodes import Handle, Inode

log = logging.getLogger(__name__)


class KernelHost(Protocol):
    """What this bookkeeping needs of the write path (``Writer`` is it)."""

    pool: StagingPool
    staging: BackingArea
    size_max: int

    def backing(self, node: Inode, content: FileContent) -> BackingFile:
        """The content's backing file (taken on first use)."""
        ...

    def let_go(self, content: FileContent) -> None:
        """The content no longer uses its backing file."""

    def punch(self, rng: Range) -> None:
        """Free a range's memory (a failure is logged)."""

    def free_slot(self, slot: Slot | None, node: Inode | None = None, *, content: FileContent | None = None,
                  index: int = 0) -> None:
        """Give back a slot's room or pin."""

    def cache_key(self, node: Inode, index: int, slot: Slot) -> bytes:
        """The pool key of a sealed or external slot's bytes."""
        ...

    async def read_slot(self, node: Inode, index: int, slot: Slot, length: int, *, cache: bool = True):
        """The bytes of a sealed or external slot (valid until the next await)."""

    def kernel_written(self) -> list[Inode]:
        """The files open for the kernel to write."""
        ...


async def open_kernel(fs: KernelHost, handle: Handle) -> int | None:
    """If the kernel may serve ``handle`` from the backing file: count it and return the backing file's descriptor."""
    node = handle.inode
    if not stat.S_ISREG(node.row.mode) or node.content is None:
        return None
    content = node.content
    backing = fs.backing(node, content)
    if backing.kernel_opens and content.kernel_behind:
        await _catch_up(fs, node, backing)
        if node.content is None:
            return None
        content = node.content
        backing = fs.backing(node, content)
    if not backing.kernel_opens:
        content.kernel_behind = False  # (the kernel holds nothing of an older version)
        empty = _empty_content(content)
        if node.served > 1 or (content.dirty and not empty):
            # open through requests already (the kernel would refuse the mix), or being written that way
            log.debug("inode %d served through requests: %s", node.ino, "open already" if node.served > 1 else "dirty")
            return None
        if handle.writable and without_suidgid(node.row.mode) != node.row.mode:
            # A writer without CAP_FSETID must kill the set-user/group-ID bits; the kernel has us do it
            # at each WRITE (FUSE_WRITE_KILL_SUIDGID) but says nothing of the writes it serves itself.
            log.debug("inode %d served through requests: a writer of a set-user/group-ID file", node.ino)
            return None
        to_disk = empty and handle.writable and _disk_has_room(fs)
        if not (to_disk or backing.on_disk) and fs.pool.free_fraction() < PASSTHROUGH_FREE_FRACTION_MIN:
            # The kernel cannot be made to wait for memory, and a file it serves keeps its chunks
            # in memory: under pressure files are served through requests, which wait while the
            # pool spills, persists and evicts.
            log.debug("inode %d served through requests: the pool is short of memory", node.ino)
            return None
        if empty:
            await _empty(fs, backing)
            if to_disk and not backing.on_disk:
                moved = await _to_disk(fs, node, content, backing)
                if moved is None:
                    return None
                backing = moved
        elif not _local(content, backing):
            log.debug("inode %d served through requests: not all its chunks are in its backing file", node.ino)
            return None
        # checked again after the awaits: another open, or a write through it, may have come meanwhile
        if not backing.kernel_opens and (node.served > 1 or not (_empty_content(content) or _local(content, backing))):
            return None
        _fit(backing, content.size)
    try:
        fd = backing.fd()
    except OSError as exc:
        log.warning("passthrough open of inode %d: backing file %s: %s", node.ino, backing.path, exc)
        return None
    if handle.writable:
        # A version not yet durable keeps its bytes: the kernel is about to write over them in place.
        backing.kernel_opens += 1  # (counted first: no open through requests slips in meanwhile)
        try:
            # Until a pass finds nothing to move: while a move waits (for memory, a spill), another
            # file may seal a chunk this file holds where the pass went by, and let its own copy go.
            # No await comes between the last pass and ``unsteady`` below.
            while await _move_pinned_out(fs, backing):
                pass
        finally:
            backing.kernel_opens -= 1
    backing.kernel_opens += 1
    node.served -= 1
    if handle.writable:
        backing.kernel_writers += 1
        if handle.flags & os.O_ACCMODE == os.O_RDWR or backing.kernel_writers > 1:
            content.kernel_rdwr = True  # (several writers: one may write while another's close hashes)
        for rng in backing.ranges():
            fs.pool.unsteady(rng)  # the kernel may change them now
    handle.kernel = True
    content.absorbed = _stamp(os.fstat(backing.fd()))
    return fd


async def _move_pinned_out(fs: KernelHost, backing: BackingFile) -> bool:
    """Move the chunks other versions still count on (pinned, not spilled) out of ``backing``'s ranges;
    whether there were any (the moves wait: look again)."""
    moved = False
    for rng in backing.ranges():
        e = rng.entry
        if e is not None and e.pins and not e.spilled:
            charge, _, _ = await fs.pool.take_range(rng)
            fs.pool.unreserve(charge)
            moved = True
    return moved


def _disk_has_room(fs: KernelHost) -> bool:
    """Whether a new file the kernel writes goes to disk: where the disk directory's filesystem has more room
    than the staging tmpfs (a small spill disk would fill before the tmpfs would), and while the pool lets
    files stage there (``may_stage_on_disk``: writers wait for persist like any other beyond that)."""
    return (fs.staging.disk_directory is not None and fs.pool.may_stage_on_disk()
            and fs.staging.disk_free_bytes() >= fs.pool.budget_bytes)


async def _to_disk(fs: KernelHost, node: Inode, content: FileContent, backing: BackingFile) -> BackingFile | None:
    """Give the empty ``content`` a backing file on disk in place of ``backing`` (emptied already); None if the
    file changed meanwhile (another open came, or another version): then it is served through requests."""
    disk = fs.staging.file(node.ino, on_disk=True)
    disk.users += 1  # (held while chunks an earlier run of this inode left there move out)
    try:
        await _empty(fs, disk)
    finally:
        disk.users -= 1
    if (node.content is not content or content.backing is not backing or backing.kernel_opens or disk.kernel_opens
            or node.served > 1 or not _empty_content(content)):
        fs.staging.release(disk)
        return None
    fs.let_go(content)
    content.backing = disk
    disk.users += 1
    return disk


async def _catch_up(fs: KernelHost, node: Inode, backing) -> None:
    """Put the file's content, a newer version, into the backing file the kernel serves to descriptors open on an
    older one, before another open joins them (the kernel binds all passthrough opens of an inode to one backing
    file: the old descriptors read the new version from then on).

    Raises what a read of a chunk raises (EIO, logged); see ``_load`` for what the backing file holds then.
    """
    while (content := node.content) is not None and content.kernel_behind and backing.kernel_opens:
        async with content.lock:  # (a second open waits here, and joins once the bytes are there)
            if node.content is content and content.kernel_behind and backing.kernel_opens:
                if await _load(fs, node, content, backing):
                    content.kernel_behind = False
                    log.info("inode %d: the kernel serves version %d to the descriptors open here",
                             node.ino, node.row.version)


async def _load(fs: KernelHost, node: Inode, content: FileContent, backing) -> bool:
    """Every chunk of ``content`` into its range of ``backing``; False if the file took yet another version meanwhile.

    The chunks not there yet are read once before the first range changes
    (into the pool, where it has room), so a chunk nobody has fails the open
    with the backing file as it was; only one lost between that read and
    the second can leave part of each version there.  A range
    changes in one step with no await in it (its old entry out, the new
    bytes in, a clean entry of them), so a newer version's ``_load`` that
    starts meanwhile cannot interleave with this one: this one stops.
    """
    n = chunk.chunk_count(content.size)
    missing: list[tuple[int, Slot | None, int]] = []
    for index in range(n):
        slot = content.slot_at(index)
        e = backing.range(index).entry
        length = chunk.chunk_length(content.size, index)
        if slot is None:
            if e is not None or not is_hole(backing.fd(), backing.range(index).offset, length):
                missing.append((index, slot, length))
        elif e is None or e.key != fs.cache_key(node, index, slot) or e.length != length:
            missing.append((index, slot, length))
    for index, slot, length in missing:  # first read: into the pool, where it has room
        if slot is not None:
            await fs.read_slot(node, index, slot, length, cache=False)
    for index, slot, length in missing:
        rng = backing.range(index)
        data = None if slot is None else bytes(await fs.read_slot(node, index, slot, length, cache=False))
        need = 0 if slot is None else room_in(rng, length)
        if need:
            await fs.pool.reserve(need)
        charge, _, _ = await fs.pool.take_range(rng)
        fs.pool.unreserve(charge)
        if node.content is not content:
            fs.pool.unreserve(need)
            return False
        if slot is None or data is None:
            fs.punch(rng)  # a hole: zeros
            continue
        try:
            rng.pwrite(0, data)
        except OSError as exc:
            fs.pool.unreserve(need)
            raise NoSpace(f"staging area {fs.staging.directory}: {exc.strerror}", errno_=exc.errno) from exc
        fs.pool.adopt_range(fs.cache_key(node, index, slot), rng, length, need, pin=False)
    for rng in backing.ranges():
        if rng.index >= n and rng.entry is not None:
            charge, _, _ = await fs.pool.take_range(rng)
            fs.pool.unreserve(charge)
    if node.content is not content:
        return False
    _fit(backing, content.size)
    return True


def _empty_content(content) -> bool:
    return content.size == 0 and not any(s is not None for s in content.slots)


def _local(content, backing) -> bool:
    """Whether every chunk of the file is in its own backing file (and nothing else is there)."""
    n = chunk.chunk_count(content.size)
    for index in range(n):
        slot = content.slot_at(index)
        rng = backing.range(index)
        e = rng.entry
        if slot is None:
            # a hole: the kernel reads the range, which must be one (stale bytes there are no one's)
            if e is not None or not is_hole(backing.fd(), rng.offset, chunk.chunk_length(content.size, index)):
                return False
            continue
        if slot.is_open or slot.key is None or e is None or e.key != slot.key or e.length != chunk.chunk_length(content.size, index):
            return False
    return not any(r.entry is not None for r in backing.ranges() if r.index >= n)


def _fit(backing, size: int) -> None:
    """The kernel reads and writes the backing file to its end: make that the file's end."""
    fd = backing.fd()
    if os.fstat(fd).st_size != size:
        os.ftruncate(fd, size)


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    """What says a backing file changed: its size, mtime and ctime (see ``close_kernel`` for when it may be trusted)."""
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


async def _empty(fs: KernelHost, backing) -> None:
    """Move every chunk out of ``backing`` (pinned ones keep a copy) and cut it to 0 bytes."""
    for rng in backing.ranges():
        charge, _, _ = await fs.pool.take_range(rng)
        fs.pool.unreserve(charge)
        rng.writing = False
    os.ftruncate(backing.fd(), 0)


def being_written(node: Inode) -> bool:
    """Whether the kernel may be writing the file now (a passthrough writer is open)."""
    content = node.content
    return content is not None and content.backing is not None and content.backing.kernel_writers > 0


def kernel_attrs(node: Inode) -> tuple[int, int | None] | None:
    """(size, mtime) of a file the kernel is writing: its backing file's; mtime None if nothing
    was written since the last absorb (the row's then stands: a utimensat since counts)."""
    content = node.content
    if content is None or content.backing is None or not being_written(node):
        return None
    try:
        st = os.fstat(content.backing.fd())
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns if _stamp(st) != content.absorbed else None


def stamp_kernel_mtime(node: Inode, mtime_ns: int) -> None:
    """A utime of a file the kernel is writing: its backing file takes the mtime, no chunk is hashed.

    The kernel's writes before it then carry it (the next absorb sets the
    file's mtime from the backing file's), and a write after it moves it
    again, as on a local filesystem.
    """
    content = node.file
    assert content.backing is not None  # (being written)
    fd = content.backing.fd()
    os.utime(fd, ns=(os.fstat(fd).st_atime_ns, mtime_ns))


async def absorb(fs: KernelHost, node: Inode, *, verify: bool = False) -> None:
    """Take what the kernel wrote into the backing file into the file's slots (see module doc).

    Every chunk is hashed (worker threads) and compared with what its slot
    says; a chunk that differs is sealed with its new key and handed to the
    pool in place (its old entry there let go), and the file is dirty for the
    commit that follows.  Time stamps alone cannot say "unchanged" (a write
    through a shared mapping moves none; see ``close_kernel`` for when they may).
    ``verify`` (the last writer is gone): at low priority, and the chunks
    found unchanged are trusted again (``steady``).

    Callers other than the last writer's release check ``being_written``
    first, but may then wait for the lock while that release runs: once no
    passthrough writer is left there is nothing of the kernel's to take (the
    release checked every chunk), and the backing file is no longer the
    file's bytes (a chunk the pool keeps elsewhere was punched there), so it
    is looked at only with the lock held and a writer still open.
    """
    content = node.file
    changed = False
    async with content.lock:
        backing = content.backing
        if backing is None or not (verify or being_written(node)):
            return
        fs.pool.unreserve(content.kernel_charged)  # the slots count the bytes now (below)
        content.kernel_charged = 0
        st = os.fstat(backing.fd())
        size = st.st_size
        if size > fs.size_max:
            raise FileTooBig(f"a file of {size} bytes exceeds {fs.size_max}, the most the backend can hold")
        changed = size != content.size
        for index in range(chunk.chunk_count(size)):
            length = chunk.chunk_length(size, index)
            slot = content.slot_at(index)
            rng = content.range(index)
            if slot is None and is_hole(backing.fd(), rng.offset, length):
                continue  # still a hole (a sparse file's gigabytes cost an lseek each)
            if length <= HASH_INLINE_BYTES_MAX:
                # here, as the writer's seal does: a thread hop costs more than hashing a small chunk
                # (a small file's flush waited 0.3-1 ms for it on a busy 2-core host)
                key = content_key_of(backing.path, rng.offset, length)
            elif verify:  # after close() returned: at low priority
                key = await trio.to_thread.run_sync(background, content_key_of, backing.path, rng.offset, length)
            else:
                key = await trio.to_thread.run_sync(content_key_of, backing.path, rng.offset, length)
            was = chunk.HOLE if slot is None else slot.key
            if key == was and chunk.chunk_length(content.size, index) == length:
                if verify and backing.kernel_writers <= 1:  # (only the one closing: none came back meanwhile)
                    fs.pool.steady(rng)
                continue
            if slot is not None and slot.key is not None and verify:
                log.info("chunk %d of inode %d changed after it was sealed (a passthrough write): sealed again",
                         index, node.ino)
            _reseal(fs, node, content, index, key, length)
            if verify and backing.kernel_writers <= 1:
                # hashed with no writer left to change it, like an unchanged one: trusted (else the
                # release's end lets it go as unchecked, and the commit that follows names lost bytes)
                fs.pool.steady(rng)
            changed = True
        content.size = size
    if changed:
        content.seq += 1
        node.row.mtime_ns = st.st_mtime_ns
    # taken before hashing: a write meanwhile moves it (getattr's mtime is the row's until it moves)
    content.absorbed = _stamp(st)


def _reseal(fs: KernelHost, node: Inode, content, index: int, key: bytes, length: int) -> None:
    """Chunk ``index`` now holds the bytes of ``key``, there in its range: seal it so (pinned, as a write's seal)."""
    rng = content.range(index)
    charge = fs.pool.disown_range(rng)  # an entry of the old bytes no longer has them here
    content.ensure_slots(index)
    old = content.slots[index]
    if old is not None and old.is_open:
        charge, old.charge = charge + old.charge, 0
    rng.writing = False
    if key == chunk.HOLE:
        fs.pool.unreserve(charge)
        content.slots[index] = None  # zeros: a hole (punched once no writer can race the punch)
    else:
        need = room_in(rng, length)
        if charge < need:
            fs.pool.charge_present(need - charge)
        elif charge > need:
            fs.pool.unreserve(charge - need)
        content.slots[index] = Slot(key=key, pinned=True)
        fs.pool.adopt_range(key, rng, length, need)
    if old is not None and not old.is_open:
        fs.free_slot(old, node, content=content, index=index)


async def close_kernel(fs: KernelHost, handle: Handle) -> None:
    """``handle``, served by the kernel, is released (before the file's release commits).

    It counts as open until the check of the last writer's chunks is done:
    an open meanwhile (an O_TRUNC rewrite at once) then goes to the kernel
    too, and waits for the check before it cuts the file.
    """
    node = handle.inode
    content = node.content
    handle.kernel = False
    if content is None or content.backing is None:
        return
    backing = content.backing
    try:
        if handle.writable and backing.kernel_writers == 1 and node.row.nlink > 0:
            if content.kernel_rdwr or _stamp(os.fstat(backing.fd())) != content.absorbed:
                await absorb(fs, node, verify=True)
                content.kernel_rdwr = False
            else:
                # Nothing written since the last absorb hashed every chunk: its stamp (taken before it
                # hashed, and so marking the ctime as seen: the next write gets a fine-grained one) is
                # the same, and no open could map the file for writing.
                for rng in backing.ranges():
                    fs.pool.steady(rng)
    finally:
        backing.kernel_opens -= 1
        if handle.writable:
            backing.kernel_writers -= 1
    if handle.writable and not backing.kernel_writers:
        fs.pool.unreserve(content.kernel_charged)
        content.kernel_charged = 0
        for rng in backing.ranges():  # what was not checked (an unlinked file) is not trusted
            e = rng.entry
            if e is not None and e.volatile:
                fs.pool.unreserve(fs.pool.disown_range(rng))
    if not backing.kernel_opens:
        for rng in backing.ranges():
            slot = content.slot_at(rng.index)
            if rng.entry is None and (slot is None or slot.key is not None):
                fs.punch(rng)  # zeros, or a chunk the pool has elsewhere: the copy here was the kernel's


async def run_charger(fs: KernelHost) -> None:
    """Count what the kernel writes into open files against the pool while it writes.

    The kernel writes passthrough files without asking; counted only at
    flush, a large file would fill the staging tmpfs before the pool knew
    to make room.  Every KERNEL_CHARGE_POLL_S the bytes each such backing
    file allocates beyond what its slots count are charged (the pool then
    evicts clean chunks and spills pinned ones of other files).
    """
    while True:
        await trio.sleep(KERNEL_CHARGE_POLL_S)
        for node in {n.ino: n for n in fs.kernel_written()}.values():  # (one per file, not per open)
            content = node.content
            if content is None or content.backing is None or content.backing.on_disk:
                continue  # (on disk: the page cache holds it, not the pool)
            try:
                allocated = os.fstat(content.backing.fd()).st_blocks * 512
            except OSError:
                continue
            # counted already: its entries here (sealed by an absorb) and open slots
            counted = (sum(r.entry.charge for r in content.backing.ranges() if r.entry is not None)
                       + sum(s.charge for s in content.slots if s is not None and s.is_open))
            delta = allocated - counted - content.kernel_charged
            if delta > 0:
                fs.pool.charge_present(delta)
                content.kernel_charged += delta
