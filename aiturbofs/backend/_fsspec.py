"""The generic backend: any other fsspec URL (``memory://``, ``gcs://``...).

Owns: keys -> paths under the URL's root, built only on fsspec primitives
(``ls``, ``info``, ``cat_file``, ``put_file``, ``cp_file``, ``mv``,
``rm_file``, ``makedirs``, ``rmdir``), uploads staged in a local temp file
and sent with one ``put_file`` at ``complete``, and the one place the
filesystem's exceptions become backend errors (``_mapped``).  Every fsspec
call runs in a worker thread; nothing here retries.
"""

from __future__ import annotations

import errno
import os
import posixpath
import secrets
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import fsspec
import trio
from fsspec.exceptions import FSTimeoutError

from .._errors import (
    BackendError,
    BackendNotFound,
    BackendUnreachable,
    ConfigError,
    SourceChanged,
    TransientBackendError,
)
from .._limits import BACKEND_THREADS_MAX, LIST_ENTRIES_MAX
from . import _temps
from ._base import (
    UPLOAD_TEMP_PREFIX,
    Backend,
    Buffer,
    NodeAttrs,
    ObjectInfo,
    Upload,
    check_key,
    is_valid_name,
    join_key,
    parent_key,
    punch_hole,
    pwrite_all,
    run_sync,
    take_options,
    timeout_option,
)

_TRANSIENT_ERRNOS = frozenset(
    {errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.EBUSY, errno.ESTALE, errno.ENOSPC, errno.EDQUOT}
)


@contextmanager
def _mapped(what: str) -> Iterator[None]:
    """The one place the filesystem's exceptions become backend errors.

    fsspec implementations speak ``OSError``; anything else they raise is
    left alone so a bug still crashes loudly.
    """
    try:
        yield
    except FileNotFoundError as e:
        raise BackendNotFound(f"{what}: no such object") from e
    except (FSTimeoutError, TimeoutError, ConnectionError) as e:
        raise BackendUnreachable(f"{what}: {type(e).__name__}: {e}") from e
    except OSError as e:
        if e.errno in _TRANSIENT_ERRNOS:  # keeps its errno: ENOSPC means the backend is full
            raise TransientBackendError(f"{what}: {e}", errno_=e.errno) from e
        raise BackendError(f"{what}: {type(e).__name__}: {e}", errno_=e.errno) from e


class FsspecBackend(Backend):
    """Objects are files of an fsspec filesystem under the URL's path.

    Options: ``fsspec_options`` (dict passed to the filesystem),
    ``upload_tmp_dir`` (where parts are staged; default: the system temp
    dir), ``call_timeout_s``.  ``copy_part`` works but moves the bytes
    through this process, hence ``supports_server_copy = False``.
    ``complete`` is as atomic as the filesystem's ``put_file``.  Parts are
    staged in this process's temp dir, so no other process can write them
    (``supports_remote_parts = False``).  Objects carry no attributes
    (``keeps_attrs`` is off: ``complete`` and ``copy`` ignore them).
    """

    supports_server_copy = False
    supports_remote_parts = False
    # fsspec has no portable per-object metadata: only directories are kept
    # (``makedirs``, as real as the filesystem's directories); symlinks and
    # special files stay in the metadata.
    node_kinds = frozenset({stat.S_IFDIR})
    _OPTIONS = {"fsspec_options", "upload_tmp_dir", "call_timeout_s"}

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str, tmp_dir: str | None, timeout_s: float):
        self.url = url
        self._fs = fs
        self._root = root.rstrip("/")
        self._tmp_dir = tmp_dir
        self._swept = False  # the temp dir was cleared of dead uploads' temps (see _temps)
        self._timeout_s = timeout_s
        self._limiter = trio.CapacityLimiter(BACKEND_THREADS_MAX)

    @classmethod
    async def open(cls, url: str, options: dict[str, Any], *, check: bool = True) -> FsspecBackend:
        """Make the filesystem and (with ``check``) its root directory.

        Raises ``ConfigError`` for an unknown protocol, a missing package
        (fsspec's install hint included) or a bad option, and what ``check``
        raises.
        """
        take_options(options, cls._OPTIONS, url.partition("://")[0])
        try:
            fs, root = fsspec.core.url_to_fs(url, **dict(options.get("fsspec_options") or {}))
        except (ImportError, ValueError) as e:
            raise ConfigError(f"backend {url!r}: {e}") from e
        backend = cls(url, fs, root, options.get("upload_tmp_dir"), timeout_option(options))
        if check:
            await backend.check()
        return backend

    async def check(self) -> None:
        """Make the root directory; ``BackendError`` if it cannot be created."""
        await self._run(f"open backend root {self.url}", self._fs.makedirs, self._root, True)

    async def list_dir(self, key: str) -> list[ObjectInfo]:
        check_key(key, allow_root=True)
        return await self._run(f"list {key!r}", self._list_sync, key)

    async def stat(self, key: str) -> ObjectInfo | None:
        check_key(key, allow_root=True)
        return await self._run(f"stat {key!r}", self._stat_sync, key)

    async def read_range(self, key: str, offset: int, length: int, *, if_etag: str | None = None) -> bytes:
        """``cat_file``; with ``if_etag``, then a ``stat``.  Best effort, as
        fsspec has no conditional read: the etag still ``if_etag`` after the
        read means the read was of that version, unless the object was
        replaced and put back meanwhile with an equal etag (size and mtime
        where the filesystem keeps no content hash)."""
        check_key(key)
        if offset < 0 or length < 0:
            raise ValueError(f"read_range({key!r}, {offset}, {length}): negative")
        what = f"read {key!r}"
        data = await self._run(what, self._fs.cat_file, self._path(key), offset, offset + length)
        if if_etag is not None:
            info = await self.stat(key)
            if info is None:
                raise BackendNotFound(f"{what}: no such object (removed during the read)")
            if info.etag != if_etag:
                raise SourceChanged(f"{what}: the object's etag is {info.etag}, not {if_etag}")
        return data

    async def _open_upload(self, key: str, part_bytes: int) -> FsspecUpload:
        sweep, self._swept = not self._swept, True
        tmp_path, fd = await self._run(f"start upload of {key!r}", _create_temp_sync, self._tmp_dir, sweep,
                                       abandon_on_cancel=False)
        return FsspecUpload(self, key, part_bytes, tmp_path, fd)

    async def copy(self, src: str, dst: str, *, attrs: NodeAttrs | None = None) -> None:
        """``cp_file``, which may or may not stay inside the storage system."""
        check_key(dst)
        await self._stat_object(src)  # some filesystems copy a directory silently
        await self._run(f"copy {src!r} to {dst!r}", self._copy_sync, src, dst)

    async def move(self, src: str, dst: str) -> None:
        """``mv``: atomic only where the filesystem renames atomically."""
        check_key(dst)
        await self._stat_object(src)
        if src != dst:
            await self._run(f"move {src!r} to {dst!r}", self._move_sync, src, dst)

    async def delete(self, key: str) -> None:
        check_key(key)
        await self._run(f"delete {key!r}", self._delete_sync, key)

    async def _write_node(self, key: str, node: NodeAttrs) -> None:
        await self._run(f"write node {key!r}", self._fs.makedirs, self._path(key), True)

    async def makedirs(self, key: str) -> None:
        check_key(key, allow_root=True)
        await self._run(f"makedirs {key!r}", self._fs.makedirs, self._path(key), True)

    async def remove_dir(self, key: str) -> None:
        check_key(key, allow_root=True)
        if key:
            await self._run(f"remove dir {key!r}", self._rmdir_sync, key)

    # -- helpers --

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}" if key else self._root

    async def _run(self, what: str, fn, *args, abandon_on_cancel: bool = True):
        with _mapped(what):
            return await run_sync(self._limiter, self._timeout_s, what, fn, *args, abandon_on_cancel=abandon_on_cancel)

    def _object_info(self, key: str, entry: dict[str, Any]) -> ObjectInfo:
        if entry.get("type") == "directory":
            return ObjectInfo(key, 0, 0, None, True)
        size = int(entry.get("size") or 0)
        mtime_ns = _mtime_ns(entry)
        etag = entry.get("ETag") or entry.get("etag") or entry.get("md5Hash")
        if etag is None and mtime_ns:
            etag = f"{mtime_ns}-{size}"
        return ObjectInfo(key, size, mtime_ns, str(etag).strip('"') if etag else None, False)

    # Blocking methods below run in worker threads.

    def _list_sync(self, key: str) -> list[ObjectInfo]:
        path = self._fs._strip_protocol(self._path(key)).rstrip("/")
        try:
            entries = self._fs.ls(self._path(key), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for entry in entries:
            name = self._fs._strip_protocol(entry["name"]).rstrip("/")
            if name == path:
                continue  # ls of a file lists the file itself; some list a dir marker
            base = posixpath.basename(name)
            if is_valid_name(base):
                out.append(self._object_info(join_key(key, base), entry))
            if len(out) > LIST_ENTRIES_MAX:
                raise BackendError(f"list {key!r}: more than {LIST_ENTRIES_MAX} entries")
        return out

    def _stat_sync(self, key: str) -> ObjectInfo | None:
        try:
            return self._object_info(key, self._fs.info(self._path(key)))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _copy_sync(self, src: str, dst: str) -> None:
        self._fs.makedirs(self._path(parent_key(dst)), exist_ok=True)
        self._fs.cp_file(self._path(src), self._path(dst))

    def _move_sync(self, src: str, dst: str) -> None:
        self._fs.makedirs(self._path(parent_key(dst)), exist_ok=True)
        self._fs.mv(self._path(src), self._path(dst))

    def _delete_sync(self, key: str) -> None:
        try:
            self._fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def _rmdir_sync(self, key: str) -> None:
        try:
            self._fs.rmdir(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise


class FsspecUpload(Upload):
    """Parts are pwrite()n into a local temp file, sent with ``put_file`` at complete."""

    def __init__(self, backend: FsspecBackend, key: str, part_bytes: int, tmp_path: str, fd: int):
        super().__init__(key, part_bytes)
        self._backend = backend
        self._tmp_path = tmp_path
        self._fd: int | None = fd
        self._published = False  # put_file done: a retried complete only re-checks

    async def _write_part(self, index: int, data: Buffer) -> None:
        # Not cancellable: a write given up on must not land after a re-send.
        await self._backend._run(
            f"write part {index} of {self.key!r}", pwrite_all, self._fd, data, index * self.part_bytes, abandon_on_cancel=False
        )

    async def _zero_part(self, index: int, length: int) -> tuple[int, int]:
        # A hole of the local staging file (no temp disk used); put_file
        # still sends the zeros, as the store at the other end may have no holes.
        await self._backend._run(f"zero part {index} of {self.key!r}", punch_hole, self._fd,
                                 index * self.part_bytes, length, abandon_on_cancel=False)
        return length, 0

    async def _copy_part(self, index: int, src_key: str, offset: int, length: int, if_etag: str | None) -> None:
        what = f"copy {src_key!r}[{offset}:{offset + length}] to part {index} of {self.key!r}"
        data = await self._backend.read_range(src_key, offset, length, if_etag=if_etag)
        if len(data) < length:
            raise BackendError(f"{what}: the source ends at byte {offset + len(data)}")
        await self._write_part(index, data)

    async def _complete(self, size: int, part_count: int, attrs: NodeAttrs | None) -> ObjectInfo:
        await self._backend._run(f"publish {self.key!r}", self._publish_sync, size, abandon_on_cancel=False)
        info = await self._backend.stat(self.key)
        if info is None or info.size != size:
            raise BackendError(f"publish {self.key!r}: expected {size} bytes, the filesystem has {info}")
        return info

    async def _abort(self) -> None:
        await self._backend._run(f"abort upload of {self.key!r}", self._abort_sync, abandon_on_cancel=False)

    def _publish_sync(self, size: int) -> None:
        if self._published:
            return
        assert self._fd is not None  # closed only once published, or by abort (which ends the upload)
        os.ftruncate(self._fd, size)  # also drops the tail of a longer earlier last part
        fs, path = self._backend._fs, self._backend._path(self.key)
        fs.makedirs(self._backend._path(parent_key(self.key)), exist_ok=True)
        fs.put_file(self._tmp_path, path)
        self._published = True
        self._abort_sync()  # the local staging copy is no longer needed

    def _abort_sync(self) -> None:
        fd, self._fd = self._fd, None  # forget first: a second close could hit a reused number
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(self._tmp_path)
        except FileNotFoundError:
            pass


def _mtime_ns(entry: dict[str, Any]) -> int:
    """Best effort: fsspec implementations name and type the time differently."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = entry.get(name)
        if isinstance(value, datetime):
            return int(value.timestamp() * 1e9)
        if isinstance(value, (int, float)) and value > 0:
            return int(value * 1e9)
    return 0


def _create_temp_sync(tmp_dir: str | None, sweep: bool) -> tuple[str, int]:
    """A new local upload temp, locked (``_temps``); ``sweep``: first remove dead uploads' temps there."""
    directory = tmp_dir or tempfile.gettempdir()
    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if sweep:
            _temps.sweep(dir_fd, directory)
        name, fd = _temps.create_locked(dir_fd, lambda: UPLOAD_TEMP_PREFIX + secrets.token_hex(8), 0o600)
    finally:
        os.close(dir_fd)
    return os.path.join(directory, name), fd
