"""The object-storage interface every backend implements, and what they share.

Owns: ``ObjectInfo``, the ``Backend`` / ``Upload`` contracts, key validation
(a key can never name anything outside the backend root), the part ledger
that decides when an upload may complete, the format of the tokens with
which other processes write parts, and the one way a blocking call leaves
the trio thread.  Must never import anything of the filesystem above it
except ``aiturbofs._limits`` and ``aiturbofs._errors``, and must never
retry: the caller (the persister) owns retries and backoff.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from .._errors import (
    BackendError,
    BackendNotFound,
    BackendUnreachable,
    ConfigError,
    InvalidArgument,
    NotSupported,
)
from .._limits import (
    BACKEND_CALL_TIMEOUT_S,
    BACKEND_COPY_PART_BYTES,
    CHUNK_BYTES,
    FILE_SIZE_BYTES_MAX,
    PATH_BYTES_MAX,
    UPLOAD_TOKEN_BYTES_MAX,
    ZERO_BLOCK_BYTES,
    ZERO_RUN_BYTES,
    ZERO_SAMPLE_STRIDE_BYTES,
)
from .._threads import background

# Hidden names of half-written uploads: no listing ever shows them, and no
# key may use them, so a user file can never collide with one.
UPLOAD_TEMP_PREFIX = ".aiturbo-upload."
# An object the persister moved out of a name another file takes first (a swap of names), or of an unlinked
# file still open: never a file of the namespace (the importer skips it).
ASIDE_PREFIX = ".aiturbo-aside."

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # full key relative to the backend root
    size: int  # 0 for directories
    mtime_ns: int  # 0 if unknown
    etag: str | None  # changes when content changes; None for directories
    is_dir: bool
    # st_mode (type bits included) where the listing shows it: on a backend
    # that keeps attributes (``Backend.keeps_attrs``) every entry's, elsewhere
    # only a node's the listing itself shows to be other than a plain object;
    # 0 where the listing cannot tell (S3: see ``Backend.node_probe_bytes_max``).
    mode: int = 0
    uid: int | None = None  # the owner, where the backend keeps attributes
    gid: int | None = None


@dataclass(frozen=True)
class NodeAttrs:
    """A namespace node as the backend holds it (see docs/design.md, "What the
    backend holds"): all of a symlink, directory or special file; of a regular
    file, what a backend that keeps attributes stores beside its bytes.

    ``mode`` is the full st_mode (type bits included); ``target`` is a
    symlink's target, ``rdev`` a device's number.  ``uid``/``gid``/``mtime_ns``
    are None where the backend does not record them.
    """

    mode: int
    uid: int | None = None
    gid: int | None = None
    mtime_ns: int | None = None
    rdev: int = 0
    target: bytes | None = None


# --- keys ---------------------------------------------------------------------


def check_key(key: str, *, allow_root: bool = False) -> str:
    """Return ``key`` if it is a valid key, else raise ``BackendError``.

    A key is '/'-separated and relative: no leading or trailing '/', no empty,
    '.' or '..' component, no NUL, no reserved upload-temp name, at most
    PATH_BYTES_MAX bytes.  '' is the root and is accepted only when
    ``allow_root``.  These rules are what keeps every path inside the root.
    """
    if not isinstance(key, str):
        raise TypeError(f"backend key must be str, not {type(key).__name__}")
    if key == "":
        if allow_root:
            return key
        raise BackendError("the backend root '' is not an object key")
    problem = _key_problem(key)
    if problem:
        raise BackendError(f"bad backend key {key!r}: {problem}")
    return key


def is_valid_name(name: str) -> bool:
    """True if ``name`` can be one component of a key (used to filter listings)."""
    return "/" not in name and name != "" and _key_problem(name) is None


def _key_problem(key: str) -> str | None:
    if key.startswith("/"):
        return "absolute"
    if "\0" in key:
        return "contains NUL"
    if len(key.encode("utf-8", "surrogateescape")) > PATH_BYTES_MAX:
        return f"longer than {PATH_BYTES_MAX} bytes"
    for part in key.split("/"):
        if part in ("", ".", ".."):
            return "empty, '.' or '..' component"
        if part.startswith(UPLOAD_TEMP_PREFIX):
            return f"names starting with {UPLOAD_TEMP_PREFIX!r} are reserved"
    return None


def join_key(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def parent_key(key: str) -> str:
    return key.rpartition("/")[0]


# --- options ----------------------------------------------------------------------


def take_options(options: dict[str, Any], allowed: set[str], scheme: str) -> dict[str, Any]:
    """Return ``options`` after checking every name applies to ``scheme``.

    A misspelt option must not be ignored silently (``s3_endpiont`` would
    send data to AWS), so unknown names raise ``ConfigError``.
    """
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(
            f"backend option(s) {', '.join(unknown)} do not apply to {scheme}:// "
            f"(known: {', '.join(sorted(allowed))})"
        )
    return options


def option_float(options: dict[str, Any], name: str, default: float) -> float:
    """A positive number option; mount options arrive as strings."""
    value = options.get(name, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"backend option {name}={value!r} is not a number") from None
    if not number > 0:
        raise ConfigError(f"backend option {name}={value!r} must be > 0")
    return number


def option_bool(options: dict[str, Any], name: str, default: bool) -> bool:
    value = options.get(name, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"backend option {name}={value!r} is not a boolean")


# --- remote-part tokens ----------------------------------------------------------------


def make_token(kind: str, key: str, part_bytes: int, **fields: str) -> str:
    """The token of an upload of ``key``: JSON, ASCII (keys may hold escaped surrogates).

    Raises ``BackendError`` (ENAMETOOLONG) beyond UPLOAD_TOKEN_BYTES_MAX,
    which only keys full of escaped characters reach.
    """
    token = json.dumps({"kind": kind, "key": key, "part_bytes": part_bytes, **fields}, separators=(",", ":"))
    if len(token) > UPLOAD_TOKEN_BYTES_MAX:
        raise BackendError(f"upload token of {key!r} is over {UPLOAD_TOKEN_BYTES_MAX} bytes", errno_=errno.ENAMETOOLONG)
    return token


def parse_token(token: str, kind: str, key: str, part_bytes: int, *names: str) -> list[str]:
    """The string fields ``names`` of a ``make_token`` token for ``key`` on this kind of backend.

    Raises ``InvalidArgument`` if the token is malformed, too long, for
    another kind of backend or another key, or was made for another part size.
    """
    if not isinstance(token, str):
        raise TypeError(f"upload token must be str, not {type(token).__name__}")
    try:
        if len(token) > UPLOAD_TOKEN_BYTES_MAX:
            raise ValueError(f"longer than {UPLOAD_TOKEN_BYTES_MAX} characters")
        fields = json.loads(token)
        if not isinstance(fields, dict) or fields.get("kind") != kind:
            raise ValueError(f"not a token of a {kind}:// upload")
        values = [value for name in names if isinstance(value := fields.get(name), str) and value]
        if len(values) != len(names):
            raise ValueError(f"want non-empty strings {', '.join(names)}")
    except ValueError as e:  # json.JSONDecodeError included
        raise InvalidArgument(f"bad upload token for {key!r}: {e}") from None
    if fields.get("key") != key:
        raise InvalidArgument(f"upload token is for {fields.get('key')!r}, not {key!r}")
    if fields.get("part_bytes") != part_bytes:
        raise InvalidArgument(f"upload token of {key!r} is for {fields.get('part_bytes')}-byte parts, not {part_bytes}")
    return values


def byte_view(data: Buffer) -> Buffer:
    """``data`` such that ``len()`` counts bytes, not items."""
    if isinstance(data, memoryview) and (data.ndim != 1 or data.format not in ("B", "b", "c")):
        return data.cast("B")
    return data


# --- leaving the trio thread ----------------------------------------------------------


async def run_sync(
    limiter: trio.CapacityLimiter,
    timeout_s: float,
    what: str,
    fn: Callable[..., T],
    *args: Any,
    abandon_on_cancel: bool = True,
) -> T:
    """Run blocking ``fn(*args)`` in a worker thread behind ``limiter``.

    Raises ``BackendUnreachable`` when ``timeout_s`` passes (waiting for a
    thread slot counts), and whatever ``fn`` raises.  A call with ``abandon_on_cancel`` is
    abandoned on timeout or cancellation: the thread keeps its limiter slot
    until it really ends, and its result is dropped.  Calls that write from a
    caller's buffer or into shared file state pass ``abandon_on_cancel=False``: the
    kernel cannot stop them anyway, and abandoning one would let a stale
    write land after the caller re-sent the part.  Such a call returns only
    when the thread is done, so the deadline then bounds only the wait for a
    slot.
    """
    try:
        with trio.fail_after(timeout_s):
            return await trio.to_thread.run_sync(background, fn, *args, limiter=limiter, abandon_on_cancel=abandon_on_cancel)
    except trio.TooSlowError:
        raise BackendUnreachable(f"{what}: no answer within {timeout_s:g} s") from None


def pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (blocking; run it in a thread)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


_FALLOC_FL_KEEP_SIZE = 0x01  # <linux/falloc.h>
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _fallocate.restype = ctypes.c_int
# fallocate cannot punch here: the range is overwritten with zeros instead
_NO_PUNCH_ERRNOS = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Make ``[offset, offset+length)`` of ``fd`` read as zeros, keeping the size.

    Blocking (run it in a thread).  Beyond the end of the file nothing is
    done (a later ftruncate reads as zeros there); inside it the range is
    deallocated (a hole), or written with zeros where the filesystem
    cannot punch (bounded pieces).  Raises ``OSError``.
    """
    end = min(offset + length, os.fstat(fd).st_size)
    if end <= offset:
        return
    if _fallocate is not None:
        if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, end - offset) == 0:
            return
        err = ctypes.get_errno()
        if err not in _NO_PUNCH_ERRNOS:
            raise OSError(err, os.strerror(err))
    zeros = memoryview(bytes(ZERO_BLOCK_BYTES))
    for at in range(offset, end, ZERO_BLOCK_BYTES):
        pwrite_all(fd, zeros[: min(ZERO_BLOCK_BYTES, end - at)], at)


_ZERO_RUN = bytes(ZERO_RUN_BYTES)


def pwrite_sparse(fd: int, data: Buffer, offset: int) -> None:
    """``pwrite_all``, but aligned ZERO_RUN_BYTES runs of zeros become holes (blocking).

    A chunk with 1 MiB of data in a hole (a write into a sparse file) then
    costs 1 MiB on disk, not the chunk's 8 MiB.  Zero runs are punched, so a
    part written again over older bytes still reads right.
    """
    view = memoryview(data).cast("B")
    start = 0  # of the pending run
    pending_zero = False
    for at in range(0, len(view), ZERO_RUN_BYTES):
        block = view[at : at + ZERO_RUN_BYTES]
        zero = (len(block) == ZERO_RUN_BYTES and not any(block[::ZERO_SAMPLE_STRIDE_BYTES])
                and bytes(block) == _ZERO_RUN)
        if zero != pending_zero and at > start:
            _flush_run(fd, view, start, at, offset, pending_zero)
            start = at
        pending_zero = zero
    if len(view) > start:
        _flush_run(fd, view, start, len(view), offset, pending_zero)


def _flush_run(fd: int, view: memoryview, start: int, stop: int, offset: int, zero: bool) -> None:
    if zero:
        punch_hole(fd, offset + start, stop - start)
    else:
        pwrite_all(fd, view[start:stop], offset + start)


# --- contracts ---------------------------------------------------------------------------


class Upload(ABC):
    """One new version of object ``key``, written part by part, published at once.

    Part ``index`` covers bytes ``[index * part_bytes, ...)``; every part but
    the last is exactly ``part_bytes`` long.  Parts may arrive in any order
    and concurrently, and may be re-sent: the last successful write of a part
    wins.  A part whose latest write failed counts as missing, since a failed
    write may have left half of its bytes behind.  Nothing is visible at
    ``key`` before ``complete`` returns.  Callers must end every upload with
    ``complete`` or ``abort`` (put ``abort`` in a ``finally``).

    Where ``Backend.supports_remote_parts``, other processes (other hosts
    sharing the backend) may write parts too: ``token`` names the upload,
    ``Backend.write_remote_part`` writes a part with it and returns a
    receipt, and ``add_remote_part`` enters that part in this upload's
    ledger.  The owner must not ``complete`` while a remote write of a part
    may still be running: wait for its receipt or its failure first.

    Misuse that only a bug can cause (negative index, oversized part,
    ``complete`` while parts are still being written) raises ``ValueError``.
    """

    def __init__(self, key: str, part_bytes: int):
        self.key = key
        self.part_bytes = part_bytes
        self._part_lengths: dict[int, int] = {}
        self._state = "open"  # -> "completing" -> "completed" | "open"; any -> "aborted"
        self._ops_in_flight = 0
        self._idle = trio.Event()
        self._idle.set()

    async def write_part(self, index: int, data: Buffer) -> None:
        """Store ``data`` as part ``index``.

        ``data`` is borrowed only until this returns or raises.  Raises
        ``TransientBackendError`` (worth retrying), ``BackendError`` (the
        upload was completed or aborted, or the backend refused).
        """
        data = byte_view(data)
        self._check_part(index, len(data))
        await self._part_op(index, len(data), self._write_part, index, data)

    async def copy_part(
        self, index: int, src_key: str, offset: int, length: int, *, if_etag: str | None = None
    ) -> None:
        """Make part ``index`` bytes ``[offset, offset+length)`` of object ``src_key``.

        Server-side where ``Backend.supports_server_copy``; otherwise the
        bytes pass through this process.  With ``if_etag``, only from the
        version of ``src_key`` whose ``ObjectInfo.etag`` that is: any other
        raises ``SourceChanged`` and the part counts as missing (write its
        bytes instead).  Raises ``BackendNotFound`` if ``src_key`` is
        missing, ``BackendError`` if it is shorter than the range or the key
        is bad, ``TransientBackendError``.
        """
        check_key(src_key)
        if offset < 0:
            raise ValueError(f"copy_part offset {offset} < 0")
        self._check_part(index, length)
        await self._part_op(index, length, self._copy_part, index, src_key, offset, length, if_etag)

    async def zero_part(self, index: int, length: int) -> tuple[int, int]:
        """Make part ``index`` ``length`` zero bytes: a hole of the file.

        Where the backend can, none of it is sent or stored: a local object
        keeps a hole, S3 copies the part server-side from one hidden object
        of zeros (uploaded once).  Elsewhere the zeros are written like any
        part.  Returns (bytes sent from this process, bytes copied
        server-side), for the metrics.  Raises like ``write_part``.
        """
        self._check_part(index, length)
        return await self._part_op(index, length, self._zero_part, index, length)

    async def token(self) -> str:
        """A string with which another process writes parts of this upload
        (``Backend.write_remote_part``); the same for every call.

        Raises ``NotSupported`` unless ``Backend.supports_remote_parts``,
        ``BackendError`` if the upload is no longer open, and (S3, which
        creates its multipart upload here) ``TransientBackendError``.
        """
        self._check_open()
        return await self._token()

    def add_remote_part(self, index: int, length: int, receipt: str) -> None:
        """Enter part ``index`` of ``length`` bytes, written elsewhere with the
        receipt ``receipt``, in the ledger: ``complete`` then includes it.

        Like ``write_part``, the latest entry of a part wins.  Raises
        ``InvalidArgument`` for a malformed receipt (or, locally, one that
        contradicts ``length``), ``BackendError`` if the upload is not open,
        ``NotSupported`` where there are no remote parts.
        """
        self._check_part(index, length)
        if not isinstance(receipt, str) or not 0 < len(receipt) <= UPLOAD_TOKEN_BYTES_MAX:
            raise InvalidArgument(f"bad receipt for part {index} of {self.key!r}: {receipt!r:.100}")
        self._add_remote_part(index, length, receipt)
        self._part_lengths[index] = length

    async def complete(self, size: int, *, attrs: NodeAttrs | None = None) -> ObjectInfo:
        """Publish the object at ``key`` with ``size`` bytes, replacing any old one.

        Where the backend ``keeps_attrs``, the object has ``attrs``' permission
        bits, owner and mtime from the moment it is visible (an upload's temp
        object is readable by its owner only, before and after); without
        ``attrs`` it gets the backend's defaults.  Others ignore ``attrs``.

        Parts ``0 .. ceil(size / part_bytes) - 1`` must all be present with the
        right lengths (no part at all for an empty object), else
        ``BackendError`` and nothing changes.  Raises ``BackendError`` if the
        upload was aborted or the server refuses or disagrees on the size, and
        ``TransientBackendError``, after which it may be retried.  Returns the
        published object's info (``mtime_ns`` may be 0, unknown: an S3
        PutObject's answer has none, and a HEAD only for it costs a request).
        """
        if self._ops_in_flight:
            raise ValueError(f"complete({self.key!r}) while {self._ops_in_flight} part writes are in flight")
        self._check_open()
        part_count = self._check_ledger(size)
        self._state = "completing"  # no part may change under the publish
        try:
            with self._in_flight():
                info = await self._complete(size, part_count, attrs)
        except BaseException:
            if self._state == "completing":
                self._state = "open"  # a retry may follow
            raise
        self._state = "completed"
        return info

    async def abort(self) -> None:
        """Discard every part; a no-op after ``complete`` or an earlier ``abort``.

        Waits for part writes still in flight to end first (they are bounded
        by the call timeout), so no write can land after the discard.  Never
        raises because the upload is already gone; may raise
        ``TransientBackendError`` (retry it) or ``BackendError``.
        """
        if self._state == "completed":
            return
        self._state = "aborted"  # refuse new parts from now on
        await self._idle.wait()
        if self._state != "completed":  # a complete() in flight may have won
            await self._abort()

    # -- the primitives each backend implements --

    @abstractmethod
    async def _write_part(self, index: int, data: Buffer) -> None: ...

    @abstractmethod
    async def _copy_part(self, index: int, src_key: str, offset: int, length: int, if_etag: str | None) -> None: ...

    @abstractmethod
    async def _complete(self, size: int, part_count: int, attrs: NodeAttrs | None) -> ObjectInfo: ...

    @abstractmethod
    async def _abort(self) -> None:
        """Idempotent: may run again after a failure or after a failed complete."""

    async def _zero_part(self, index: int, length: int) -> tuple[int, int]:
        await self._write_part(index, bytes(length))
        return length, 0

    async def _token(self) -> str:
        raise NotSupported(f"upload of {self.key!r}: this backend cannot take parts from other processes")

    def _add_remote_part(self, index: int, length: int, receipt: str) -> None:
        raise NotSupported(f"upload of {self.key!r}: this backend cannot take parts from other processes")

    # -- ledger --

    def _check_part(self, index: int, length: int) -> None:
        if index < 0:
            raise ValueError(f"part index {index} < 0")
        if not 0 < length <= self.part_bytes:
            raise ValueError(f"part {index} of {self.key!r}: {length} bytes, want 1..{self.part_bytes}")
        self._check_open()

    def _check_open(self) -> None:
        if self._state != "open":
            raise BackendError(f"upload of {self.key!r} was already {self._state}")

    async def _part_op(self, index: int, length: int, op, *args: Any) -> Any:
        with self._in_flight():
            try:
                # A cancelled write fails even where the backend would not block.
                await trio.lowlevel.checkpoint_if_cancelled()
                result = await op(*args)
            except BaseException:
                self._part_lengths.pop(index, None)
                raise
            self._part_lengths[index] = length
            return result

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """Count an operation that ``abort`` must wait for."""
        if not self._ops_in_flight:
            self._idle = trio.Event()
        self._ops_in_flight += 1
        try:
            yield
        finally:
            self._ops_in_flight -= 1
            if not self._ops_in_flight:
                self._idle.set()

    def _check_ledger(self, size: int) -> int:
        """Return the part count for ``size``, or raise ``BackendError`` naming what is wrong."""
        if size < 0:
            raise ValueError(f"complete({self.key!r}) with size {size} < 0")
        count = math.ceil(size / self.part_bytes)
        want = {i: self.part_bytes for i in range(count)}
        if count:
            want[count - 1] = size - (count - 1) * self.part_bytes
        if self._part_lengths != want:
            missing = sorted(set(want) - set(self._part_lengths))[:5]
            extra = sorted(set(self._part_lengths) - set(want))[:5]
            wrong = [f"{i} ({self._part_lengths[i]} bytes, want {want[i]})"
                     for i in sorted(i for i in want if self._part_lengths.get(i, want[i]) != want[i])[:5]]
            raise BackendError(
                f"cannot complete {self.key!r} at {size} bytes: "
                f"missing parts {missing}, unexpected parts {extra}, wrong-length parts [{', '.join(wrong)}]"
            )
        return count


class Backend(ABC):
    """Object storage under one root, addressed by keys (see ``check_key``).

    Every method validates its keys first (``BackendError`` on a bad key) and
    may raise ``TransientBackendError`` (timeout, connection trouble, 5xx:
    retry later) or ``BackendError`` (refused for good: permission, bad
    request), with a message naming the key and the cause.  Nothing here
    retries.
    """

    url: str
    supports_server_copy: bool = False  # copy_part and copy move no bytes through this process
    supports_remote_parts: bool = False  # Upload.token / write_remote_part work (see Upload)
    key_bytes_max: int = PATH_BYTES_MAX  # the longest key (UTF-8 bytes) the store can name
    object_bytes_max: int = FILE_SIZE_BYTES_MAX  # the largest object the store can hold
    parts_max: int | None = None  # the most parts one Upload may have (None: no limit)
    # File types (stat.S_IFMT values) that ``write_node`` can keep; the others
    # live in the metadata only.
    node_kinds: frozenset[int] = frozenset()
    # A listed object at most this big may be a node (a symlink's body is its
    # target, a FIFO's is empty) that only ``read_node`` can tell: -1 where
    # the listing itself tells (``ObjectInfo.mode``).
    node_probe_bytes_max: int = -1
    # Objects and directories carry permission bits, owner and mtime
    # (``Upload.complete``'s and ``copy``'s ``attrs``, ``set_attrs``), and
    # listings show them (``ObjectInfo.mode``, ``uid``, ``gid``, ``mtime_ns``).
    keeps_attrs: bool = False

    @classmethod
    @abstractmethod
    async def open(cls, url: str, options: dict[str, Any], *, check: bool = True) -> Backend:
        """Connect to ``url``; raise ``ConfigError`` for a bad URL or option.

        With ``check`` (the default), ``check()`` it too.  Without, nothing is
        asked of the storage yet: a mount checks it under its own deadline.
        """

    @abstractmethod
    async def check(self) -> None:
        """Ask the storage whether it can be used (the bucket, the root directory).

        Raises ``BackendError`` if it refuses for good (missing bucket, no
        permission, unusable root): a configuration error.  Raises
        ``TransientBackendError`` if it does not answer (refused connection,
        timeout, 5xx).  Bounded only by the call timeout; callers that must
        not wait that long put their own deadline around it.
        """

    @abstractmethod
    async def list_dir(self, key: str) -> list[ObjectInfo]:
        """Direct children of directory ``key`` ('' is the root); [] if it is missing.

        Upload temp objects and names that are not valid key components are
        skipped.  Raises ``BackendError`` past LIST_ENTRIES_MAX entries.
        """

    @abstractmethod
    async def stat(self, key: str) -> ObjectInfo | None:
        """Info of the object or directory ``key``, or None if neither exists."""

    @abstractmethod
    async def read_range(self, key: str, offset: int, length: int, *, if_etag: str | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of object ``key``; short only at EOF.

        With ``if_etag``, the bytes (and where EOF falls) come only from the
        version whose ``ObjectInfo.etag`` (as ``stat`` and ``list_dir``
        report it) that is; if the object now has another, raises
        ``SourceChanged``: an object another writer replaced is never read
        as a mix of two versions.  Raises ``BackendNotFound`` if the object
        is missing, with or without ``if_etag``.
        """

    async def open_upload(self, key: str, *, part_bytes: int = CHUNK_BYTES) -> Upload:
        """Start writing a new version of object ``key`` (see ``Upload``)."""
        check_key(key)
        return await self._open_upload(key, part_bytes)

    @abstractmethod
    async def _open_upload(self, key: str, part_bytes: int) -> Upload: ...

    async def write_remote_part(
        self, key: str, token: str, index: int, data: Buffer, *, part_bytes: int = CHUNK_BYTES
    ) -> str:
        """Write ``data`` as part ``index`` of the upload of ``key`` that ``token``
        (``Upload.token``, maybe of another process) names; return the receipt
        the upload's owner passes to ``Upload.add_remote_part``.

        ``part_bytes`` must be the upload's.  ``data`` is borrowed until this
        returns.  Raises ``NotSupported`` unless ``supports_remote_parts``,
        ``InvalidArgument`` for a malformed token or one for another key,
        ``BackendNotFound`` if the upload was completed or aborted,
        ``BackendError``, ``TransientBackendError``.  A write racing the
        owner's ``abort`` may succeed into nothing.
        """
        check_key(key)
        data = byte_view(data)
        if index < 0 or not 0 < len(data) <= part_bytes:
            raise ValueError(f"remote part {index} of {key!r}: {len(data)} bytes, want 1..{part_bytes}")
        if not self.supports_remote_parts:
            raise NotSupported(f"{self.url}: this backend cannot take parts from other processes")
        return await self._write_remote_part(key, token, index, data, part_bytes)

    async def _write_remote_part(self, key: str, token: str, index: int, data: Buffer, part_bytes: int) -> str:
        raise NotImplementedError("a backend that supports_remote_parts implements _write_remote_part")

    async def copy(self, src: str, dst: str, *, attrs: NodeAttrs | None = None) -> None:
        """Copy object ``src`` to ``dst`` (replacing it), creating parent dirs.

        The default copies part by part through ``copy_part`` and publishes
        atomically, with ``attrs`` as ``Upload.complete`` takes them.  Raises
        ``BackendNotFound`` if ``src`` is missing, ``BackendError`` if it is a
        directory.
        """
        check_key(dst)
        await self._copy_by_parts(await self._stat_object(src), dst, attrs)

    @abstractmethod
    async def move(self, src: str, dst: str) -> None:
        """Move object ``src`` to ``dst`` (replacing it), creating parent dirs.

        Raises ``BackendNotFound`` if ``src`` is missing.
        """

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove object ``key``; a missing object is not an error."""

    async def write_node(self, key: str, node: NodeAttrs) -> None:
        """Make ``key`` hold ``node`` (replacing an object there), creating
        parent dirs.  A directory node is the directory ``key`` itself (its
        marker where directories are not real).  Raises ``NotSupported`` for
        a file type not in ``node_kinds``."""
        check_key(key)
        if stat.S_IFMT(node.mode) not in self.node_kinds:
            raise NotSupported(f"{self.url} cannot hold a node of type {stat.S_IFMT(node.mode):o} at {key!r}")
        await self._write_node(key, node)

    async def _write_node(self, key: str, node: NodeAttrs) -> None:
        raise NotImplementedError("a backend with node_kinds implements _write_node")

    async def set_attrs(self, key: str, attrs: NodeAttrs) -> ObjectInfo:
        """Give the object, directory or node at ``key`` the permission bits,
        owner and mtime of ``attrs`` without writing it again (its type must be
        ``attrs``'); returns its info now (an etag may count the mtime).

        Owners are set only where this process may (as root).  Raises
        ``NotSupported`` unless ``keeps_attrs``, ``BackendNotFound`` if
        ``key`` is missing, ``BackendError`` if it is of another type.
        """
        check_key(key)
        if not self.keeps_attrs:
            raise NotSupported(f"{self.url} keeps no attributes (set_attrs of {key!r})")
        return await self._set_attrs(key, attrs)

    async def _set_attrs(self, key: str, attrs: NodeAttrs) -> ObjectInfo:
        raise NotImplementedError("a backend that keeps_attrs implements _set_attrs")

    async def read_node(self, key: str) -> NodeAttrs | None:
        """The node at ``key`` if it is one (a symlink, a FIFO, a device, by
        the backend's form), else None (a plain object, or nothing)."""
        check_key(key)
        return None

    @abstractmethod
    async def makedirs(self, key: str) -> None:
        """Create directory ``key`` and its parents where directories are real."""

    @abstractmethod
    async def remove_dir(self, key: str) -> None:
        """Remove directory ``key`` if it exists and is empty; otherwise do nothing."""

    async def aclose(self) -> None:  # noqa: B027 (a hook: a backend holding no connection keeps it)
        """Release connections; the backend must not be used afterwards."""

    # -- helpers for implementations --

    async def _stat_object(self, key: str) -> ObjectInfo:
        check_key(key)
        info = await self.stat(key)
        if info is None:
            raise BackendNotFound(f"{key!r}: no such object")
        if info.is_dir:
            raise BackendError(f"{key!r} is a directory, not an object", errno_=errno.EISDIR)
        return info

    async def _copy_by_parts(self, src: ObjectInfo, dst: str, attrs: NodeAttrs | None = None) -> None:
        part_bytes = BACKEND_COPY_PART_BYTES
        upload = await self._open_upload(dst, part_bytes)
        try:
            for index, offset in enumerate(range(0, src.size, part_bytes)):
                # Every part from the version stat saw: a source replaced
                # meanwhile fails the copy instead of mixing two versions.
                size = min(part_bytes, src.size - offset)
                await upload.copy_part(index, src.key, offset, size, if_etag=src.etag)
            await upload.complete(src.size, attrs=attrs)
        except BaseException:
            # The copy's own error is the one to report; a failed cleanup
            # leaves at worst a hidden temp or a pending multipart upload.
            with trio.CancelScope(shield=True), contextlib.suppress(BackendError):
                await upload.abort()
            raise


def timeout_option(options: dict[str, Any]) -> float:
    """The per-call deadline: ``call_timeout_s`` (all backends), else BACKEND_CALL_TIMEOUT_S."""
    return option_float(options, "call_timeout_s", BACKEND_CALL_TIMEOUT_S)
