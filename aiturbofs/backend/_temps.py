"""Upload temp files that a killed process does not leave behind for good.

Owns: creating an upload's temp file under a lock it holds for its whole
life, and removing (reaping) temps no live process holds.  Blocking calls
only (the backends run them in worker threads).

The rule: a temp file's creator takes ``flock(LOCK_SH)`` on it right after
creating it and keeps it until the temp is published (renamed) or removed.
The kernel drops a lock with the last file descriptor of its holder, so a
killed daemon's temps are free.  A reaper removes a temp only under
``LOCK_EX`` taken without waiting, and only while the temp is still linked at
the name it opened: it can never take a temp from a live upload, and a
creator that loses the one race left (the reaper between its create and its
lock) sees its temp unlinked and makes another.  Other writers of an upload's
parts hold ``LOCK_SH`` while they write (file://), so they keep a reaper out
too.

Node temps (a symlink or special file made beside its name and renamed over
it) cannot be locked; they live for one blocking call, so one older than
``STALE_NODE_TEMP_S`` is a leftover.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable

from .._limits import STALE_NODE_TEMP_S
from ._base import UPLOAD_TEMP_PREFIX

log = logging.getLogger(__name__)

# Tries at a new name when a reaper took the temp between its create and its lock.
_CREATE_TRIES = 3


def create_locked(dir_fd: int, name_of: Callable[[], str], mode: int) -> tuple[str, int]:
    """Create a new file ``name_of()`` in the directory open at ``dir_fd``
    (O_RDWR, ``mode``) and hold ``LOCK_SH`` on it; returns its name and fd.

    O_RDWR: on NFS ``flock`` is a POSIX lock, and a shared one needs read
    access.  Raises ``OSError`` (``FileExistsError`` for a name in use).
    """
    for _ in range(_CREATE_TRIES):
        name = name_of()
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if still_linked(dir_fd, name, fd):
                return name, fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # reaped before we locked it: nothing was written yet
    raise OSError(errno.EAGAIN, "upload temps were removed as fast as they were made")


def still_linked(dir_fd: int, name: str, fd: int) -> bool:
    """True if ``name`` in the directory open at ``dir_fd`` still names the file open at ``fd``."""
    try:
        return os.path.samestat(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), os.fstat(fd))
    except (FileNotFoundError, NotADirectoryError):
        return False


def reap(dir_fd: int, name: str) -> bool:
    """Remove the upload temp ``name`` (in the directory open at ``dir_fd``)
    if no live process holds it; True if removed.

    Best effort: a temp this process may not open or remove stays (logged).
    """
    try:
        return _reap(dir_fd, name)
    except OSError as e:
        log.info("could not look at upload temp %s: %s", name, e.strerror or e)
        return False


def _reap(dir_fd: int, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not stat.S_ISREG(st.st_mode):
        # Never opened (a device's open has effects): a node temp is old or in use.
        if time.time() - st.st_ctime < STALE_NODE_TEMP_S:
            return False
        return _unlink(dir_fd, name)
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # an upload (or a writer of its parts) is alive
        if not still_linked(dir_fd, name, fd):
            return False  # published or removed meanwhile: another file may have the name now
        return _unlink(dir_fd, name)
    finally:
        os.close(fd)  # also drops the lock


def sweep(dir_fd: int, what: str) -> int:
    """Reap every upload temp in the directory open at ``dir_fd`` (named
    ``what`` in the log) that no live process holds; returns how many."""
    try:
        listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            with os.scandir(listing) as entries:
                names = [e.name for e in entries if e.name.startswith(UPLOAD_TEMP_PREFIX)]
        finally:
            os.close(listing)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    except OSError as e:  # best effort, like reap
        log.info("could not look for upload temps in %s: %s", what, e.strerror or e)
        return 0
    reaped = sum(reap(dir_fd, name) for name in names)
    if reaped:
        log.info("removed %d upload temp file(s) in %s left by a process that died", reaped, what)
    return reaped


def _unlink(dir_fd: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True
