"""Files as the tests write and read them: whole at once, one O_DIRECT read, a backend directory's objects and upload temporaries."""

import hashlib
import mmap
import os

from aiturbofs.backend import UPLOAD_TEMP_PREFIX


def put(path: str, data: bytes, *, fsync: bool = False) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def get(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pread_direct(path: str, offset: int, size: int) -> bytes:
    """One O_DIRECT read: the kernel sends it to the daemon as one request, page cache bypassed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with mmap.mmap(-1, size) as aligned:  # O_DIRECT wants a page-aligned buffer
            n = os.preadv(fd, [aligned], offset)
            return aligned[:n]
    finally:
        os.close(fd)


def upload_temps(root) -> list[str]:
    """The upload temporaries under ``root`` (a file:// backend, or a local backend's ``upload_tmp_dir``)."""
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.startswith(UPLOAD_TEMP_PREFIX)]


def local_objects(root) -> dict[str, bytes]:
    """Every file under ``root`` (a file:// backend): relative path -> bytes."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = get(p)
    return out
