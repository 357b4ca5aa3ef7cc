"""The error vocabulary of aiturbofs.

Every operating error a layer can raise is an ``AiturboError`` carrying the
errno a POSIX caller should see.  Only ``aiturbofs.fuse`` turns these into
``pyfuse3.FUSEError``; lower layers never import pyfuse3.  Programmer errors
(bugs) are not in this module: they are plain exceptions and crash loudly.
"""

import errno


class AiturboError(Exception):
    """Base of all expected, user-visible errors."""

    errno = errno.EIO

    def __init__(self, message: str = "", *, errno_: int | None = None):
        super().__init__(message)
        if errno_ is not None:
            self.errno = errno_


class NotFound(AiturboError):
    errno = errno.ENOENT


class Exists(AiturboError):
    errno = errno.EEXIST


class NotEmpty(AiturboError):
    errno = errno.ENOTEMPTY


class NotADirectory(AiturboError):
    errno = errno.ENOTDIR


class IsADirectory(AiturboError):
    errno = errno.EISDIR


class InvalidArgument(AiturboError):
    errno = errno.EINVAL


class NameTooLong(AiturboError):
    errno = errno.ENAMETOOLONG


class NoAttribute(AiturboError):
    errno = errno.ENODATA


class NotPermitted(AiturboError):
    errno = errno.EPERM


class AccessDenied(AiturboError):
    errno = errno.EACCES


class NotSupported(AiturboError):
    errno = errno.EOPNOTSUPP


class FileTooBig(AiturboError):
    errno = errno.EFBIG


class NoDataAfter(AiturboError):
    """lseek(SEEK_DATA / SEEK_HOLE) at or past the end of the file, or no data after the offset."""

    errno = errno.ENXIO


class OutOfRange(AiturboError):
    errno = errno.ERANGE


class CrossDevice(AiturboError):
    errno = errno.EXDEV


class TooManyLinks(AiturboError):
    errno = errno.EMLINK


class NoSpace(AiturboError):
    errno = errno.ENOSPC


class BrokenFile(AiturboError):
    """The file's data was lost or its persist failed for good: reads get EIO."""

    errno = errno.EIO


class IntegrityError(AiturboError):
    """A chunk's bytes do not match its BLAKE3 hash."""

    errno = errno.EIO


class BackendError(AiturboError):
    """The backend refused an operation for good (permission, bad key...)."""

    errno = errno.EIO


class BackendNotFound(BackendError):
    errno = errno.ENOENT


class SourceChanged(BackendError):
    """A conditional read or server-side copy found its object replaced (another etag): a copy uploads the
    bytes instead; a reader of an imported object gets ESTALE until the new version is listed."""

    errno = errno.ESTALE


class TransientBackendError(BackendError):
    """5xx, timeout, connection refused: worth retrying with backoff."""

    errno = errno.EAGAIN


class BackendUnreachable(TransientBackendError):
    """No answer at all: connection refused or reset, or a timeout (a brownout).

    Unlike a 5xx, which the backend answers, this marks the backend
    unavailable (``store.BackendHealth``) until it answers again."""


class BackendUnavailable(AiturboError):
    """A read needed the backend, which did not answer in time: that read fails, not the mount."""

    errno = errno.EIO


class ConfigError(AiturboError):
    """A bad mount option or config value; the message says which and why."""

    errno = errno.EINVAL


class MetaUnavailable(AiturboError):
    """The metadata engine did not answer (connection lost or refused, busy, a
    statement timed out): the same call may succeed later."""


class MissingExtra(ConfigError):
    """An option needs an optional dependency (a pip extra) that is not installed."""


def missing_extra(what: str, extra: str, exc: ImportError) -> MissingExtra:
    """The error for ``what`` needing the pip extra ``extra``; ``exc`` is the failed import."""
    return MissingExtra(f"{what} needs the '{extra}' extra, which is not installed ({exc.name or exc}): "
                        f"pip install 'aiturbofs[{extra}]'")


class PeerBroken(AiturboError):
    """A fabric peer failed: connection lost or refused, no reply in time, or a malformed frame.

    The connection is dead: every pending and later call on it raises this.
    Reconnect, or fetch the chunk from another replica or the backend.
    """

    errno = errno.EIO


class PeerSlow(AiturboError):
    """A fabric peer did not answer one long request in time; the connection stays up.

    Only for calls made with ``keep_on_timeout`` (work that may take long on
    the peer, such as an upload to the backend): its late reply is dropped.
    """

    errno = errno.ETIMEDOUT


class PeerClosed(AiturboError):
    """A call on a fabric peer that this node itself closed (a bug or a shutdown race)."""

    errno = errno.ESHUTDOWN


class AuthFailed(AiturboError):
    """A fabric peer failed the cluster-secret handshake (or rejected ours).

    Not a ``PeerBroken``: retrying will not help until the secrets agree.
    """

    errno = errno.EACCES


class RemoteError(AiturboError):
    """A fabric peer answered one request with an error; the connection stays usable."""

    errno = errno.EIO


class MalformedMessage(InvalidArgument):
    """A control message (``aiturbofs.messages``) that does not fit its declaration: an unknown op, a field
    missing or of the wrong JSON type.

    A request fails with it alone (the fabric answers it as that request's
    error); an answer that does not fit fails the call that asked.
    """
