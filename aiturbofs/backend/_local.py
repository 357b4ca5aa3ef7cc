"""The local-directory backend (``file:///abs/path`` or a plain absolute path).

Owns: mapping keys to paths under the root, crash-safe publishing (parts go
into a hidden temp file beside the target, readable by its owner only, which
gets the file's mode, owner and mtime, is fsynced and renamed over it),
parts written into that temp file by other processes (``flock`` keeps them
from landing after the rename), removing the temps of uploads whose process
died (``_temps``: on the first upload into a directory, when a directory is
listed, and when one cannot be removed), files', directories' and nodes' attributes
(``_apply_attrs``), and turning ``OSError`` into the backend error
vocabulary in one place (``_mapped``).  Every os call runs in a worker
thread; nothing here retries.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat as stat_mod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio

from .._errors import BackendError, BackendNotFound, InvalidArgument, SourceChanged, TransientBackendError
from .._limits import (
    BACKEND_THREADS_MAX,
    CHUNK_BYTES,
    LIST_ENTRIES_MAX,
    LOCAL_SMALL_PART_BYTES,
    NAME_BYTES_MAX,
    PATH_BYTES_MAX,
    UPLOAD_DIRS_SWEPT_MAX,
)
from .._syscalls import fsync_dir
from . import _temps
from ._base import (
    UPLOAD_TEMP_PREFIX,
    Backend,
    Buffer,
    NodeAttrs,
    ObjectInfo,
    Upload,
    check_key,
    join_key,
    make_token,
    parse_token,
    punch_hole,
    pwrite_all,
    pwrite_sparse,
    run_sync,
    take_options,
    timeout_option,
)

T = TypeVar("T")

# A full disk, a quota or a flaky network mount heals without a config
# change, so the persister should keep retrying; permission errors do not.
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EAGAIN,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.ESTALE,
        errno.EBUSY,
        errno.ENOLCK,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
    }
)
# copy_file_range cannot work here (other filesystem, old kernel, special
# file): fall back to reading and writing.
_NO_COPY_FILE_RANGE_ERRNOS = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})
# The random part of an upload temp name; a token carries only this, so it
# can name no file but an upload temp beside its own key.
_TEMP_NONCE_BYTES = 8
_TEMP_NONCE = re.compile(f"[0-9a-f]{{{2 * _TEMP_NONCE_BYTES}}}")
# An upload's temp file is its owner's alone while it is written: the file
# may be 0600, and the temp is beside the target, in the same directory.
_TEMP_MODE = 0o600
# What an object published without attributes gets (``Upload.complete``).
_DEFAULT_FILE_MODE = 0o644


@contextmanager
def _mapped(what: str) -> Iterator[None]:
    """The one place an ``OSError`` becomes a backend error."""
    try:
        yield
    except FileNotFoundError as e:
        raise BackendNotFound(f"{what}: {e.strerror}") from e
    except OSError as e:
        if e.errno in _TRANSIENT_ERRNOS:  # keeps its errno: ENOSPC means the backend is full
            raise TransientBackendError(f"{what}: {e.strerror}", errno_=e.errno) from e
        raise BackendError(f"{what}: {e.strerror or e}", errno_=e.errno) from e


class LocalBackend(Backend):
    """Objects are regular files under ``root``; directories are real directories.

    Options: ``call_timeout_s``.  Nodes are what they are: a symlink is a
    real symlink (listed with its own mode, never followed to list or read),
    a FIFO or socket (an inode, not a listener) itself, a device a device
    node (only when running as root: mknod needs CAP_MKNOD).  Files,
    directories and nodes carry their mode, owner (when running as root:
    chown needs CAP_CHOWN) and mtime.  Keys themselves cannot escape the root.
    """

    supports_server_copy = True  # copy_file_range: no bytes through this process
    supports_remote_parts = True  # into the temp file, by any process that sees the root at the same path
    keeps_attrs = True
    _OPTIONS = {"call_timeout_s"}

    def __init__(self, root: str, timeout_s: float):
        self.url = "file://" + root
        self._root = root
        # A key's upload temp file, its sibling, must fit the kernel's PATH_MAX
        # (NUL included) below the root: the temp name adds its head.
        temp_head_bytes = len(UPLOAD_TEMP_PREFIX) + 2 * _TEMP_NONCE_BYTES + 1
        self.key_bytes_max = PATH_BYTES_MAX - 1 - len(os.fsencode(root)) - 1 - temp_head_bytes
        self._timeout_s = timeout_s
        self._limiter = trio.CapacityLimiter(BACKEND_THREADS_MAX)
        # Directories where this process looked for temps of dead uploads (see _temps).
        self._swept: set[str] = set()
        kinds = {stat_mod.S_IFDIR, stat_mod.S_IFLNK, stat_mod.S_IFIFO, stat_mod.S_IFSOCK}
        if os.geteuid() == 0:
            kinds |= {stat_mod.S_IFCHR, stat_mod.S_IFBLK}
        self.node_kinds = frozenset(kinds)

    @classmethod
    async def open(cls, url: str, options: dict[str, Any], *, check: bool = True) -> LocalBackend:
        """Use (or, with ``check``, create) the root directory.

        Raises ``ConfigError`` for a bad option, and what ``check`` raises.
        """
        take_options(options, cls._OPTIONS, "file")
        backend = cls(_root_from_url(url), timeout_option(options))
        if check:
            await backend.check()
        return backend

    async def check(self) -> None:
        """Use (or create, mode 0o755, if its parent exists) the root directory;
        ``BackendError`` if it cannot be used."""
        await self._run(f"open backend root {self._root}", _ensure_root, self._root)

    async def list_dir(self, key: str) -> list[ObjectInfo]:
        check_key(key, allow_root=True)
        return await self._run(f"list {key!r}", _list_sync, self._path(key), key, self._root)

    async def stat(self, key: str) -> ObjectInfo | None:
        check_key(key, allow_root=True)
        return await self._run(f"stat {key!r}", _stat_sync, self._path(key), key)

    async def read_range(self, key: str, offset: int, length: int, *, if_etag: str | None = None) -> bytes:
        check_key(key)
        if offset < 0 or length < 0:
            raise ValueError(f"read_range({key!r}, {offset}, {length}): negative")
        what = f"read {key!r}"
        data, etag = await self._run(what, _pread_sync, self._path(key), offset, length, if_etag)
        if if_etag is not None and etag != if_etag:
            raise SourceChanged(f"{what}: the object's etag is {etag}, not {if_etag}")
        return data

    async def _open_upload(self, key: str, part_bytes: int) -> LocalUpload:
        path = self._path(key)
        parent = os.path.dirname(path)
        sweep = parent not in self._swept  # a re-upload after a crash: its dead temp is beside it
        if sweep:
            if len(self._swept) >= UPLOAD_DIRS_SWEPT_MAX:
                self._swept.clear()  # forgetting costs one more look at a directory
            self._swept.add(parent)
        # Not cancellable: an abandoned create would leak the fd and the temp file.
        nonce, tmp_path, fd = await self._run(f"start upload of {key!r}", _create_temp_sync, path, self._root, sweep,
                                              abandon_on_cancel=False)
        return LocalUpload(self, key, part_bytes, path, tmp_path, fd, nonce)

    async def _write_remote_part(self, key: str, token: str, index: int, data: Buffer, part_bytes: int) -> str:
        (nonce,) = parse_token(token, "file", key, part_bytes, "temp")
        if not _TEMP_NONCE.fullmatch(nonce):
            raise InvalidArgument(f"bad upload token for {key!r}: temp {nonce!r}")
        path = self._path(key)
        tmp_path = os.path.join(os.path.dirname(path), _temp_name(os.path.basename(path), nonce))
        what = f"write remote part {index} of {key!r}"
        await self._run(what, _write_remote_sync, tmp_path, data, index * part_bytes, abandon_on_cancel=False)
        return str(len(data))  # the receipt: add_remote_part checks it against the length

    async def move(self, src: str, dst: str) -> None:
        """Rename, atomically; a directory moves too, but only here (not portable)."""
        check_key(src)
        check_key(dst)
        await self._run(f"move {src!r} to {dst!r}", _move_sync, self._path(src), self._path(dst), self._root)

    async def delete(self, key: str) -> None:
        """Unlink; raises ``BackendError`` if ``key`` is a directory."""
        check_key(key)
        await self._run(f"delete {key!r}", _unlink_sync, self._path(key))

    async def _write_node(self, key: str, node: NodeAttrs) -> None:
        await self._run(f"write node {key!r}", _write_node_sync, self._path(key), node, self._root,
                        abandon_on_cancel=False)

    async def read_node(self, key: str) -> NodeAttrs | None:
        check_key(key)
        return await self._run(f"read node {key!r}", _read_node_sync, self._path(key))

    async def _set_attrs(self, key: str, attrs: NodeAttrs) -> ObjectInfo:
        return await self._run(f"set attributes of {key!r}", _set_attrs_sync, self._path(key), key, attrs,
                               self._root, abandon_on_cancel=False)

    async def makedirs(self, key: str) -> None:
        """mkdir -p; raises ``BackendError`` if a file is in the way."""
        check_key(key, allow_root=True)
        await self._run(f"makedirs {key!r}", os.makedirs, self._path(key), 0o777, True)

    async def remove_dir(self, key: str) -> None:
        """rmdir; the root is never removed.  Raises ``BackendError`` if ``key`` is a file."""
        check_key(key, allow_root=True)
        if key:
            await self._run(f"remove dir {key!r}", _rmdir_sync, self._path(key))

    # -- helpers --

    def _path(self, key: str) -> str:
        return os.path.join(self._root, key) if key else self._root

    async def _run(self, what: str, fn, *args, abandon_on_cancel: bool = True):
        with _mapped(what):
            return await run_sync(self._limiter, self._timeout_s, what, fn, *args, abandon_on_cancel=abandon_on_cancel)


class LocalUpload(Upload):
    """Parts are pwrite()n into ``.aiturbo-upload.<nonce>.<name>`` beside the target.

    Writes are not cancellable (see ``run_sync``): a write the caller gave up
    on must not land after the part was re-sent.  The upload holds a shared
    ``flock`` on its temp file for its whole life (``_temps``: no reaper takes
    it).  Once a token was handed out, publishing turns it exclusive, and
    remote writers take a shared one (``_write_remote_sync``), so a remote
    write either ends before the rename or finds the temp gone.
    """

    def __init__(
        self, backend: LocalBackend, key: str, part_bytes: int, path: str, tmp_path: str, fd: int, nonce: str
    ):
        super().__init__(key, part_bytes)
        self._backend = backend
        self._path = path
        self._tmp_path = tmp_path
        self._fd: int | None = fd
        self._nonce = nonce
        self._shared = False  # a token was handed out: other processes may write parts
        self._published = False  # the temp file has been renamed onto the target
        # A small first part is kept (a copy) and written by the next thread
        # hop (publish, usually): a small file then costs one hop, not two.
        self._small: bytes | None = None

    async def _write_part(self, index: int, data: Buffer) -> None:
        if index == 0 and len(data) <= LOCAL_SMALL_PART_BYTES and not self._shared:
            self._small = bytes(data)  # a copy: the caller's buffer is only lent for this call
            return
        await self._backend._run(
            f"write part {index} of {self.key!r}", self._in_temp, pwrite_sparse, data, index * self.part_bytes,
            abandon_on_cancel=False,
        )

    def _write_kept(self) -> None:
        """Write a kept small part into the temp file (blocking)."""
        small, self._small = self._small, None
        assert self._fd is not None  # closed only once published, or by abort (which ends the upload)
        if small is not None:
            pwrite_sparse(self._fd, small, 0)

    def _in_temp(self, fn, *args):
        """``fn(fd, *args)`` once a kept small part is in the temp file (blocking)."""
        self._write_kept()
        return fn(self._fd, *args)

    async def _zero_part(self, index: int, length: int) -> tuple[int, int]:
        # The temp file is new: an unwritten range is a hole already, and
        # publish's ftruncate makes the tail one.  Punched in case the part
        # was written before (the latest entry of a part wins).
        if index == 0:
            self._small = None  # this part's newest entry
        await self._backend._run(f"zero part {index} of {self.key!r}", self._in_temp, punch_hole,
                                 index * self.part_bytes, length, abandon_on_cancel=False)
        return 0, 0

    async def _copy_part(self, index: int, src_key: str, offset: int, length: int, if_etag: str | None) -> None:
        what = f"copy {src_key!r}[{offset}:{offset + length}] to part {index} of {self.key!r}"
        src_path = self._backend._path(src_key)
        dst_offset = index * self.part_bytes
        if index == 0:
            self._small = None  # this part's newest entry
        etag, copied = await self._backend._run(
            what, self._in_temp, lambda fd: _copy_range_sync(src_path, fd, offset, dst_offset, length, if_etag),
            abandon_on_cancel=False,
        )
        if if_etag is not None and etag != if_etag:
            raise SourceChanged(f"{what}: the source's etag is {etag}, not {if_etag}")
        if copied < length:
            raise BackendError(f"{what}: the source ends at byte {offset + copied}")

    async def _token(self) -> str:
        self._shared = True
        if self._small is not None:  # remote writers write beside it: into the temp with it
            await self._backend._run(f"write part 0 of {self.key!r}", self._write_kept, abandon_on_cancel=False)
        return make_token("file", self.key, self.part_bytes, temp=self._nonce)

    def _add_remote_part(self, index: int, length: int, receipt: str) -> None:
        # A shorter remote write would leave a hole of zeros that complete cannot see.
        if receipt != str(length):
            raise InvalidArgument(f"part {index} of {self.key!r}: receipt {receipt!r:.100} is not for {length} bytes")

    async def _complete(self, size: int, part_count: int, attrs: NodeAttrs | None) -> ObjectInfo:
        st = await self._backend._run(f"publish {self.key!r}", self._publish_sync, size, attrs,
                                      abandon_on_cancel=False)
        info = _info(self.key, st)
        assert info is not None  # what we published is a regular file
        return info

    async def _abort(self) -> None:
        await self._backend._run(f"abort upload of {self.key!r}", self._abort_sync, abandon_on_cancel=False)

    def _publish_sync(self, size: int, attrs: NodeAttrs | None) -> os.stat_result:
        # Steps already done by an earlier attempt that failed later are skipped,
        # so complete() can be retried.
        if not self._published:
            fd = self._fd
            assert fd is not None  # closed only once published, or by abort (which ends the upload)
            if self._shared:
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits for remote writes in flight
            try:
                # flock drops the shared lock before it waits for the exclusive one: a reaper may have come between.
                if self._shared and not _temps.still_linked(self._tmp_path, fd):
                    raise OSError(errno.ESTALE, "the upload's temp file was removed while it waited to publish")
                self._write_kept()
                os.ftruncate(fd, size)  # also drops the tail of a longer earlier last part
                # After the last write (which moves the mtime), before anyone can see it.
                if attrs is None:
                    os.fchmod(fd, _DEFAULT_FILE_MODE)
                else:
                    _apply_attrs(fd, os.fstat(fd), attrs)
                os.fsync(fd)
                os.replace(self._tmp_path, self._path)
            except BaseException:
                if self._shared:
                    fcntl.flock(fd, fcntl.LOCK_SH)  # back to the upload's own lock: remote re-sends may come
                raise
            self._published = True
        fsync_dir(os.path.dirname(self._path))
        self._close_sync()
        return os.stat(self._path)

    def _abort_sync(self) -> None:
        self._close_sync()
        if not self._published:
            try:
                os.unlink(self._tmp_path)
            except FileNotFoundError:
                pass

    def _close_sync(self) -> None:
        # Forget the fd before closing it: a second close could hit a reused number.
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# --- blocking helpers (run in worker threads) -----------------------------------------


def _root_from_url(url: str) -> str:
    path = url[len("file://") :] if url.startswith("file://") else url
    if not path.startswith("/"):
        raise BackendError(f"local backend {url!r}: want file:///absolute/path or /absolute/path")
    return os.path.normpath(path)


def _ensure_root(root: str) -> None:
    try:
        os.mkdir(root, 0o755)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise BackendError(f"backend root {root} does not exist and neither does its parent") from None
    if not os.path.isdir(root):
        raise BackendError(f"backend root {root} is not a directory", errno_=errno.ENOTDIR)


def _info(key: str, st: os.stat_result) -> ObjectInfo | None:
    """ObjectInfo of a regular file or directory, or (from an lstat) of a
    symlink, FIFO, device or socket, with its mode and owner."""
    if stat_mod.S_ISDIR(st.st_mode):
        etag, is_dir = None, True
    elif stat_mod.S_ISREG(st.st_mode):
        etag, is_dir = _etag(st), False
    elif stat_mod.S_IFMT(st.st_mode) in _NODE_TYPES:
        etag, is_dir = None, False
    else:
        return None
    return ObjectInfo(key, 0 if is_dir else st.st_size, st.st_mtime_ns, etag, is_dir,
                      mode=st.st_mode, uid=st.st_uid, gid=st.st_gid)


_NODE_TYPES = frozenset({stat_mod.S_IFLNK, stat_mod.S_IFIFO, stat_mod.S_IFCHR, stat_mod.S_IFBLK, stat_mod.S_IFSOCK})


def _etag(st: os.stat_result) -> str | None:
    """An object's etag; None for non-objects.

    A publish renames a new file into place: a new inode, so the inode number
    tells versions apart where mtime and size alone do not (a same-size
    rewrite within one tick of a coarse clock).
    """
    return f"{st.st_mtime_ns}-{st.st_size}-{st.st_ino}" if stat_mod.S_ISREG(st.st_mode) else None


def _outside(path: str, root: str) -> bool:
    """True if ``path`` resolves (through symlinks in the backend) outside ``root``."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real != top and not real.startswith(top.rstrip(os.sep) + os.sep)


def _check_inside(directory: str, root: str) -> None:
    """Refuse to write below a directory that a symlink leads out of the root.

    ENOTDIR (not a directory of the backend): the persister takes it as a
    name in the way and waits, since the namespace reaches there only once
    the symlink was replaced, and its removal may still be queued (a
    directory made where a symlink was unlinked: its files were marked
    broken when they raced the removal).
    """
    if _outside(directory, root):
        raise BackendError(f"{directory} resolves to {os.path.realpath(directory)}, outside the backend root {root} "
                           "(a symlink in the backend): refusing to write there", errno_=errno.ENOTDIR)


def _list_sync(path: str, key: str, root: str) -> list[ObjectInfo]:
    try:
        entries = os.scandir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    with entries:
        for entry in entries:
            if entry.name.startswith(UPLOAD_TEMP_PREFIX):
                _temps.reap(entry.path)  # an upload's, unless its process died
                continue
            try:
                info = _info(join_key(key, entry.name), entry.stat(follow_symlinks=False))
            except FileNotFoundError:
                continue  # deleted meanwhile, or a dangling symlink
            if info is not None:
                out.append(info)
            if len(out) > LIST_ENTRIES_MAX:
                raise BackendError(f"list {key!r}: more than {LIST_ENTRIES_MAX} entries")
    return out


def _write_node_sync(path: str, node: NodeAttrs, root: str) -> None:
    """Make ``path`` the node: a directory in place, anything else made beside
    it under a hidden name and renamed over it (atomic, like a publish)."""
    parent = os.path.dirname(path)
    kind = stat_mod.S_IFMT(node.mode)

    def make() -> str | None:
        if kind == stat_mod.S_IFDIR:
            _check_inside(path, root)
            os.makedirs(path, exist_ok=True)
            _apply_attrs(path, os.lstat(path), node)
            return None
        tmp = os.path.join(parent, _temp_name(os.path.basename(path), secrets.token_hex(_TEMP_NONCE_BYTES)))
        if kind == stat_mod.S_IFLNK:
            os.symlink(node.target or b"", os.fsencode(tmp))
        else:
            os.mknod(tmp, node.mode, node.rdev)  # FIFO, socket or device; chmod below undoes the umask
        return tmp

    tmp = _in_parent(parent, root, make)
    if tmp is None:
        return
    try:
        _apply_attrs(tmp, os.lstat(tmp), node)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


def _read_node_sync(path: str) -> NodeAttrs | None:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat_mod.S_IFMT(st.st_mode) not in _NODE_TYPES:
        return None
    target = os.readlink(os.fsencode(path)) if stat_mod.S_ISLNK(st.st_mode) else None
    return NodeAttrs(st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_rdev, target)


def _apply_attrs(target: int | str, st: os.stat_result, attrs: NodeAttrs) -> None:
    """Give ``target`` (an fd, or a path: a symlink is not followed) the
    owner, permission bits and mtime of ``attrs`` where ``st`` (its stat)
    differs (blocking).

    The owner first (chown clears setuid and setgid), and only as root:
    elsewhere a file stays this process's, and whatever the kernel refuses
    to a process that is not root (a setgid bit of a group it is not in, a
    directory of another user) is left as it is.
    """
    follow = isinstance(target, int)  # an fd: the flag must stay at its default
    root = os.geteuid() == 0
    try:
        chowned = False
        if (root and attrs.uid is not None and attrs.gid is not None
                and (st.st_uid, st.st_gid) != (attrs.uid, attrs.gid)):
            os.chown(target, attrs.uid, attrs.gid, follow_symlinks=follow)
            chowned = True
        mode = stat_mod.S_IMODE(attrs.mode)
        if not stat_mod.S_ISLNK(st.st_mode) and (chowned or stat_mod.S_IMODE(st.st_mode) != mode):
            os.chmod(target, mode)  # not a symlink: a path is the node itself (symlinks have no mode)
        if attrs.mtime_ns is not None and st.st_mtime_ns != attrs.mtime_ns:
            os.utime(target, ns=(st.st_atime_ns, attrs.mtime_ns), follow_symlinks=follow)
    except PermissionError:
        if root:
            raise


def _set_attrs_sync(path: str, key: str, attrs: NodeAttrs, root: str) -> ObjectInfo:
    """``Backend.set_attrs``: a regular file or directory through an fd opened
    without following a symlink (no path lookup between the check and the
    change), other nodes by their path."""
    _check_inside(os.path.dirname(path), root)
    st = os.lstat(path)
    if stat_mod.S_IFMT(st.st_mode) != stat_mod.S_IFMT(attrs.mode):
        raise BackendError(f"set attributes of {key!r}: it is of type {stat_mod.S_IFMT(st.st_mode):o}, "
                           f"not {stat_mod.S_IFMT(attrs.mode):o}")
    if stat_mod.S_ISREG(st.st_mode) or stat_mod.S_ISDIR(st.st_mode):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError:  # not root, and not readable: by its path
            _apply_attrs(path, st, attrs)
        else:
            try:
                st = os.fstat(fd)
                if stat_mod.S_IFMT(st.st_mode) != stat_mod.S_IFMT(attrs.mode):
                    raise BackendError(f"set attributes of {key!r}: replaced meanwhile by another type")
                _apply_attrs(fd, st, attrs)
            finally:
                os.close(fd)
    else:
        _apply_attrs(path, st, attrs)
    info = _info(key, os.lstat(path))
    assert info is not None  # a regular file, directory or node, as checked
    return info


def _stat_sync(path: str, key: str) -> ObjectInfo | None:
    try:
        return _info(key, os.stat(path))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _pread_sync(path: str, offset: int, length: int, if_etag: str | None) -> tuple[bytes, str | None]:
    """Up to ``length`` bytes at ``offset``, unless the file's etag is not ``if_etag`` (if given).

    Returns the bytes and the etag (None without ``if_etag``): ``if_etag``
    if the read is of that version, else the other one seen (and maybe no
    bytes).  The etag is read from the open file, before and after the
    read: a replace (rename) cannot change what an open fd reads, and a
    tool writing the file in place moves its mtime before its bytes land
    (unless within the clock tick of the file's last change).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if if_etag is not None and (etag := _etag(os.fstat(fd))) != if_etag:
            return b"", etag
        data = _pread_all(fd, offset, length)
        return data, None if if_etag is None else _etag(os.fstat(fd))
    finally:
        os.close(fd)


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    pieces = []
    while length > 0:
        piece = os.pread(fd, length, offset)
        if not piece:
            break  # EOF
        pieces.append(piece)
        offset += len(piece)
        length -= len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _temp_name(basename: str, nonce: str) -> str:
    """A hidden sibling name, unique by ``nonce``, that still fits NAME_BYTES_MAX."""
    head = f"{UPLOAD_TEMP_PREFIX}{nonce}."
    tail = os.fsencode(basename)[: NAME_BYTES_MAX - len(head)]
    return head + os.fsdecode(tail)


# Directories emptied by a move or delete, or found empty where a node must
# go, are removed (``remove_dir``) while other calls run in other threads: a
# parent just made (or one of its ancestors, between makedirs' mkdirs) may
# vanish before it is used, so the steps that need it are tried again this
# many times.
_DIR_RACE_TRIES = 3


def _in_parent(parent: str, root: str, op: Callable[[], T], again: Callable[[], bool] = lambda: True) -> T:
    """``op()``, which makes or moves a name in ``parent``, once ``parent``
    exists (made inside the root, never through a symlink out of it).

    Tried again (``_DIR_RACE_TRIES``, and while ``again()``) when it meets
    ENOENT: a concurrent ``remove_dir`` took the parent, or an ancestor that
    makedirs had just made before its last mkdir.
    """
    for attempt in range(_DIR_RACE_TRIES):
        _check_inside(parent, root)  # before makedirs, which would create directories out there
        try:
            os.makedirs(parent, exist_ok=True)
            return op()
        except FileNotFoundError:
            if attempt == _DIR_RACE_TRIES - 1 or not again():
                raise
    raise AssertionError("unreachable")


def _create_temp_sync(path: str, root: str, sweep: bool) -> tuple[str, str, int]:
    """A new upload temp beside ``path``, locked (``_temps``): its nonce, path and fd.

    ``sweep``: first remove the temps dead uploads left in that directory.
    """
    parent, basename = os.path.split(path)
    nonces: list[str] = []

    def name() -> str:
        nonces.append(secrets.token_hex(_TEMP_NONCE_BYTES))
        return _temp_name(basename, nonces[-1])

    def make() -> tuple[str, int]:
        if sweep:
            _temps.sweep(parent)
        return _temps.create_locked(parent, name, _TEMP_MODE)

    tmp_path, fd = _in_parent(parent, root, make)
    return nonces[-1], tmp_path, fd


def _copy_range_sync(
    src_path: str, dst_fd: int, src_offset: int, dst_offset: int, length: int, if_etag: str | None
) -> tuple[str | None, int]:
    """Copy up to ``length`` bytes unless the source's etag is not ``if_etag`` (if given).

    Returns the source's etag and how many bytes were copied (fewer only if
    the source ends; none if the etag differs).  The etag is read from the
    open source, so a replace (rename) after the check cannot change what is
    copied.
    """
    src_fd = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(src_fd)
        etag = _etag(st)
        if if_etag is not None and etag != if_etag:
            return etag, 0
        # A published object never changes (a new version is a new inode), so
        # its size bounds the range, and its holes are copied as holes.
        end = min(src_offset + length, st.st_size)
        done = 0
        for start, stop, is_data in _extents(src_fd, src_offset, end):
            at = dst_offset + start - src_offset
            if not is_data:
                punch_hole(dst_fd, at, stop - start)
                done += stop - start
                continue
            copied = _copy_file_range(src_fd, dst_fd, start, at, stop - start)
            if copied < stop - start:
                copied += _copy_by_reading(src_fd, dst_fd, start + copied, at + copied, stop - start - copied)
            done += copied
            if copied < stop - start:
                break
        return etag, done
    finally:
        os.close(src_fd)


def _extents(fd: int, start: int, end: int) -> Iterator[tuple[int, int, bool]]:
    """``(start, stop, is_data)`` runs covering ``[start, end)`` of ``fd``, by SEEK_DATA/SEEK_HOLE.

    One data run where the filesystem cannot tell holes (copied as bytes).
    """
    pos = start
    while pos < end:
        try:
            data = min(os.lseek(fd, pos, os.SEEK_DATA), end)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from here to the end of the file
                data = end
            elif e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield pos, end, True
                return
            else:
                raise
        if data > pos:
            yield pos, data, False
        if data >= end:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        yield data, hole, True
        pos = hole


def _write_remote_sync(tmp_path: str, data: Buffer, offset: int) -> None:
    """pwrite a part into another process's upload temp, fsynced (its owner may be on another host)."""
    gone = FileNotFoundError(errno.ENOENT, "no such upload (completed or aborted)")
    try:
        # O_RDWR: on NFS flock is a POSIX lock, and a shared one needs read access.
        fd = os.open(tmp_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise gone from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        # The owner renames under LOCK_EX: a temp still at its name now stays there until we are done.
        if not _temps.still_linked(tmp_path, fd):
            raise gone
        pwrite_sparse(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)  # also drops the lock


def _copy_file_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, length: int) -> int:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, dst_fd, length - done, src_offset + done, dst_offset + done)
        except OSError as e:
            if e.errno in _NO_COPY_FILE_RANGE_ERRNOS:
                return done
            raise
        if n == 0:
            return done  # EOF of the source
        done += n
    return done


def _copy_by_reading(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, length: int) -> int:
    done = 0
    while done < length:
        piece = os.pread(src_fd, min(CHUNK_BYTES, length - done), src_offset + done)
        if not piece:
            break
        pwrite_all(dst_fd, piece, dst_offset + done)
        done += len(piece)
    return done


def _move_sync(src: str, dst: str, root: str) -> None:
    os.lstat(src)  # a missing source must not be reported as a missing target parent (a symlink moves as itself)
    _in_parent(os.path.dirname(dst), root, lambda: os.replace(src, dst), again=lambda: os.path.lexists(src))
    fsync_dir(os.path.dirname(dst))
    if os.path.dirname(src) != os.path.dirname(dst):
        try:
            fsync_dir(os.path.dirname(src))
        except FileNotFoundError:
            pass  # emptied by this move and removed meanwhile: the move itself is done


def _unlink_sync(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _rmdir_sync(path: str) -> None:
    for attempt in range(2):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Not empty: perhaps only because of temps dead uploads left there.
            if attempt or not _temps.sweep(path):
                return
        else:
            return
