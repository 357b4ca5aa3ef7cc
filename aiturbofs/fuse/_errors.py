"""The one place where errors become errno.

A pyfuse3 handler may raise only ``FUSEError``: anything else ends
``pyfuse3.main`` and unmounts the filesystem.  ``fuse_handler`` wraps every
handler: expected errors (``AiturboError``, ``OSError``) become their errno;
an unexpected exception is a bug, so it is logged with its traceback, counted
in ``aiturbo status``, and answered with EIO — the mount stays up for every
other user while the log says loudly what broke.
"""

import errno
import functools
import logging

import pyfuse3
import trio

from .._errors import AiturboError

log = logging.getLogger("aiturbofs.fuse")

# handlers of requests that change files: while they come the application writes, and uploads of
# closed files wait for a pause (``Filesystem.note_writing``, ``-o persist_yield``)
_WRITING = frozenset({"create", "write", "flush", "release", "setattr", "fallocate", "mknod", "mkdir", "symlink",
                      "link", "unlink", "rmdir", "rename"})

# errno values that are routine answers (a lookup miss), not worth a log line.
_QUIET = {errno.ENOENT, errno.ENODATA, errno.EEXIST, errno.ENOTEMPTY, errno.EOPNOTSUPP, errno.ENXIO}


def fuse_handler(fn):
    """Wrap an ``Operations`` coroutine so that it raises only FUSEError."""

    name = fn.__name__
    writing = name in _WRITING

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        if writing:
            self.fs.note_writing()
        try:
            self.faults.maybe_raise(name)
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except AiturboError as exc:
            if exc.errno not in _QUIET:
                log.warning("%s: %s (errno %s)", name, exc, errno.errorcode.get(exc.errno, exc.errno))
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            log.warning("%s: %s", name, exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except trio.Cancelled:
            raise
        except Exception as exc:  # a bug: say so loudly, keep the mount up
            log.exception("BUG in %s handler; answering EIO", name)
            self.fs.record_error(f"internal error in {name}: {exc!r}")
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class FaultInjector:
    """``-o debug_faults``: make the next call of a handler raise (tests only)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._armed: dict[str, int] = {}

    def arm(self, handler: str, count: int = 1) -> None:
        if not self.enabled:
            raise AiturboError("fault injection needs the debug_faults mount option", errno_=errno.EPERM)
        self._armed[handler] = self._armed.get(handler, 0) + count

    def maybe_raise(self, handler: str) -> None:
        if self._armed and self._armed.get(handler):
            self._armed[handler] -= 1
            raise RuntimeError(f"injected fault in {handler}")
