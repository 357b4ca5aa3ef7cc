"""The FUSE kernel ABI (protocol 7.40+): message layouts, opcodes, flags and /dev/fuse ioctls.

Every structure the daemon reads from or writes to /dev/fuse is declared
once here, field by field in the kernel's order, as a ``Layout``: a
``struct.Struct`` (native byte order, no implicit padding: the kernel pads
every structure explicitly to 64 bits) with named fields.  The reference is
the kernel's ``include/uapi/linux/fuse.h`` (libfuse ships it as
``include/fuse_kernel.h``); ``tests/fuse/test_fuse_abi.py`` compiles a probe
against the installed header and checks every size and offset it knows,
and the fields newer than that header are checked by the running kernel
itself (the INIT exchange and a passthrough open).

Names follow the header without the ``fuse_`` prefix.  Nothing here does
I/O.
"""

from __future__ import annotations

import struct
from collections import namedtuple

# ------------------------------------------------------------------ versions
KERNEL_VERSION = 7
KERNEL_MINOR_VERSION = 40  # passthrough: backing_id in open_out, max_stack_depth in init_out
ROOT_ID = 1
MIN_READ_BUFFER = 8192

# C type -> struct code ("=" byte order, standard sizes).
_CODES = {"u8": "B", "u16": "H", "u32": "I", "i32": "i", "u64": "Q", "i64": "q"}


class Layout:
    """One fixed-size kernel structure: ``pack(**fields)``, ``unpack(buf, offset)`` -> namedtuple."""

    def __init__(self, name: str, fields: list[tuple[str, str]]):
        self.name = name
        self.fields = [f for f, _ in fields]
        fmt = "=" + "".join(_expand(t) for _, t in fields)
        self.struct = struct.Struct(fmt)
        self.size = self.struct.size
        # array fields (``u32[11]``) are reserved space: packed as zeros, not unpacked by name
        self._names = [f for f, t in fields if "[" not in t]
        self._arrays = {f: int(t[t.index("[") + 1 : -1]) for f, t in fields if "[" in t}
        self.reserved = frozenset(self._arrays)
        self.tuple = namedtuple(name, self._names)  # type: ignore[misc]
        self.offsets = _offsets(fields)

    def pack(self, **values) -> bytes:
        args = []
        for f in self.fields:
            if f in self._arrays:
                args += [0] * self._arrays[f]
            else:
                args.append(values.pop(f, 0))
        if values:
            raise TypeError(f"{self.name} has no field(s) {sorted(values)}")
        return self.struct.pack(*args)

    def unpack(self, buf, offset: int = 0):
        raw = self.struct.unpack_from(buf, offset)
        out, i = [], 0
        for f in self.fields:
            n = self._arrays.get(f)
            if n is None:
                out.append(raw[i])
                i += 1
            else:
                i += n
        return self.tuple(*out)


def _expand(ctype: str) -> str:
    if "[" in ctype:
        base, count = ctype[: ctype.index("[")], int(ctype[ctype.index("[") + 1 : -1])
        return _CODES[base] * count
    return _CODES[ctype]


def _offsets(fields: list[tuple[str, str]]) -> dict[str, int]:
    out, at = {}, 0
    for f, t in fields:
        out[f] = at
        at += struct.calcsize("=" + _expand(t))
    return out


def _layout(name: str, spec: str) -> Layout:
    """``spec``: "field:type field:type ..." in the header's order."""
    return Layout(name, [tuple(item.split(":")) for item in spec.split()])  # type: ignore[misc]


# ------------------------------------------------------------------ layouts
ATTR = _layout("attr", "ino:u64 size:u64 blocks:u64 atime:u64 mtime:u64 ctime:u64 atimensec:u32 mtimensec:u32 "
                       "ctimensec:u32 mode:u32 nlink:u32 uid:u32 gid:u32 rdev:u32 blksize:u32 flags:u32")
KSTATFS = _layout("kstatfs", "blocks:u64 bfree:u64 bavail:u64 files:u64 ffree:u64 bsize:u32 namelen:u32 "
                             "frsize:u32 padding:u32 spare:u32[6]")
IN_HEADER = _layout("in_header", "len:u32 opcode:u32 unique:u64 nodeid:u64 uid:u32 gid:u32 pid:u32 "
                                 "total_extlen:u16 padding:u16")
OUT_HEADER = _layout("out_header", "len:u32 error:i32 unique:u64")
INIT_IN = _layout("init_in", "major:u32 minor:u32 max_readahead:u32 flags:u32 flags2:u32 unused:u32[11]")
INIT_OUT = _layout("init_out", "major:u32 minor:u32 max_readahead:u32 flags:u32 max_background:u16 "
                               "congestion_threshold:u16 max_write:u32 time_gran:u32 max_pages:u16 "
                               "map_alignment:u16 flags2:u32 max_stack_depth:u32 request_timeout:u16 "
                               "unused:u16[11]")
ENTRY_OUT_HEAD = _layout("entry_out_head", "nodeid:u64 generation:u64 entry_valid:u64 attr_valid:u64 "
                                           "entry_valid_nsec:u32 attr_valid_nsec:u32")  # + ATTR
ATTR_OUT_HEAD = _layout("attr_out_head", "attr_valid:u64 attr_valid_nsec:u32 dummy:u32")  # + ATTR
FORGET_IN = _layout("forget_in", "nlookup:u64")
FORGET_ONE = _layout("forget_one", "nodeid:u64 nlookup:u64")
BATCH_FORGET_IN = _layout("batch_forget_in", "count:u32 dummy:u32")
GETATTR_IN = _layout("getattr_in", "getattr_flags:u32 dummy:u32 fh:u64")
SETATTR_IN = _layout("setattr_in", "valid:u32 padding:u32 fh:u64 size:u64 lock_owner:u64 atime:u64 mtime:u64 "
                                   "ctime:u64 atimensec:u32 mtimensec:u32 ctimensec:u32 mode:u32 unused4:u32 "
                                   "uid:u32 gid:u32 unused5:u32")
MKNOD_IN = _layout("mknod_in", "mode:u32 rdev:u32 umask:u32 padding:u32")
MKDIR_IN = _layout("mkdir_in", "mode:u32 umask:u32")
RENAME_IN = _layout("rename_in", "newdir:u64")
RENAME2_IN = _layout("rename2_in", "newdir:u64 flags:u32 padding:u32")
LINK_IN = _layout("link_in", "oldnodeid:u64")
OPEN_IN = _layout("open_in", "flags:u32 open_flags:u32")
CREATE_IN = _layout("create_in", "flags:u32 mode:u32 umask:u32 open_flags:u32")
OPEN_OUT = _layout("open_out", "fh:u64 open_flags:u32 backing_id:i32")
RELEASE_IN = _layout("release_in", "fh:u64 flags:u32 release_flags:u32 lock_owner:u64")
FLUSH_IN = _layout("flush_in", "fh:u64 unused:u32 padding:u32 lock_owner:u64")
READ_IN = _layout("read_in", "fh:u64 offset:u64 size:u32 read_flags:u32 lock_owner:u64 flags:u32 padding:u32")
WRITE_IN = _layout("write_in", "fh:u64 offset:u64 size:u32 write_flags:u32 lock_owner:u64 flags:u32 padding:u32")
WRITE_OUT = _layout("write_out", "size:u32 padding:u32")
FSYNC_IN = _layout("fsync_in", "fh:u64 fsync_flags:u32 padding:u32")
SETXATTR_IN = _layout("setxattr_in", "size:u32 flags:u32 setxattr_flags:u32 padding:u32")  # with SETXATTR_EXT
SETXATTR_IN_COMPAT = _layout("setxattr_in_compat", "size:u32 flags:u32")  # without it (FUSE_COMPAT_SETXATTR_IN_SIZE)
GETXATTR_IN = _layout("getxattr_in", "size:u32 padding:u32")
GETXATTR_OUT = _layout("getxattr_out", "size:u32 padding:u32")
ACCESS_IN = _layout("access_in", "mask:u32 padding:u32")
INTERRUPT_IN = _layout("interrupt_in", "unique:u64")
FALLOCATE_IN = _layout("fallocate_in", "fh:u64 offset:u64 length:u64 mode:u32 padding:u32")
LSEEK_IN = _layout("lseek_in", "fh:u64 offset:u64 whence:u32 padding:u32")
LSEEK_OUT = _layout("lseek_out", "offset:u64")
DIRENT_HEAD = _layout("dirent_head", "ino:u64 off:u64 namelen:u32 type:u32")  # + name, padded to 8
NOTIFY_INVAL_INODE_OUT = _layout("notify_inval_inode_out", "ino:u64 off:i64 len:i64")
NOTIFY_INVAL_ENTRY_OUT = _layout("notify_inval_entry_out", "parent:u64 namelen:u32 flags:u32")
NOTIFY_DELETE_OUT = _layout("notify_delete_out", "parent:u64 child:u64 namelen:u32 padding:u32")
BACKING_MAP = _layout("backing_map", "fd:i32 flags:u32 padding:u64")

LAYOUTS = [v for v in list(globals().values()) if isinstance(v, Layout)]

ENTRY_OUT_SIZE = ENTRY_OUT_HEAD.size + ATTR.size  # struct fuse_entry_out
ATTR_OUT_SIZE = ATTR_OUT_HEAD.size + ATTR.size  # struct fuse_attr_out
STATFS_OUT_SIZE = KSTATFS.size  # struct fuse_statfs_out
DIRENTPLUS_HEAD_SIZE = ENTRY_OUT_SIZE + DIRENT_HEAD.size  # struct fuse_direntplus, before the name
COMPAT_SETXATTR_IN_SIZE = SETXATTR_IN_COMPAT.size  # setxattr_in without SETXATTR_EXT


def dirent_size(namelen: int, *, plus: bool = False) -> int:
    """A READDIR(PLUS) record's size: the name padded to 64 bits."""
    head = DIRENTPLUS_HEAD_SIZE if plus else DIRENT_HEAD.size
    return (head + namelen + 7) & ~7


# ------------------------------------------------------------------ opcodes
_BEFORE_OPCODES = set(globals())
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE, STATFS, RELEASE = 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18
FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT = 20, 21, 22, 23, 24, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, GETLK, SETLK, SETLKW, ACCESS, CREATE = 27, 28, 29, 30, 31, 32, 33, 34, 35
INTERRUPT, BMAP, DESTROY, IOCTL, POLL, NOTIFY_REPLY, BATCH_FORGET, FALLOCATE = 36, 37, 38, 39, 40, 41, 42, 43
READDIRPLUS, RENAME2, LSEEK, COPY_FILE_RANGE, SETUPMAPPING, REMOVEMAPPING, SYNCFS, TMPFILE, STATX = (
    44, 45, 46, 47, 48, 49, 50, 51, 52)
# opcode -> its name (``aiturbo status``): every name the block above binds
OPCODE_NAMES = {v: k for k, v in globals().items() if k not in _BEFORE_OPCODES and not k.startswith("_")}

# notification codes (unique = 0, error = code)
NOTIFY_INVAL_INODE, NOTIFY_INVAL_ENTRY, NOTIFY_DELETE = 2, 3, 6

# ------------------------------------------------------------------ INIT flags (flags | flags2 << 32)
ASYNC_READ = 1 << 0
POSIX_LOCKS = 1 << 1
ATOMIC_O_TRUNC = 1 << 3
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
DONT_MASK = 1 << 6
SPLICE_WRITE = 1 << 7
SPLICE_MOVE = 1 << 8
SPLICE_READ = 1 << 9
FLOCK_LOCKS = 1 << 10
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
HANDLE_KILLPRIV = 1 << 19
POSIX_ACL = 1 << 20
ABORT_ERROR = 1 << 21
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
EXPLICIT_INVAL_DATA = 1 << 25
HANDLE_KILLPRIV_V2 = 1 << 28
SETXATTR_EXT = 1 << 29
INIT_EXT = 1 << 30
HAS_EXPIRE_ONLY = 1 << 35
DIRECT_IO_ALLOW_MMAP = 1 << 36
PASSTHROUGH = 1 << 37
NO_EXPORT_SUPPORT = 1 << 38
HAS_RESEND = 1 << 39

# ------------------------------------------------------------------ other flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3
FOPEN_NOFLUSH = 1 << 5
FOPEN_PARALLEL_DIRECT_WRITES = 1 << 6
FOPEN_PASSTHROUGH = 1 << 7

FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH, FATTR_ATIME_NOW, FATTR_MTIME_NOW = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
FATTR_LOCKOWNER, FATTR_CTIME, FATTR_KILL_SUIDGID = 1 << 9, 1 << 10, 1 << 11

RELEASE_FLUSH = 1 << 0
GETATTR_FH = 1 << 0
WRITE_CACHE = 1 << 0
WRITE_KILL_SUIDGID = 1 << 2
FSYNC_FDATASYNC = 1 << 0
EXPIRE_ONLY = 1 << 0

# ------------------------------------------------------------------ /dev/fuse ioctls
_IOC_WRITE, _IOC_READ = 1, 2
_DEV_IOC_MAGIC = 229


def _ioc(direction: int, number: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (_DEV_IOC_MAGIC << 8) | number


DEV_IOC_CLONE = _ioc(_IOC_READ, 0, 4)  # uint32_t: the session's /dev/fuse descriptor
DEV_IOC_BACKING_OPEN = _ioc(_IOC_WRITE, 1, BACKING_MAP.size)  # -> backing id (> 0)
DEV_IOC_BACKING_CLOSE = _ioc(_IOC_WRITE, 2, 4)  # uint32_t backing id
