#!/usr/bin/env python3
"""A minimal in-memory pyfuse3 filesystem: the ceiling of a Python FUSE data path.

    python benchmarks/minimal_fs.py MOUNTPOINT [--direct-io wronly|writable|none]
                                               [--read-ahead-kb 1024] [--no-xattr]
                                               [--recycle-mib N]

Runs in the foreground until SIGTERM/SIGINT or an external unmount, then
unmounts.  One flat root directory of regular files; each file is one
anonymous mmap grown by doubling (``mremap``: no copy), ``write`` copies into
it, ``read`` returns a memoryview of it.  Nothing else happens per request, so
whatever aiturbofs spends above this is its own overhead.

Mounted under the conditions of aiturbofs where they change the data path:

* the same FUSE options (``pyfuse3.default_options``, fsname, subtype), no
  writeback cache, 1 s attribute/entry timeouts;
* ``read_ahead_kb`` of the mount's bdi raised to 1024 once FUSE INIT is done
  (the kernel resets it at INIT), found via /proc/self/mountinfo: the daemon
  never stats its own mountpoint before its loop serves;
* ``--direct-io wronly`` (default, aiturbofs' rule): handles opened O_WRONLY
  get ``direct_io`` (no page cache, no per-write getxattr), others the page
  cache with ``keep_cache``.  ``writable`` extends direct_io to O_RDWR handles
  (fio opens its write files O_RDWR, so this is how fio sees the direct_io
  ceiling); ``none`` never uses it;
* ``getxattr`` is implemented (answers ENODATA) like aiturbofs, which needs
  xattrs: the kernel then asks for ``security.capability`` before every
  cached write(2).  ``--no-xattr`` answers ENOSYS once and the kernel stops
  asking (a higher, unreachable-for-aiturbofs ceiling).

Memory: by default every new file gets fresh anonymous memory, so writes pay
first-touch page faults (expensive in these VMs).  ``--recycle-mib N`` keeps
the maps of deleted files (up to N MiB) and hands them to new files: the
"warm memory" ceiling, comparable to aiturbofs' recycled chunk buffers.
"""

import argparse
import errno
import logging
import mmap
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

log = logging.getLogger("minimal_fs")

ROOT = pyfuse3.ROOT_INODE
FIRST_CAPACITY_BYTES = 1 << 20
ATTR_TIMEOUT_S = 1.0  # as aiturbofs
READ_AHEAD_KB = 1024  # as aiturbofs
INIT_SETTLE_S = 0.3  # as aiturbofs: the kernel lowers read_ahead_kb when it processes INIT


def _anonymous(size: int) -> mmap.mmap:
    # MAP_PRIVATE: a shared anonymous map is a fixed-size shmem object, and
    # touching it past its first size after mremap raises SIGBUS.
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class File:
    __slots__ = ("ino", "name", "mode", "uid", "gid", "size", "buf", "nlink", "opens", "atime_ns", "mtime_ns", "ctime_ns")

    def __init__(self, ino: int, name: bytes, mode: int, uid: int, gid: int, buf: mmap.mmap | None):
        now = time.time_ns()
        self.ino, self.name, self.mode, self.uid, self.gid = ino, name, mode, uid, gid
        self.size = 0
        self.buf = buf if buf is not None else _anonymous(FIRST_CAPACITY_BYTES)
        self.nlink = 1
        self.opens = 0
        self.atime_ns = self.mtime_ns = self.ctime_ns = now

    def reserve(self, end: int) -> None:
        cap = len(self.buf)
        if end <= cap:
            return
        while cap < end:
            cap *= 2
        try:
            self.buf.resize(cap)  # mremap(MREMAP_MAYMOVE): no copy
        except (BufferError, OSError, SystemError):
            new = _anonymous(cap)
            new[: self.size] = self.buf[: self.size]
            self.buf.close()
            self.buf = new


class MinimalFS(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, direct_io: str, xattr: bool, recycle_bytes: int = 0):
        super().__init__()
        self.direct_io = direct_io
        self.xattr = xattr
        self.recycle_bytes = recycle_bytes
        self.free: list[mmap.mmap] = []  # maps of deleted files, kept warm (--recycle-mib)
        self.files: dict[int, File] = {}
        self.names: dict[bytes, int] = {}
        self.handles: dict[int, tuple[File, bool]] = {}
        self.next_ino = ROOT + 1
        self.next_fh = 1
        self.root_times = time.time_ns()

    # ------------------------------------------------------------- attributes
    def _root_attr(self) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ROOT
        e.st_mode = stat.S_IFDIR | 0o755
        e.st_nlink = 2
        e.st_uid, e.st_gid = os.getuid(), os.getgid()
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = self.root_times
        e.entry_timeout = e.attr_timeout = ATTR_TIMEOUT_S
        e.st_blksize = 1 << 20
        return e

    @staticmethod
    def _attr(f: File) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = f.ino
        e.st_mode = f.mode
        e.st_nlink = f.nlink
        e.st_uid, e.st_gid = f.uid, f.gid
        e.st_size = f.size
        e.st_blksize = 1 << 20
        e.st_blocks = (f.size + 511) // 512
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = f.atime_ns, f.mtime_ns, f.ctime_ns
        e.entry_timeout = e.attr_timeout = ATTR_TIMEOUT_S
        return e

    def _file(self, ino: int) -> File:
        f = self.files.get(ino)
        if f is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return f

    async def lookup(self, parent_inode, name, ctx):
        if parent_inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name in (b".", b".."):
            return self._root_attr()
        ino = self.names.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(self.files[ino])

    async def getattr(self, inode, ctx):
        if inode == ROOT:
            return self._root_attr()
        return self._attr(self._file(inode))

    async def setattr(self, inode, attr, fields, fh, ctx):
        if inode == ROOT:
            return self._root_attr()
        f = self._file(inode)
        if fields.update_size:
            self._truncate(f, attr.st_size)
        if fields.update_mode:
            f.mode = stat.S_IFMT(f.mode) | (attr.st_mode & 0o7777)
        if fields.update_uid:
            f.uid = attr.st_uid
        if fields.update_gid:
            f.gid = attr.st_gid
        if fields.update_atime:
            f.atime_ns = attr.st_atime_ns
        if fields.update_mtime:
            f.mtime_ns = attr.st_mtime_ns
        f.ctime_ns = time.time_ns()
        return self._attr(f)

    @staticmethod
    def _truncate(f: File, size: int) -> None:
        if size > f.size:
            f.reserve(size)
            f.buf[f.size : size] = bytes(size - f.size)  # a recycled map holds old bytes
        f.size = size
        f.mtime_ns = time.time_ns()

    async def getxattr(self, inode, name, ctx):
        if not self.xattr:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 1 << 30
        s.f_files = s.f_ffree = s.f_favail = 1 << 20
        s.f_namemax = 255
        return s

    # ------------------------------------------------------------- namespace
    async def create(self, parent_inode, name, mode, flags, ctx):
        if parent_inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOTSUP)
        if name in self.names:
            raise pyfuse3.FUSEError(errno.EEXIST)
        f = File(self.next_ino, name, stat.S_IFREG | (mode & 0o7777), ctx.uid, ctx.gid, self.free.pop() if self.free else None)
        self.next_ino += 1
        self.files[f.ino] = f
        self.names[name] = f.ino
        return self._open(f, flags), self._attr(f)

    async def unlink(self, parent_inode, name, ctx):
        ino = self.names.pop(name, None)
        if parent_inode != ROOT or ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        f = self.files[ino]
        f.nlink = 0
        self._maybe_free(f)

    def _maybe_free(self, f: File) -> None:
        # The kernel may still have the inode cached; data of an unlinked,
        # unopened file can go now (a later getattr of it answers ENOENT).
        if f.nlink == 0 and f.opens == 0:
            del self.files[f.ino]
            if sum(len(b) for b in self.free) + len(f.buf) <= self.recycle_bytes:
                self.free.append(f.buf)
                self.free.sort(key=len)  # pop() hands out the largest
            else:
                f.buf.close()

    async def opendir(self, inode, ctx):
        if inode != ROOT:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        entries = sorted(self.files.values(), key=lambda f: f.ino)
        for f in entries:
            if f.ino <= start_id or f.nlink == 0:
                continue
            if not pyfuse3.readdir_reply(token, f.name, self._attr(f), f.ino):
                return

    async def releasedir(self, fh):
        return None

    # ----------------------------------------------------------------- data
    def _open(self, f: File, flags: int) -> pyfuse3.FileInfo:
        access = flags & os.O_ACCMODE
        if self.direct_io == "wronly":
            direct = access == os.O_WRONLY
        elif self.direct_io == "writable":
            direct = access != os.O_RDONLY
        else:
            direct = False
        if flags & os.O_TRUNC and access != os.O_RDONLY:
            self._truncate(f, 0)
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = (f, direct)
        f.opens += 1
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=not direct)

    async def open(self, inode, flags, ctx):
        return self._open(self._file(inode), flags)

    async def read(self, fh, off, size):
        f = self.handles[fh][0]
        end = min(off + size, f.size)
        if off >= end:
            return b""
        return memoryview(f.buf)[off:end]

    async def write(self, fh, off, buf):
        f = self.handles[fh][0]
        end = off + len(buf)
        if end > len(f.buf):
            f.reserve(end)
        f.buf[off:end] = buf
        if off > f.size:
            f.buf[f.size : off] = bytes(off - f.size)  # a hole reads as zeros
        if end > f.size:
            f.size = end
        return len(buf)

    async def flush(self, fh):
        return None

    async def fsync(self, fh, datasync):
        return None

    async def release(self, fh):
        f = self.handles.pop(fh)[0]
        f.opens -= 1
        self._maybe_free(f)


def _bdi_of(mountpoint: str) -> str | None:
    dev = None
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            if fields[4] == mountpoint:
                dev = fields[2]  # the last (top) mount wins
    return dev


async def _raise_read_ahead(mountpoint: str, kb: int) -> None:
    await trio.sleep(INIT_SETTLE_S)
    dev = _bdi_of(mountpoint)
    if dev is None:
        log.warning("mount %s not in /proc/self/mountinfo: read_ahead_kb left alone", mountpoint)
        return
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as fh:
            fh.write(str(kb))
        log.info("read_ahead_kb=%d on %s", kb, path)
    except OSError as exc:
        log.warning("could not set %s: %s", path, exc)


async def _watch_signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


async def _serve(mountpoint: str, read_ahead_kb: int) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_signals)
        if read_ahead_kb:
            nursery.start_soon(_raise_read_ahead, mountpoint, read_ahead_kb)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mountpoint")
    p.add_argument("--direct-io", choices=("wronly", "writable", "none"), default="wronly",
                   help="which handles get direct_io: O_WRONLY ones (aiturbofs' rule, default), all writable ones, or none")
    p.add_argument("--read-ahead-kb", type=int, default=READ_AHEAD_KB, help="0 leaves the kernel default (128)")
    p.add_argument("--no-xattr", action="store_true", help="answer getxattr with ENOSYS (the kernel stops asking)")
    p.add_argument("--recycle-mib", type=int, default=0,
                   help="keep up to this many MiB of deleted files' maps warm for new files (default 0: fresh memory per file)")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    mountpoint = os.path.abspath(args.mountpoint)
    ops = MinimalFS(args.direct_io, xattr=not args.no_xattr, recycle_bytes=args.recycle_mib << 20)
    opts = set(pyfuse3.default_options)
    opts.add("fsname=minimalfs")
    opts.add("subtype=minimalfs")
    pyfuse3.init(ops, mountpoint, opts)
    log.info("mounted at %s (direct_io=%s, read_ahead_kb=%s, xattr=%s, recycle_mib=%d)", mountpoint, args.direct_io,
             args.read_ahead_kb or "default", not args.no_xattr, args.recycle_mib)
    try:
        trio.run(_serve, mountpoint, args.read_ahead_kb)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
