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


def create_locked(directory: str, name_of: Callable[[], str], mode: int) -> tuple[str, int]:
    """Create a new file ``directory/name_of()`` (O_RDWR, ``mode``) and hold
    ``LOCK_SH`` on it; returns its path and fd.

    O_RDWR: on NFS ``flock`` is a POSIX lock, and a shared one needs read
    access.  Raises ``OSError`` (``FileExistsError`` for a name in use).
    """
    for _ in range(_CREATE_TRIES):
        path = os.path.join(directory, name_of())
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if still_linked(path, fd):
                return path, fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # reaped before we locked it: nothing was written yet
    raise OSError(errno.EAGAIN, f"upload temps in {directory} were removed as fast as they were made")


def still_linked(path: str, fd: int) -> bool:
    """True if ``path`` still names the file open at ``fd``."""
    try:
        return os.path.samestat(os.stat(path, follow_symlinks=False), os.fstat(fd))
    except (FileNotFoundError, NotADirectoryError):
        return False


def reap(path: str) -> bool:
    """Remove the upload temp at ``path`` if no live process holds it; True if removed.

    Best effort: a temp this process may not open or remove stays (logged).
    """
    try:
        return _reap(path)
    except OSError as e:
        log.info("could not look at upload temp %s: %s", path, e.strerror or e)
        return False


def _reap(path: str) -> bool:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if not stat.S_ISREG(st.st_mode):
        # Never opened (a device's open has effects): a node temp is old or in use.
        if time.time() - st.st_ctime < STALE_NODE_TEMP_S:
            return False
        return _unlink(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # an upload (or a writer of its parts) is alive
        if not still_linked(path, fd):
            return False  # published or removed meanwhile: another file may have the name now
        return _unlink(path)
    finally:
        os.close(fd)  # also drops the lock


def sweep(directory: str) -> int:
    """Reap every upload temp in ``directory`` no live process holds; returns how many."""
    try:
        with os.scandir(directory) as entries:
            names = [e.name for e in entries if e.name.startswith(UPLOAD_TEMP_PREFIX)]
    except (FileNotFoundError, NotADirectoryError):
        return 0
    except OSError as e:  # best effort, like reap
        log.info("could not look for upload temps in %s: %s", directory, e.strerror or e)
        return 0
    reaped = sum(reap(os.path.join(directory, name)) for name in names)
    if reaped:
        log.info("removed %d upload temp file(s) in %s left by a process that died", reaped, directory)
    return reaped


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
