"""mount(2) and umount2(2), which Python's os module lacks: the staging tmpfs, the FUSE session, the passthrough
probe; and the fallocate(2) mode bits."""

import ctypes
import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 0x1, 0x2, 0x4, 0x20
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10
_MNT_DETACH = 0x2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount(source: str, target: str, fstype: str, flags: int, data: str) -> int:
    """mount(2); 0, or the errno it failed with."""
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()):
        return ctypes.get_errno()
    return 0


def unmount_lazy(target: str) -> int:
    """umount2(target, MNT_DETACH); 0, or the errno it failed with."""
    if _libc.umount2(target.encode(), _MNT_DETACH):
        return ctypes.get_errno()
    return 0


def is_mount_point(path: str) -> bool:
    path = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def fsync_dir(path: str) -> None:
    """fsync the directory ``path``: the names made or moved in it are on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
