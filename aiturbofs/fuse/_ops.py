"""pyfuse3 ``Operations``: translate kernel requests to ``vfs.Filesystem`` calls.

Thin by design: argument conversion, ``EntryAttributes`` construction and the
``fuse_handler`` error mapping.  No filesystem semantics live here.
"""

import errno
import logging
import os
import stat

import pyfuse3

from .._errors import NotSupported
from .._limits import ATTR_TIMEOUT_S, NAME_BYTES_MAX, ST_BLKSIZE_BYTES
from ..meta import InodeRow
from ..vfs import Filesystem
from ._errors import FaultInjector, fuse_handler

log = logging.getLogger("aiturbofs.fuse")

_SECURITY_CAPABILITY = b"security.capability"
_BLOCK_BYTES = 4096
_STATFS_BLOCKS = 1 << 38  # 1 PiB of 4 KiB blocks: the backend is not bounded here
DOT_COOKIES = 2  # readdir cookies of "." and ".."


def entry(row: InodeRow) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = row.ino
    e.generation = 0
    e.entry_timeout = ATTR_TIMEOUT_S
    e.attr_timeout = ATTR_TIMEOUT_S
    e.st_mode = row.mode
    e.st_nlink = row.nlink
    e.st_uid = row.uid
    e.st_gid = row.gid
    e.st_rdev = row.rdev
    e.st_size = row.size
    e.st_blksize = ST_BLKSIZE_BYTES
    e.st_blocks = (row.size + 511) // 512
    e.st_atime_ns = row.atime_ns
    e.st_mtime_ns = row.mtime_ns
    e.st_ctime_ns = row.ctime_ns
    return e


class Pyfuse3Kernel:
    """What ``Operations`` asks of the session serving it, when that is pyfuse3's.

    ``KernelSession`` has the same members: a readdir reply, an attribute
    invalidation and (with passthrough) backing file registrations are all
    the handlers send to the kernel themselves.
    """

    @staticmethod
    def readdir_reply(token, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        return pyfuse3.readdir_reply(token, name, attr, next_id)

    @staticmethod
    def invalidate_inode(ino: int, attr_only: bool = False) -> None:
        pyfuse3.invalidate_inode(ino, attr_only=attr_only)

    passthrough = False  # libfuse 3.14 cannot hand the kernel a backing file

    @staticmethod
    def backing_open(fd: int) -> int:
        raise OSError(errno.EOPNOTSUPP, "pyfuse3 has no FUSE passthrough")

    @staticmethod
    def backing_close(backing_id: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "pyfuse3 has no FUSE passthrough")


class Operations(pyfuse3.Operations):
    """The request handlers of both data paths (pyfuse3's loop, or ``KernelSession``)."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: Filesystem, *, debug_faults: bool = False):
        super().__init__()
        self.fs = fs
        self.faults = FaultInjector(debug_faults)
        self.kernel = Pyfuse3Kernel()  # replaced by the KernelSession that serves these handlers
        # FUSE passthrough (a KernelSession that negotiated it): one backing id per inode the
        # kernel serves from its backing file, [id, opens]; which handles use it.
        self._backing: dict[int, list[int]] = {}
        self._backing_fh: dict[int, int] = {}

    def backing_id_of(self, fh: int) -> int:
        """The passthrough backing id an open of ``fh`` answers with; 0: served through requests."""
        ino = self._backing_fh.get(fh)
        return self._backing[ino][0] if ino is not None else 0

    async def _passthrough(self, handle) -> None:
        """Let the kernel serve ``handle`` from the file's backing file, where the VFS allows it.

        Every passthrough open of one inode must name the same backing file
        registration (the kernel refuses another): registered at the first,
        closed after the last release.
        """
        if not self.kernel.passthrough:
            return
        fd = await self.fs.open_kernel(handle)
        if fd is None:
            return
        ino = handle.inode.ino
        known = self._backing.get(ino)
        if known is None:
            try:
                backing_id = self.kernel.backing_open(fd)
            except OSError as exc:
                log.warning("passthrough of inode %d refused by the kernel (%s): served through requests", ino, exc)
                await self.fs.close_kernel(handle)
                return
            known = self._backing[ino] = [backing_id, 0]
        known[1] += 1
        self._backing_fh[handle.fh] = ino

    def _end_passthrough(self, fh: int) -> None:
        ino = self._backing_fh.pop(fh, None)
        if ino is None:
            return
        known = self._backing[ino]
        known[1] -= 1
        if not known[1]:
            del self._backing[ino]
            self.kernel.backing_close(known[0])

    @fuse_handler
    async def lookup(self, parent_inode, name, ctx):
        return entry(await self.fs.lookup(parent_inode, name))

    async def forget(self, inode_list):
        # forget may not fail at all: the kernel does not wait for an answer.
        for ino, count in inode_list:
            try:
                await self.fs.forget(ino, count)
            except Exception:  # noqa: BLE001 - logged, never propagated
                log.exception("BUG in forget of inode %d", ino)

    @fuse_handler
    async def getattr(self, inode, ctx):
        return entry(await self.fs.getattr(inode))

    @fuse_handler
    async def setattr(self, inode, attr, fields, fh, ctx):
        row = await self.fs.setattr(
            inode,
            fh=fh,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            ctime_ns=attr.st_ctime_ns if fields.update_ctime else None,
            kill_suidgid=getattr(fields, "kill_suidgid", False),  # (the kernel session's fields only)
        )
        return entry(row)

    @fuse_handler
    async def readlink(self, inode, ctx):
        return await self.fs.readlink(inode)

    @fuse_handler
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return entry(await self.fs.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @fuse_handler
    async def mkdir(self, parent_inode, name, mode, ctx):
        return entry(await self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @fuse_handler
    async def unlink(self, parent_inode, name, ctx):
        await self.fs.unlink(parent_inode, name)

    @fuse_handler
    async def rmdir(self, parent_inode, name, ctx):
        await self.fs.rmdir(parent_inode, name)

    @fuse_handler
    async def symlink(self, parent_inode, name, target, ctx):
        return entry(await self.fs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @fuse_handler
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        known = pyfuse3.RENAME_NOREPLACE | pyfuse3.RENAME_EXCHANGE
        if flags & ~known:
            raise NotSupported(f"rename flags {flags:#x} are not supported")
        await self.fs.rename(
            parent_inode_old, name_old, parent_inode_new, name_new,
            noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
            exchange=bool(flags & pyfuse3.RENAME_EXCHANGE),
        )

    @fuse_handler
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return entry(await self.fs.link(inode, new_parent_inode, new_name))

    @fuse_handler
    async def open(self, inode, flags, ctx):
        handle, keep_cache = await self.fs.open(inode, flags, uid=ctx.uid)
        try:
            await self._passthrough(handle)
        except Exception:
            await self.fs.release(handle.fh)  # the open fails: no RELEASE will come for it
            raise
        if not keep_cache and self.fs.cluster.shared:
            # Close-to-open across nodes: another node may have changed the
            # size within the kernel's attribute timeout; make it ask again.
            # (Attributes only: no page lock is taken, so this is safe here.)
            try:
                self.kernel.invalidate_inode(inode, attr_only=True)
            except OSError:
                pass  # the kernel dropped the inode meanwhile: nothing cached
        return self._file_info(handle, keep_cache)

    @staticmethod
    def _file_info(handle, keep_cache: bool) -> pyfuse3.FileInfo:
        # Write-only handles bypass the page cache: the kernel then skips its
        # per-write getxattr(security.capability) and sends 1 MiB requests
        # straight through (measured ~1.5x the cached path).  Handles that can
        # read keep the page cache (and mmap) working.
        # A set-user/group-ID file keeps the cached path: there the kernel kills
        # the bits (a setattr) when someone without CAP_FSETID writes, which a
        # direct_io write never asks for.
        write_only = (handle.flags & os.O_ACCMODE) == os.O_WRONLY
        direct = write_only and not handle.inode.row.mode & (stat.S_ISUID | stat.S_ISGID)
        return pyfuse3.FileInfo(fh=handle.fh, direct_io=direct, keep_cache=keep_cache and not direct)

    @fuse_handler
    async def read(self, fh, off, size):
        return await self.fs.read(fh, off, size)

    @fuse_handler
    async def write(self, fh, off, buf, kill_suidgid=False):
        return await self.fs.write(fh, off, buf, kill_suidgid=kill_suidgid)

    @fuse_handler
    async def fallocate(self, fh, off, length, mode):
        """FUSE_FALLOCATE (the kernel session only: pyfuse3 registers no handler for it)."""
        await self.fs.fallocate(fh, off, length, mode)

    @fuse_handler
    async def lseek(self, fh, off, whence):
        """FUSE_LSEEK, SEEK_DATA and SEEK_HOLE (the kernel session only, like fallocate)."""
        return await self.fs.lseek(fh, off, whence)

    @fuse_handler
    async def flush(self, fh):
        await self.fs.flush(fh)

    @fuse_handler
    async def release(self, fh):
        try:
            await self.fs.release(fh)
        finally:
            self._end_passthrough(fh)

    @fuse_handler
    async def fsync(self, fh, datasync):
        await self.fs.fsync(fh)

    @fuse_handler
    async def opendir(self, inode, ctx):
        row = await self.fs.getattr(inode)
        if not stat.S_ISDIR(row.mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @fuse_handler
    async def readdir(self, fh, start_id, token):
        # "." and ".." come first, at cookies 1 and 2 (readdirplus takes no reference to them); the
        # directory's entries follow at their tokens + DOT_COOKIES.
        if start_id < DOT_COOKIES:
            for cookie, (name, row) in enumerate(await self.fs.dots(fh), start=1):
                if cookie > start_id and not self.kernel.readdir_reply(token, name, entry(row), cookie):
                    return
        offset = max(0, start_id - DOT_COOKIES)
        while True:
            entries = await self.fs.readdir(fh, offset)
            if not entries:
                return
            for name, row, next_id in entries:
                if not self.kernel.readdir_reply(token, name, entry(row), next_id + DOT_COOKIES):
                    return
                self.fs.note_lookup(row)
                offset = next_id

    @fuse_handler
    async def releasedir(self, fh):
        return None

    @fuse_handler
    async def fsyncdir(self, fh, datasync):
        return None

    @fuse_handler
    async def statfs(self, ctx):
        files, used_bytes = await self.fs.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = _BLOCK_BYTES
        s.f_frsize = _BLOCK_BYTES
        used = (used_bytes + _BLOCK_BYTES - 1) // _BLOCK_BYTES
        s.f_blocks = _STATFS_BLOCKS
        s.f_bfree = s.f_bavail = max(0, _STATFS_BLOCKS - used)
        s.f_files = files + (1 << 32)
        s.f_ffree = s.f_favail = 1 << 32
        s.f_namemax = NAME_BYTES_MAX
        return s

    @fuse_handler
    async def create(self, parent_inode, name, mode, flags, ctx):
        handle, row = await self.fs.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        await self._passthrough(handle)
        return self._file_info(handle, False), entry(row)

    @fuse_handler
    async def getxattr(self, inode, name, ctx):
        if name == _SECURITY_CAPABILITY:
            # asked before writes through the page cache: answer without work
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return await self.fs.getxattr(inode, name)

    @fuse_handler
    async def setxattr(self, inode, name, value, ctx):
        await self.fs.setxattr(inode, name, value)

    @fuse_handler
    async def listxattr(self, inode, ctx):
        return await self.fs.listxattr(inode)

    @fuse_handler
    async def removexattr(self, inode, name, ctx):
        await self.fs.removexattr(inode, name)
