"""The local-directory backend (``file:///abs/path`` or a plain absolute path).

Owns: mapping keys to names under the root (each directory opened by its
name in the one above, never through a symlink: a key may be as long as a
path below a local mount, not PATH_MAX less the root's path), crash-safe
publishing (parts go into a hidden temp file beside the target, readable by
its owner only, which gets the file's mode, owner and mtime, is fsynced and
renamed over it), parts written into that temp file by other processes
(``flock`` keeps them from landing after the rename), removing the temps of
uploads whose process died (``_temps``: on the first upload into a
directory, when a directory is listed, and when one cannot be removed),
files', directories' and nodes' attributes (``_apply_attrs``), and turning
``OSError`` into the backend error vocabulary in one place (``_mapped``).
Every os call runs in a worker thread; nothing here retries.
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
    parent_key,
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
        # Every call names one component relative to its directory's fd
        # (``_open_dir``): a key is limited like a path on a local filesystem,
        # by NAME_MAX per name, not by PATH_MAX below the root.
        self.key_bytes_max = PATH_BYTES_MAX
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
        return await self._run(f"list {key!r}", _list_sync, self._root, key)

    async def stat(self, key: str) -> ObjectInfo | None:
        check_key(key, allow_root=True)
        return await self._run(f"stat {key!r}", _stat_sync, self._root, key)

    async def read_range(self, key: str, offset: int, length: int, *, if_etag: str | None = None) -> bytes:
        check_key(key)
        if offset < 0 or length < 0:
            raise ValueError(f"read_range({key!r}, {offset}, {length}): negative")
        what = f"read {key!r}"
        data, etag = await self._run(what, _pread_sync, self._root, key, offset, length, if_etag)
        if if_etag is not None and etag != if_etag:
            raise SourceChanged(f"{what}: the object's etag is {etag}, not {if_etag}")
        return data

    async def _open_upload(self, key: str, part_bytes: int) -> LocalUpload:
        parent = parent_key(key)
        sweep = parent not in self._swept  # a re-upload after a crash: its dead temp is beside it
        if sweep:
            if len(self._swept) >= UPLOAD_DIRS_SWEPT_MAX:
                self._swept.clear()  # forgetting costs one more look at a directory
            self._swept.add(parent)
        # Not cancellable: an abandoned create would leak the fd and the temp file.
        nonce, tmp_name, fd = await self._run(f"start upload of {key!r}", _create_temp_sync, self._root, key, sweep,
                                              abandon_on_cancel=False)
        return LocalUpload(self, key, part_bytes, tmp_name, fd, nonce)

    async def _write_remote_part(self, key: str, token: str, index: int, data: Buffer, part_bytes: int) -> str:
        (nonce,) = parse_token(token, "file", key, part_bytes, "temp")
        if not _TEMP_NONCE.fullmatch(nonce):
            raise InvalidArgument(f"bad upload token for {key!r}: temp {nonce!r}")
        what = f"write remote part {index} of {key!r}"
        await self._run(what, _write_remote_sync, self._root, key, nonce, data, index * part_bytes,
                        abandon_on_cancel=False)
        return str(len(data))  # the receipt: add_remote_part checks it against the length

    async def move(self, src: str, dst: str) -> None:
        """Rename, atomically; a directory moves too, but only here (not portable)."""
        check_key(src)
        check_key(dst)
        await self._run(f"move {src!r} to {dst!r}", _move_sync, self._root, src, dst)

    async def delete(self, key: str) -> None:
        """Unlink; raises ``BackendError`` if ``key`` is a directory."""
        check_key(key)
        await self._run(f"delete {key!r}", _unlink_sync, self._root, key)

    async def _write_node(self, key: str, node: NodeAttrs) -> None:
        await self._run(f"write node {key!r}", _write_node_sync, self._root, key, node,
                        abandon_on_cancel=False)

    async def read_node(self, key: str) -> NodeAttrs | None:
        check_key(key)
        return await self._run(f"read node {key!r}", _read_node_sync, self._root, key)

    async def _set_attrs(self, key: str, attrs: NodeAttrs) -> ObjectInfo:
        return await self._run(f"set attributes of {key!r}", _set_attrs_sync, self._root, key, attrs,
                               abandon_on_cancel=False)

    async def makedirs(self, key: str) -> None:
        """mkdir -p; raises ``BackendError`` if a file is in the way."""
        check_key(key, allow_root=True)
        await self._run(f"makedirs {key!r}", _makedirs_sync, self._root, key)

    async def remove_dir(self, key: str) -> None:
        """rmdir; the root is never removed.  Raises ``BackendError`` if ``key`` is a file."""
        check_key(key, allow_root=True)
        if key:
            await self._run(f"remove dir {key!r}", _rmdir_sync, self._root, key)

    # -- helpers --

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

    def __init__(self, backend: LocalBackend, key: str, part_bytes: int, tmp_name: str, fd: int, nonce: str):
        super().__init__(key, part_bytes)
        self._backend = backend
        self._tmp_name = tmp_name  # beside the key, in its parent directory
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
        root = self._backend._root
        dst_offset = index * self.part_bytes
        if index == 0:
            self._small = None  # this part's newest entry
        etag, copied = await self._backend._run(
            what, self._in_temp, lambda fd: _copy_range_sync(root, src_key, fd, offset, dst_offset, length, if_etag),
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
        with _parent_of(self._backend._root, self.key) as (dir_fd, name):
            if not self._published:
                self._publish_at(dir_fd, name, size, attrs)
                self._published = True
            _fsync_dir_at(dir_fd)
            self._close_sync()
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)

    def _publish_at(self, dir_fd: int, name: str, size: int, attrs: NodeAttrs | None) -> None:
        fd = self._fd
        assert fd is not None  # closed only once published, or by abort (which ends the upload)
        if self._shared:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits for remote writes in flight
        try:
            # flock drops the shared lock before it waits for the exclusive one: a reaper may have come between.
            if self._shared and not _temps.still_linked(dir_fd, self._tmp_name, fd):
                raise OSError(errno.ESTALE, "the upload's temp file was removed while it waited to publish")
            self._write_kept()
            os.ftruncate(fd, size)  # also drops the tail of a longer earlier last part
            # After the last write (which moves the mtime), before anyone can see it.
            if attrs is None:
                os.fchmod(fd, _DEFAULT_FILE_MODE)
            else:
                _apply_attrs(fd, os.fstat(fd), attrs)
            os.fsync(fd)
            os.replace(self._tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            if self._shared:
                fcntl.flock(fd, fcntl.LOCK_SH)  # back to the upload's own lock: remote re-sends may come
            raise

    def _abort_sync(self) -> None:
        self._close_sync()
        if not self._published:
            try:
                with _parent_of(self._backend._root, self.key) as (dir_fd, _):
                    os.unlink(self._tmp_name, dir_fd=dir_fd)
            except (FileNotFoundError, NotADirectoryError):
                pass  # its directory went, and the temp with it

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


# Every directory on the way to a key is opened by one name relative to the
# one above it, never following a symlink: no path argument is longer than a
# name, and nothing is read or written through a symlink in the backend.
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(root: str, names: list[str], *, create: bool = False) -> int:
    """An O_PATH fd of the directory ``root/names...`` (``create``: making
    those missing, like mkdir -p).

    Raises ``FileNotFoundError`` for a missing one, ``NotADirectoryError``
    where a file or a symlink is in the way: the persister takes ENOTDIR as a
    name in the way and waits, since the namespace reaches there only once
    the symlink was replaced, and its removal may still be queued.  A symlink
    is never followed, into the root or out of it.
    """
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in names:
            try:
                below = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
                below = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def _parent_of(root: str, key: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """The O_PATH fd of ``key``'s directory (see ``_open_dir``) and ``key``'s last name."""
    *names, name = key.split("/")
    fd = _open_dir(root, names, create=create)
    try:
        yield fd, name
    finally:
        os.close(fd)


def _names(key: str) -> list[str]:
    """The names of the directory ``key`` on the way from the root (none for the root, ``''``)."""
    return key.split("/") if key else []


def _fsync_dir_at(dir_fd: int) -> None:
    """fsync the directory open (O_PATH) at ``dir_fd``: the names made or moved in it are on disk."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _list_sync(root: str, key: str) -> list[ObjectInfo]:
    try:
        dir_fd = _open_dir(root, _names(key))
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
        try:  # open while the entries are used: their stat() is relative to it
            return _entries(dir_fd, listing, key)
        finally:
            os.close(listing)
    finally:
        os.close(dir_fd)


def _entries(dir_fd: int, listing: int, key: str) -> list[ObjectInfo]:
    out = []
    with os.scandir(listing) as entries:
        for entry in entries:
            if entry.name.startswith(UPLOAD_TEMP_PREFIX):
                _temps.reap(dir_fd, entry.name)  # an upload's, unless its process died
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


def _write_node_sync(root: str, key: str, node: NodeAttrs) -> None:
    """Make ``key`` the node: a directory in place, anything else made beside
    it under a hidden name and renamed over it (atomic, like a publish)."""
    kind = stat_mod.S_IFMT(node.mode)

    def make(dir_fd: int, name: str) -> None:
        if kind == stat_mod.S_IFDIR:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=dir_fd)
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)  # never through a symlink at the name
            try:
                _apply_attrs((dir_fd, name), os.fstat(fd), node)
            finally:
                os.close(fd)
            return
        tmp = _temp_name(name, secrets.token_hex(_TEMP_NONCE_BYTES))
        if kind == stat_mod.S_IFLNK:
            os.symlink(node.target or b"", os.fsencode(tmp), dir_fd=dir_fd)
        else:
            os.mknod(tmp, node.mode, node.rdev, dir_fd=dir_fd)  # FIFO, socket or device; chmod below undoes the umask
        try:
            _apply_attrs((dir_fd, tmp), os.stat(tmp, dir_fd=dir_fd, follow_symlinks=False), node)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        _fsync_dir_at(dir_fd)

    _in_parent(root, key, make)


def _read_node_sync(root: str, key: str) -> NodeAttrs | None:
    try:
        with _parent_of(root, key) as (dir_fd, name):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat_mod.S_IFMT(st.st_mode) not in _NODE_TYPES:
                return None
            target = os.readlink(os.fsencode(name), dir_fd=dir_fd) if stat_mod.S_ISLNK(st.st_mode) else None
    except (FileNotFoundError, NotADirectoryError):
        return None
    return NodeAttrs(st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_rdev, target)


def _apply_attrs(target: int | tuple[int, str], st: os.stat_result, attrs: NodeAttrs) -> None:
    """Give ``target`` (an fd, or a name in a directory open at an fd: a
    symlink is not followed) the owner, permission bits and mtime of
    ``attrs`` where ``st`` (its stat) differs (blocking).

    The owner first (chown clears setuid and setgid), and only as root:
    elsewhere a file stays this process's, and whatever the kernel refuses
    to a process that is not root (a setgid bit of a group it is not in, a
    directory of another user) is left as it is.
    """
    if isinstance(target, int):
        node: int | str = target
        at: dict[str, Any] = {}
        follow = True  # an fd: the flag must stay at its default
    else:
        node, at, follow = target[1], {"dir_fd": target[0]}, False
    root = os.geteuid() == 0
    try:
        chowned = False
        if (root and attrs.uid is not None and attrs.gid is not None
                and (st.st_uid, st.st_gid) != (attrs.uid, attrs.gid)):
            os.chown(node, attrs.uid, attrs.gid, follow_symlinks=follow, **at)
            chowned = True
        mode = stat_mod.S_IMODE(attrs.mode)
        if not stat_mod.S_ISLNK(st.st_mode) and (chowned or stat_mod.S_IMODE(st.st_mode) != mode):
            os.chmod(node, mode, **at)  # not a symlink: the name is the node itself (symlinks have no mode)
        if attrs.mtime_ns is not None and st.st_mtime_ns != attrs.mtime_ns:
            os.utime(node, ns=(st.st_atime_ns, attrs.mtime_ns), follow_symlinks=follow, **at)
    except PermissionError:
        if root:
            raise


def _set_attrs_sync(root: str, key: str, attrs: NodeAttrs) -> ObjectInfo:
    """``Backend.set_attrs``: a regular file or directory through an fd opened
    without following a symlink (no lookup between the check and the
    change), other nodes by their name."""
    with _parent_of(root, key) as (dir_fd, name):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat_mod.S_IFMT(st.st_mode) != stat_mod.S_IFMT(attrs.mode):
            raise BackendError(f"set attributes of {key!r}: it is of type {stat_mod.S_IFMT(st.st_mode):o}, "
                               f"not {stat_mod.S_IFMT(attrs.mode):o}")
        if stat_mod.S_ISREG(st.st_mode) or stat_mod.S_ISDIR(st.st_mode):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            except PermissionError:  # not root, and not readable: by its name
                _apply_attrs((dir_fd, name), st, attrs)
            else:
                try:
                    st = os.fstat(fd)
                    if stat_mod.S_IFMT(st.st_mode) != stat_mod.S_IFMT(attrs.mode):
                        raise BackendError(f"set attributes of {key!r}: replaced meanwhile by another type")
                    _apply_attrs(fd, st, attrs)
                finally:
                    os.close(fd)
        else:
            _apply_attrs((dir_fd, name), st, attrs)
        info = _info(key, os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    assert info is not None  # a regular file, directory or node, as checked
    return info


def _stat_sync(root: str, key: str) -> ObjectInfo | None:
    try:
        if not key:
            return _info(key, os.stat(root))
        with _parent_of(root, key) as (dir_fd, name):
            return _info(key, os.stat(name, dir_fd=dir_fd))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _open_object(root: str, key: str) -> int:
    """A read-only fd of the object ``key`` (never through a symlink: ELOOP)."""
    with _parent_of(root, key) as (dir_fd, name):
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _pread_sync(root: str, key: str, offset: int, length: int, if_etag: str | None) -> tuple[bytes, str | None]:
    """Up to ``length`` bytes at ``offset``, unless the file's etag is not ``if_etag`` (if given).

    Returns the bytes and the etag (None without ``if_etag``): ``if_etag``
    if the read is of that version, else the other one seen (and maybe no
    bytes).  The etag is read from the open file, before and after the
    read: a replace (rename) cannot change what an open fd reads, and a
    tool writing the file in place moves its mtime before its bytes land
    (unless within the clock tick of the file's last change).
    """
    fd = _open_object(root, key)
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
# parent just made (or one of its ancestors, between the mkdirs of a walk)
# may vanish before it is used, so the steps that need it are tried again
# this many times.
_DIR_RACE_TRIES = 3


def _in_parent(root: str, key: str, op: Callable[[int, str], T], again: Callable[[], bool] = lambda: True) -> T:
    """``op(dir_fd, name)``, which makes or moves ``key``'s name in its
    directory, once that directory exists (made below the root, never
    through a symlink).

    Tried again (``_DIR_RACE_TRIES``, and while ``again()``) when it meets
    ENOENT: a concurrent ``remove_dir`` took the directory, or an ancestor
    the walk had just made.
    """
    for attempt in range(_DIR_RACE_TRIES):
        try:
            with _parent_of(root, key, create=True) as (dir_fd, name):
                return op(dir_fd, name)
        except FileNotFoundError:
            if attempt == _DIR_RACE_TRIES - 1 or not again():
                raise
    raise AssertionError("unreachable")


def _create_temp_sync(root: str, key: str, sweep: bool) -> tuple[str, str, int]:
    """A new upload temp beside ``key``, locked (``_temps``): its nonce, name and fd.

    ``sweep``: first remove the temps dead uploads left in that directory.
    """
    nonces: list[str] = []

    def make(dir_fd: int, name: str) -> tuple[str, int]:
        def temp_name() -> str:
            nonces.append(secrets.token_hex(_TEMP_NONCE_BYTES))
            return _temp_name(name, nonces[-1])

        if sweep:
            _temps.sweep(dir_fd, parent_key(key) or "the backend root")
        return _temps.create_locked(dir_fd, temp_name, _TEMP_MODE)

    tmp_name, fd = _in_parent(root, key, make)
    return nonces[-1], tmp_name, fd


def _copy_range_sync(
    root: str, src_key: str, dst_fd: int, src_offset: int, dst_offset: int, length: int, if_etag: str | None
) -> tuple[str | None, int]:
    """Copy up to ``length`` bytes unless the source's etag is not ``if_etag`` (if given).

    Returns the source's etag and how many bytes were copied (fewer only if
    the source ends; none if the etag differs).  The etag is read from the
    open source, so a replace (rename) after the check cannot change what is
    copied.
    """
    src_fd = _open_object(root, src_key)
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


def _write_remote_sync(root: str, key: str, nonce: str, data: Buffer, offset: int) -> None:
    """pwrite a part into another process's upload temp, fsynced (its owner may be on another host)."""
    gone = FileNotFoundError(errno.ENOENT, "no such upload (completed or aborted)")
    try:
        with _parent_of(root, key) as (dir_fd, name):
            tmp_name = _temp_name(name, nonce)
            # O_RDWR: on NFS flock is a POSIX lock, and a shared one needs read access.
            fd = os.open(tmp_name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                # The owner renames under LOCK_EX: a temp still at its name now stays there until we are done.
                if not _temps.still_linked(dir_fd, tmp_name, fd):
                    raise gone
                pwrite_sparse(fd, data, offset)
                os.fsync(fd)
            finally:
                os.close(fd)  # also drops the lock
    except (FileNotFoundError, NotADirectoryError):
        raise gone from None


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


def _move_sync(root: str, src: str, dst: str) -> None:
    with _parent_of(root, src) as (src_dir, src_name):
        os.stat(src_name, dir_fd=src_dir, follow_symlinks=False)  # a missing source is not a missing target parent

        def move(dst_dir: int, dst_name: str) -> bool:
            os.replace(src_name, dst_name, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
            _fsync_dir_at(dst_dir)
            return os.path.samestat(os.fstat(src_dir), os.fstat(dst_dir))

        def source_left() -> bool:
            return _exists_at(src_dir, src_name)

        if not _in_parent(root, dst, move, again=source_left):
            _fsync_dir_at(src_dir)  # emptied by this move and removed meanwhile: an fd still syncs it


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _makedirs_sync(root: str, key: str) -> None:
    """mkdir -p below the root; ``NotADirectoryError`` where a file or symlink is in the way."""
    os.close(_open_dir(root, _names(key), create=True))


def _unlink_sync(root: str, key: str) -> None:
    try:
        with _parent_of(root, key) as (dir_fd, name):
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _rmdir_sync(root: str, key: str) -> None:
    try:
        with _parent_of(root, key) as (dir_fd, name):
            for attempt in range(2):
                try:
                    os.rmdir(name, dir_fd=dir_fd)
                    return
                except OSError as e:
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                # Not empty: perhaps only because of temps dead uploads left there.
                if attempt or not _sweep_dir(dir_fd, name, key):
                    return
    except FileNotFoundError:
        pass


def _sweep_dir(dir_fd: int, name: str, key: str) -> int:
    """``_temps.sweep`` of the directory ``name`` (``key``) in the one open at ``dir_fd``."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    try:
        return _temps.sweep(fd, key)
    finally:
        os.close(fd)
