"""Backing files: where the bytes of files being written, or cached, live.

Each regular file whose bytes are on this node has one backing file,
``DIR/<ino>``, in the staging area (by default a directory on the DRAM tmpfs
``/dev/shm``, so it costs DRAM, not disk).  Chunk ``i`` of the file is the
byte range ``[i * CHUNK_BYTES, (i + 1) * CHUNK_BYTES)`` of its backing file:
a ``Range``.  Writes are ``pwrite`` into it, reads ``pread`` from it; ranges
never written are holes and read as zeros, and a range whose bytes are no
longer wanted is hole-punched, which gives its memory back.

A chunk this node keeps for a peer's file (a replica) has a backing file of
its own, ``DIR/r<digest hex>``, with the chunk at offset 0: the receiver
knows the chunk's digest, not the file's layout.

A file the kernel writes itself (FUSE passthrough) cannot be made to wait
for memory, so its bytes could outgrow the tmpfs: such a file gets its
backing file on a local disk instead, ``DISK_DIR/<ino>`` (``on_disk``; the
area's ``disk_directory``, by default in the spill dir).  A new one there is
a spare empty file linked to its name (``SpareFiles``: a thread makes them
ahead): creating a file allocates an inode, which on a busy disk (journal
commits under writeback) or a slow one costs up to a millisecond on the
trio thread, for every small file written (1 ms per create measured in
/tmp of the development VM, 0.02 ms per link).  The kernel's page
cache holds it and writes it back; it costs the pool nothing (``room_in``
in ``_pool``).  For a moment after a crash an inode may have a backing file
in both places: ``existing`` lists both.

The staging area outlives the daemon: after a kill -9 the next start finds
the backing file of every staged file, and every replica, and recovers the
chunks that still hash to the manifest (a replica: to its name).  A host reboot empties a tmpfs (see docs/design.md,
"What a crash can lose").

This module knows nothing of the pool or of manifests: it keeps files and
ranges.  A range records which pool entry, if any, has its bytes there
(``Range.entry``), so the pool and the file that owns the range agree on
who may change it.  Everything runs on the trio thread; reads and writes of
a tmpfs are memory copies, which cost less than a thread hop.
"""

import collections
import contextlib
import ctypes
import errno
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from .. import chunk
from .._limits import BACKING_FDS_OPEN_MAX, BACKING_SPARES, CHUNK_BITS, CHUNK_BYTES, HASH_BYTES
from .._syscalls import (
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    MS_NODEV,
    MS_NOSUID,
    MS_REMOUNT,
    is_mount_point,
    mount,
    unmount_lazy,
)

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def mount_tmpfs(directory: str, size_bytes: int) -> str | None:
    """Mount a tmpfs of ``size_bytes`` with huge pages on ``directory``; None if done, else why not.

    Huge pages (``huge=within_size``) make writes into fresh pages about 4x
    faster than a plain tmpfs (one allocation per 2 MiB instead of per
    4 KiB).  A mount a crashed run left is kept (its files are the staged
    data) and resized.  Needs CAP_SYS_ADMIN.
    """
    opts = f"size={size_bytes},huge=within_size,mode=0700"
    if is_mount_point(directory):
        e = mount("aiturbofs-staging", directory, "tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV, opts)
        if e:
            log.warning("staging tmpfs at %s kept at its old size: %s", directory, os.strerror(e))
        return None
    e = mount("aiturbofs-staging", directory, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    return os.strerror(e) if e else None


def unmount(directory: str) -> None:
    e = unmount_lazy(directory) if is_mount_point(directory) else 0
    if e:
        log.warning("could not unmount the staging tmpfs %s: %s", directory, os.strerror(e))


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``[offset, offset + length)`` of ``fd``: it reads as zeros afterwards."""
    if length <= 0:
        return
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        if e not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise OSError(e, os.strerror(e))
        # a filesystem without hole punching: write zeros (the memory stays used)
        os.pwrite(fd, bytes(length), offset)


def is_hole(fd: int, offset: int, length: int) -> bool:
    """Whether ``[offset, offset + length)`` of ``fd`` holds no data at all (SEEK_DATA: no read, no allocation)."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) >= offset + length
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data after offset
            return True
        raise


_hash_buffers = threading.local()  # one chunk-sized buffer per hashing thread, reused


def content_key_of(path: str, offset: int, length: int) -> bytes:
    """``chunk.content_key`` of ``length`` bytes of ``path`` from ``offset`` (for a worker thread).

    The bytes are read with ``pread`` into a buffer of the thread's own and
    hashed there, never through a map of the file: another task may punch
    or cut the range meanwhile, and a map's reads of a punched range fault
    fresh pages into it (memory the pool never counted; SIGBUS on a full
    tmpfs), where ``pread`` of a hole reads zeros without allocating.  It
    opens the file itself (the trio thread may close its descriptor
    meanwhile); a file shorter than the range is hashed as if padded with
    zeros.  What it returns is the key of the bytes it read, whatever
    changed after: callers that need the bytes to still be those re-check
    (the pool hashes a volatile range's copy at every read).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        have = max(0, min(length, os.fstat(fd).st_size - offset))
        if not have or is_hole(fd, offset, have):
            return chunk.HOLE  # all zeros
        buf = getattr(_hash_buffers, "buf", None)
        if buf is None or len(buf) < length:
            buf = _hash_buffers.buf = bytearray(max(length, CHUNK_BYTES))
        view = memoryview(buf)
        try:
            done = 0
            while done < have:
                n = os.preadv(fd, [view[done:have]], offset + done)
                if n <= 0:
                    break  # cut meanwhile: the rest reads as zeros
                done += n
            view[done:length] = bytes(length - done)
            return chunk.content_key(view[:length])
        finally:
            view.release()
    finally:
        os.close(fd)


class Range:
    """Chunk ``index`` of a backing file."""

    __slots__ = ("file", "index", "entry", "writing")

    def __init__(self, file: "BackingFile", index: int):
        self.file = file
        self.index = index
        # The pool entry whose bytes are here (staging._entry.Entry), or None:
        # then the range belongs to its file's open slot, or holds nothing.
        self.entry: Any = None
        # Its file's open slot writes here: the pool must not cache a chunk
        # in it (a read-ahead finishing meanwhile would register bytes the
        # writer then changes).
        self.writing = False

    @property
    def offset(self) -> int:
        return self.index << CHUNK_BITS

    def pread(self, start: int, count: int) -> bytes:
        """``count`` bytes from ``start``; the part past the file's end reads as zeros."""
        data = os.pread(self.file.fd(), count, self.offset + start)
        if len(data) < count:
            data += bytes(count - len(data))
        return data

    def pwrite(self, start: int, data) -> None:
        """Write ``data`` at ``start``; raises OSError (ENOSPC of a full tmpfs)."""
        fd = self.file.fd()
        view = memoryview(data)
        at = self.offset + start
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n

    def open_for_writing(self) -> None:
        """A whole chunk is about to be written: let the file reach its end, so huge pages back it.

        A tmpfs with ``huge=within_size`` allocates a 2 MiB page only inside
        the file's size; an appending writer would otherwise get 4 KiB ones.
        """
        self.ensure_length(CHUNK_BYTES)

    def ensure_length(self, length: int) -> None:
        """Make the file reach ``length`` bytes into the range (a hole if it did not)."""
        fd = self.file.fd()
        if os.fstat(fd).st_size < self.offset + length:
            os.ftruncate(fd, self.offset + length)

    def punch(self, start: int = 0) -> None:
        """Drop the bytes from ``start`` to the end of the chunk."""
        punch_hole(self.file.fd(), self.offset + start, CHUNK_BYTES - start)


REPLICA_PREFIX = "r"


def _replica_name(key: bytes) -> str:
    return REPLICA_PREFIX + key.hex()


def _parse_name(name: str) -> int | bytes | None:
    """The inode number or replica digest a backing file's name gives; None for a foreign file."""
    if name.isdigit():
        return int(name)
    if name.startswith(REPLICA_PREFIX) and len(name) == 1 + 2 * HASH_BYTES:
        try:
            return bytes.fromhex(name[1:])
        except ValueError:
            return None
    return None


def _unlink_ours(directory: str, ours: Callable[[str], bool]) -> bool:
    """Remove the files of ``directory`` whose names ``ours`` accepts; False if the directory is gone."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return False
    for name in names:
        if ours(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
    return True


class BackingFile:
    """One file's bytes, chunk by chunk, or one replica chunk at range 0 (see module doc)."""

    __slots__ = ("area", "ino", "name", "path", "on_disk", "_ranges", "users", "kernel_opens", "kernel_writers", "made")

    def __init__(self, area: "BackingArea", name: str, ino: int | None, *, on_disk: bool = False):
        self.area = area
        self.ino = ino  # None: a replica's file
        self.name = name
        self.on_disk = on_disk  # in the area's disk directory (page cache), not the tmpfs: costs no budget
        self.path = os.path.join(area.directory_of(on_disk), name)
        self._ranges: dict[int, Range] = {}
        self.users = 0  # FileContents holding it (the pool's entries are counted by their ranges)
        # Opens the kernel serves from this file itself (FUSE passthrough), and those of them that
        # may write: while there are any, its bytes are the file's and no one punches them; while
        # any may write, the pool trusts no chunk it has here without hashing it again.
        self.kernel_opens = 0
        self.kernel_writers = 0
        self.made = False  # opened once by this run: it exists (else it may be made of a spare)

    def range(self, index: int) -> Range:
        r = self._ranges.get(index)
        if r is None:
            r = self._ranges[index] = Range(self, index)
        return r

    def ranges(self) -> list[Range]:
        return list(self._ranges.values())

    def fd(self) -> int:
        return self.area._fd(self)

    @property
    def size(self) -> int:
        try:
            return os.fstat(self.fd()).st_size
        except FileNotFoundError:
            return 0

    @property
    def in_use(self) -> bool:
        return self.users > 0 or any(r.entry is not None for r in self._ranges.values())


class BackingArea:
    """The directory of backing files (created 0700 if missing).

    Files found there at start are the previous run's: ``found`` lists their
    inode numbers for recovery, which keeps what it needs and calls
    ``sweep`` to remove the rest.  With ``tmpfs_bytes`` the directory gets a
    tmpfs of its own, with huge pages (``mount_tmpfs``), where the daemon
    may mount; else it is used as it is.  ``disk_directory`` (created 0700
    if missing) holds the backing files of files the kernel writes (see the
    module doc); ``found_on_disk`` lists those a previous run left.
    """

    def __init__(self, directory: str, *, tmpfs_bytes: int | None = None, disk_directory: str | None = None):
        self.directory = os.path.abspath(directory)
        self.disk_directory = os.path.abspath(disk_directory) if disk_directory else None
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.tmpfs = False
        if tmpfs_bytes:
            why = mount_tmpfs(self.directory, tmpfs_bytes)
            self.tmpfs = why is None
            if why is not None:
                log.info("staging dir %s: no tmpfs of its own (%s); using it as it is", self.directory, why)
        self._files: dict[str, BackingFile] = {}  # by path
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()  # path -> fd, LRU first
        self.found: set[int] = set()  # inodes whose backing file a previous run left
        self.found_replicas: set[bytes] = set()  # digests of the replicas it left
        self.found_on_disk: set[int] = set()  # inodes whose backing file on disk it left
        for name in os.listdir(directory):
            what = _parse_name(name)
            if isinstance(what, int):
                self.found.add(what)
            elif isinstance(what, bytes):
                self.found_replicas.add(what)
            else:
                log.warning("staging: ignoring foreign file %s in %s", name, directory)
        self._spares: SpareFiles | None = None
        if self.disk_directory is not None:
            os.makedirs(self.disk_directory, mode=0o700, exist_ok=True)
            self._spares = SpareFiles(self.disk_directory)
            for name in os.listdir(self.disk_directory):
                if name.isdigit():
                    self.found_on_disk.add(int(name))
                elif name != SPARES_DIR:
                    log.warning("staging: ignoring foreign file %s in %s", name, self.disk_directory)

    def directory_of(self, on_disk: bool) -> str:
        """The directory of the backing files in the tmpfs, or ``on_disk``."""
        if not on_disk:
            return self.directory
        assert self.disk_directory is not None, "no disk directory"
        return self.disk_directory

    def file(self, ino: int, *, on_disk: bool = False) -> BackingFile:
        """The backing file of inode ``ino`` (made on first write), in the tmpfs or, ``on_disk``, the disk directory."""
        return self._get(str(ino), ino, on_disk)

    def current(self, ino: int) -> BackingFile:
        """The backing file a content of ``ino`` takes: the one on disk if it is in use (its chunks are cached
        there), else the tmpfs one."""
        if self.disk_directory is not None:
            f = self._files.get(os.path.join(self.disk_directory, str(ino)))
            if f is not None:
                return f
        return self.file(ino)

    def replica(self, key: bytes) -> BackingFile:
        """The backing file of the replica of chunk ``key`` (its range 0)."""
        return self._get(_replica_name(key), None, False)

    def _get(self, name: str, ino: int | None, on_disk: bool) -> BackingFile:
        path = os.path.join(self.directory_of(on_disk), name)
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = BackingFile(self, name, ino, on_disk=on_disk)
        return f

    def existing(self, ino: int) -> list[BackingFile]:
        """The backing files a previous run left for ``ino``: none, one, or (a crash while a file moved to
        disk) one in each place."""
        found = [self.file(ino)] if ino in self.found else []
        return found + ([self.file(ino, on_disk=True)] if ino in self.found_on_disk else [])

    def disk_free_bytes(self) -> int:
        """What the filesystem of the disk directory has free (0 without one, or if it cannot say)."""
        if self.disk_directory is None:
            return 0
        try:
            st = os.statvfs(self.disk_directory)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def orphans(self, inos: set[int]) -> list[BackingFile]:
        """The backing files a previous run left for inodes not in ``inos`` (files removed before it stopped)."""
        return ([self.file(ino) for ino in sorted(self.found - inos)]
                + [self.file(ino, on_disk=True) for ino in sorted(self.found_on_disk - inos)])

    def _fd(self, f: BackingFile) -> int:
        fd = self._fds.get(f.path)
        if fd is not None:
            self._fds.move_to_end(f.path)
            return fd
        while len(self._fds) >= BACKING_FDS_OPEN_MAX:
            _path, old = self._fds.popitem(last=False)
            os.close(old)
        if not f.made and f.on_disk and self._spares is not None:
            self._spares.take(f.path)  # (a link where the file does not exist yet; else the open makes it)
        fd = os.open(f.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        f.made = True
        self._fds[f.path] = fd
        return fd

    def release(self, f: BackingFile) -> None:
        """Remove ``f`` once nothing uses it any more."""
        if f.in_use or self._files.get(f.path) is not f:
            return
        del self._files[f.path]
        fd = self._fds.pop(f.path, None)
        if fd is not None:
            os.close(fd)
        if f.on_disk:
            assert f.ino is not None
            self.found_on_disk.discard(f.ino)
        elif f.ino is not None:
            self.found.discard(f.ino)
        else:
            self.found_replicas.discard(bytes.fromhex(f.name[1:]))
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            pass

    def sweep(self) -> None:
        """After recovery: remove what the previous run left that nothing took."""
        for ino in list(self.found):
            self.release(self.file(ino))
        for ino in list(self.found_on_disk):
            self.release(self.file(ino, on_disk=True))
        for key in list(self.found_replicas):
            self.release(self.replica(key))

    def bytes_allocated(self, *, on_disk: bool = False) -> int:
        """What the backing files in the tmpfs (or ``on_disk``) hold (st_blocks), for status."""
        total = 0
        for f in self._files.values():
            if f.on_disk != on_disk:
                continue
            try:
                total += os.stat(f.path).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    def remove_all(self) -> None:
        """At a clean exit with everything durable: remove every backing file and the directory."""
        self.close()
        self._files.clear()
        self.found.clear()
        self.found_replicas.clear()
        self.found_on_disk.clear()
        if self.disk_directory is not None and _unlink_ours(self.disk_directory, str.isdigit):
            with contextlib.suppress(OSError):
                os.rmdir(self.disk_directory)
        if not _unlink_ours(self.directory, lambda name: _parse_name(name) is not None):
            return  # removed by someone else meanwhile
        if self.tmpfs:
            unmount(self.directory)
        try:
            os.rmdir(self.directory)
        except OSError:
            pass  # foreign files: left where they are

    def remove_if_empty(self) -> None:
        """At exit: a staging dir with no backing file left holds nothing to recover: remove it (and its tmpfs)."""
        try:
            if any(_parse_name(name) is not None for name in os.listdir(self.directory)):
                return
            if self.disk_directory is not None and any(n.isdigit() for n in os.listdir(self.disk_directory)):
                return
        except FileNotFoundError:
            return
        self.remove_all()

    def close(self) -> None:
        if self._spares is not None:
            self._spares.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


SPARES_DIR = ".spares"


class SpareFiles:
    """Empty files made ahead by a thread of their own, in ``directory``/.spares, for new backing files to take.

    ``take(path)`` links a spare to ``path``: one directory entry in
    ``path``'s directory, no inode allocation, on the calling (trio) thread.
    The thread makes the spares in a directory of their own and removes
    their names once taken, so nothing it does holds the lock of the
    directory the backing files are in.  A take never replaces a file: the
    link fails where ``path`` exists, and the caller's ``O_CREAT`` open then
    finds it.  The thread starts at the first take and refills to ``keep``
    whenever fewer than half are left; a spare it cannot make (a full or
    read-only disk) stops it with a log line, and takes fall back to the
    caller's create.  What a crashed run left is removed at start (a taken
    spare's name is a second link of a backing file: removing it removes
    nothing else); ``close`` stops the thread and removes the rest.
    """

    def __init__(self, directory: str, keep: int = BACKING_SPARES):
        self.directory = os.path.join(directory, SPARES_DIR)
        self.keep = keep
        self._ready: collections.deque[str] = collections.deque()  # (appended by the thread, taken by the trio one)
        self._taken: collections.deque[str] = collections.deque()  # names the thread removes
        self._wanted = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._names = itertools.count()
        try:
            if _unlink_ours(self.directory, lambda name: True):  # a previous run's
                os.rmdir(self.directory)
        except OSError as exc:
            self._give_up(exc)

    def take(self, path: str) -> bool:
        """Make ``path`` (if it does not exist) of a spare; False where none was ready or it exists."""
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._refill, name="aiturbofs-spares", daemon=True)
            self._thread.start()
        try:
            spare = self._ready.popleft()
        except IndexError:
            self._wanted.set()
            return False
        try:
            os.link(spare, path)
        except FileExistsError:
            self._ready.appendleft(spare)  # still a spare
            return False
        except OSError as exc:
            log.warning("staging: could not link a spare file to %s: %s", path, exc)
            self._taken.append(spare)
            self._wanted.set()
            return False
        self._taken.append(spare)
        if len(self._ready) < self.keep // 2:
            self._wanted.set()
        return True

    def _refill(self) -> None:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            self._give_up(exc)
            return
        while not self._stopped:
            self._wanted.wait()
            self._wanted.clear()
            self._forget_taken()
            while len(self._ready) < self.keep and not self._stopped:
                path = os.path.join(self.directory, str(next(self._names)))
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
                except OSError as exc:
                    self._give_up(exc)
                    return
                self._ready.append(path)

    def _give_up(self, exc: OSError) -> None:
        log.warning("staging: no spare backing files in %s (%s): new ones are created when needed",
                    self.directory, exc)
        self._stopped = True

    def _forget_taken(self) -> None:
        while self._taken:
            with contextlib.suppress(OSError):
                os.unlink(self._taken.popleft())

    def close(self) -> None:
        """Stop the thread and remove the spares and their directory."""
        self._stopped = True
        self._wanted.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._forget_taken()
        while self._ready:
            with contextlib.suppress(OSError):
                os.unlink(self._ready.popleft())
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)
