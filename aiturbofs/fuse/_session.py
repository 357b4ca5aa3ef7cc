"""A FUSE session that speaks the kernel protocol itself: /dev/fuse, no libfuse.

``KernelSession`` mounts /dev/fuse with mount(2) (root: the daemon runs as
root), answers INIT (async reads, atomic O_TRUNC, READDIRPLUS, parallel
directory ops, 1 MiB requests, and FUSE passthrough where the kernel offers
it), and then reads requests on the trio loop and serves each one as a task
of its own, so a request that waits (a writer waiting for memory, a read
fetching from the backend) never holds up the others.

It serves the same ``Operations`` object as the pyfuse3 path: the session
only turns request bytes into the arguments pyfuse3 would pass and the
answers into reply bytes, so the errno edge stays where it is
(``fuse_handler``).  A request the session itself cannot parse (a short
body: a kernel bug or a foreign writer on the descriptor) fails that one
request with EIO and a log line; the session goes on.

Layouts are ``_abi``'s.  Replies are ``writev`` of header and payload, with
no copy of a read's data.  Requests are read into recycled buffers (no
fresh megabyte per 1 MiB write).  An INTERRUPT cancels a READ or WRITE that
is still waiting (the caller gets EINTR); other requests run to the end, as
with pyfuse3.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from dataclasses import dataclass

import pyfuse3
import trio

from .._syscalls import MS_NODEV, MS_NOSUID, MS_RDONLY, mount, unmount_lazy
from . import _abi
from ._passthrough import backing_close, backing_open

log = logging.getLogger("aiturbofs.fuse")

MAX_WRITE_BYTES = 1 << 20  # the kernel's max_pages_limit is 256 pages here (fs.fuse.max_pages_limit)
BUFFER_BYTES = MAX_WRITE_BYTES + 4096  # the largest request: a WRITE's headers and data
BUFFERS_KEPT = 32  # request buffers kept for reuse (first-touch page faults are expensive here)
MAX_BACKGROUND = 64  # the kernel's queue of background requests (read-ahead, async reads)
INTERRUPTS_KEPT = 1024  # interrupts for requests not seen yet, remembered (libfuse keeps them too)
_INTERRUPTIBLE = {_abi.READ, _abi.WRITE}

# what the session asks for in INIT (given that the kernel offers it)
_WANT = (_abi.ASYNC_READ | _abi.ATOMIC_O_TRUNC | _abi.EXPORT_SUPPORT | _abi.BIG_WRITES | _abi.AUTO_INVAL_DATA
         | _abi.DO_READDIRPLUS | _abi.ASYNC_DIO | _abi.PARALLEL_DIROPS | _abi.MAX_PAGES | _abi.INIT_EXT
         # The daemon kills set-user/group-ID bits where the kernel says (a WRITE's or SETATTR's
         # KILL_SUIDGID flag); in return the kernel remembers that a file has none to kill (S_NOSEC)
         # instead of asking getxattr("security.capability") before each write(2).
         | _abi.HANDLE_KILLPRIV_V2)


class Context:
    """What pyfuse3 passes as ``ctx``: the caller's ids (and umask, already applied by the kernel)."""

    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, uid: int, gid: int, pid: int, umask: int = 0):
        self.uid, self.gid, self.pid, self.umask = uid, gid, pid, umask


class SetattrFields:
    """What pyfuse3 passes as ``fields`` to setattr."""

    __slots__ = ("update_atime", "update_mtime", "update_ctime", "update_mode", "update_uid", "update_gid",
                 "update_size", "kill_suidgid")

    def __init__(self, valid: int):
        self.update_atime = bool(valid & (_abi.FATTR_ATIME | _abi.FATTR_ATIME_NOW))
        self.update_mtime = bool(valid & (_abi.FATTR_MTIME | _abi.FATTR_MTIME_NOW))
        self.update_ctime = bool(valid & _abi.FATTR_CTIME)
        self.update_mode = bool(valid & _abi.FATTR_MODE)
        self.update_uid = bool(valid & _abi.FATTR_UID)
        self.update_gid = bool(valid & _abi.FATTR_GID)
        self.update_size = bool(valid & _abi.FATTR_SIZE)
        # (not pyfuse3's: a chown, or a truncate by a caller without CAP_FSETID, under HANDLE_KILLPRIV_V2)
        self.kill_suidgid = bool(valid & _abi.FATTR_KILL_SUIDGID)


_SECURITY_CAPABILITY_Z = b"security.capability\0"
_GETXATTR_NAME_AT = _abi.IN_HEADER.size + _abi.GETXATTR_IN.size
_GETXATTR_CAPABILITY_BYTES = _GETXATTR_NAME_AT + len(_SECURITY_CAPABILITY_Z)


class DirBuffer:
    """A READDIRPLUS reply being filled (``Operations.readdir`` adds entries until it is full)."""

    __slots__ = ("parts", "room")

    def __init__(self, size: int):
        self.parts: list[bytes] = []
        self.room = size


class _Malformed(Exception):
    """A request shorter than its opcode's layout."""


@dataclass(frozen=True)
class Negotiated:
    protocol: str  # the kernel's version, e.g. "7.45"
    passthrough: bool  # FUSE_PASSTHROUGH agreed: opens may hand the kernel a backing file


def _split_names(raw: bytes, count: int) -> list[bytes]:
    parts = raw.split(b"\0")
    if len(parts) <= count:
        raise _Malformed(f"expected {count} NUL-terminated name(s)")
    return parts[:count]


def _time(ns: int) -> tuple[int, int]:
    return ns // 1_000_000_000, ns % 1_000_000_000


def _attr(a: pyfuse3.EntryAttributes) -> bytes:
    at, an = _time(a.st_atime_ns)
    mt, mn = _time(a.st_mtime_ns)
    ct, cn = _time(a.st_ctime_ns)
    return _abi.ATTR.struct.pack(a.st_ino, a.st_size, a.st_blocks, at, mt, ct, an, mn, cn, a.st_mode, a.st_nlink,
                                 a.st_uid, a.st_gid, a.st_rdev, a.st_blksize, 0)


def _valid(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def entry_out(a: pyfuse3.EntryAttributes) -> bytes:
    es, en = _valid(a.entry_timeout)
    as_, an = _valid(a.attr_timeout)
    return _abi.ENTRY_OUT_HEAD.struct.pack(a.st_ino, a.generation, es, as_, en, an) + _attr(a)


def attr_out(a: pyfuse3.EntryAttributes) -> bytes:
    s, n = _valid(a.attr_timeout)
    return _abi.ATTR_OUT_HEAD.struct.pack(s, n, 0) + _attr(a)


class KernelSession:
    """One FUSE connection: mount, INIT, the request loop, notifications, unmount."""

    def __init__(self, ops, mountpoint: str, *, fsname: str, allow_other: bool, read_only: bool,
                 passthrough: bool):
        self.ops = ops
        self.mountpoint = mountpoint
        self.fsname = fsname
        self.allow_other = allow_other
        self.read_only = read_only
        self.want_passthrough = passthrough
        self.name = "passthrough" if passthrough else "kernel"  # the datapath= it serves
        self.negotiated: Negotiated | None = None
        self.fd = -1
        self._mounted = False
        self._reader = trio.CancelScope()
        self._buffers: list[bytearray] = []
        self._running: dict[int, trio.CancelScope] = {}  # unique -> scope, interruptible requests
        self._interrupted: set[int] = set()
        self.passthrough_files = 0  # backing files registered (one per inode while the kernel serves it)
        self.served = [0] * 64  # requests served, by opcode (status: how many READ/WRITE still reach the daemon)
        self.busy_ns = [0] * 64  # time from reading a request to its reply, by opcode (status: where the time goes)
        self._handlers = {
            _abi.LOOKUP: self._lookup, _abi.GETATTR: self._getattr, _abi.SETATTR: self._setattr,
            _abi.READLINK: self._readlink, _abi.SYMLINK: self._symlink, _abi.MKNOD: self._mknod,
            _abi.MKDIR: self._mkdir, _abi.UNLINK: self._unlink, _abi.RMDIR: self._rmdir,
            _abi.RENAME: self._rename, _abi.RENAME2: self._rename2, _abi.LINK: self._link, _abi.OPEN: self._open,
            _abi.READ: self._read, _abi.WRITE: self._write, _abi.STATFS: self._statfs,
            _abi.RELEASE: self._release, _abi.FSYNC: self._fsync, _abi.SETXATTR: self._setxattr,
            _abi.GETXATTR: self._getxattr, _abi.LISTXATTR: self._listxattr, _abi.REMOVEXATTR: self._removexattr,
            _abi.FLUSH: self._flush, _abi.OPENDIR: self._opendir, _abi.READDIRPLUS: self._readdirplus,
            _abi.RELEASEDIR: self._releasedir, _abi.FSYNCDIR: self._fsyncdir, _abi.CREATE: self._create,
            _abi.DESTROY: self._destroy, _abi.FALLOCATE: self._fallocate, _abi.LSEEK: self._lseek,
        }

    # ------------------------------------------------------------ mount / unmount
    def mount(self) -> None:
        """Open /dev/fuse and mount it; raises OSError saying why not."""
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        opts = f"fd={self.fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},default_permissions"
        if self.allow_other:
            opts += ",allow_other"
        flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if self.read_only else 0)
        e = mount(self.fsname, self.mountpoint, "fuse.aiturbo", flags, opts)
        if e:
            os.close(self.fd)
            self.fd = -1
            why = "it needs CAP_SYS_ADMIN (root)" if e == errno.EPERM else os.strerror(e)
            raise OSError(e, f"mount(2) of /dev/fuse on {self.mountpoint} failed: {why}")
        self._mounted = True

    def close(self, *, unmount: bool = True) -> None:
        """Unmount (lazily: open files elsewhere keep their references) and end the connection."""
        if unmount and self._mounted:
            e = unmount_lazy(self.mountpoint)
            if e and e != errno.EINVAL:  # EINVAL: not mounted any more (an external unmount)
                log.warning("could not unmount %s: %s", self.mountpoint, os.strerror(e))
        self._mounted = False
        if self.fd >= 0:
            os.close(self.fd)  # the kernel aborts what is still outstanding
            self.fd = -1

    def terminate(self) -> None:
        """Stop taking requests; those running finish (``serve`` returns once they have)."""
        self._reader.cancel()

    # ------------------------------------------------------------ the loop
    async def serve(self, max_tasks: int) -> None:
        """Negotiate INIT, then serve requests until unmount (ENODEV) or ``terminate``."""
        await self._init()
        limiter = trio.Semaphore(max_tasks)
        async with trio.open_nursery() as nursery:
            with self._reader:
                while True:
                    await limiter.acquire()
                    try:
                        buf, n = await self._read_request()
                    except BaseException:
                        limiter.release()
                        raise
                    if n == 0:
                        limiter.release()
                        break
                    if self._answered_here(buf, n):
                        limiter.release()
                        continue
                    nursery.start_soon(self._serve_one, buf, n, limiter)

    def _answered_here(self, buf: bytearray, n: int) -> bool:
        """Answer the kernel's ``security.capability`` getxattr in the loop itself, without a task.

        The kernel asks it before the first write(2) to each file it has
        not seen without privileges to kill yet (``file_remove_privs``; under
        HANDLE_KILLPRIV_V2 it then remembers, S_NOSEC), and before a chown:
        once per small file written.  The writer waits for the reply: a task
        and the handler chain are most of that wait, for an answer that is
        always "none".
        """
        if n != _GETXATTR_CAPABILITY_BYTES:
            return False
        started = time.monotonic_ns()
        head = _abi.IN_HEADER.unpack(buf)
        if head.opcode != _abi.GETXATTR or head.len != n or buf[_GETXATTR_NAME_AT:n] != _SECURITY_CAPABILITY_Z:
            return False
        self.served[_abi.GETXATTR] += 1
        self._reply_error(head.unique, errno.ENODATA)
        self.busy_ns[_abi.GETXATTR] += time.monotonic_ns() - started
        self._recycle(buf)
        return True

    def _recycle(self, buf: bytearray) -> None:
        """A request's buffer is free again: keep it for a later read (up to BUFFERS_KEPT)."""
        if len(self._buffers) < BUFFERS_KEPT:
            self._buffers.append(buf)

    async def _read_request(self) -> tuple[bytearray, int]:
        buf = self._buffers.pop() if self._buffers else bytearray(BUFFER_BYTES)
        while True:
            try:
                return buf, os.readv(self.fd, [buf])
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.fd)
            except InterruptedError:
                continue
            except FileNotFoundError:
                continue  # the request was interrupted and answered by the kernel before we read it
            except OSError as exc:
                if exc.errno == errno.ENODEV:  # unmounted
                    self._buffers.append(buf)
                    return buf, 0
                raise  # ECONNABORTED (ConnectionAbortedError): the connection was aborted

    async def _init(self) -> None:
        while True:
            buf, n = await self._read_request()
            if n == 0:
                raise OSError(errno.ENODEV, "unmounted before INIT")
            head = _abi.IN_HEADER.unpack(buf)
            if head.opcode == _abi.INIT:
                break
            log.warning("request opcode %d before INIT: answered EIO", head.opcode)
            self._reply_error(head.unique, errno.EIO)
        init = _abi.INIT_IN.unpack(buf, _abi.IN_HEADER.size)
        self._buffers.append(buf)
        protocol = f"{init.major}.{init.minor}"
        if init.major != _abi.KERNEL_VERSION or init.minor < 31:
            self._reply_error(head.unique, errno.EPROTO)
            raise OSError(errno.EPROTO, f"the kernel speaks FUSE {protocol}; this session needs 7.31 or newer")
        offered = init.flags | ((init.flags2 << 32) if init.flags & _abi.INIT_EXT else 0)
        want = _WANT | (_abi.PASSTHROUGH if self.want_passthrough and init.minor >= _abi.KERNEL_MINOR_VERSION else 0)
        flags = offered & want
        reply = _abi.INIT_OUT.pack(
            major=_abi.KERNEL_VERSION, minor=min(init.minor, _abi.KERNEL_MINOR_VERSION),
            max_readahead=init.max_readahead, flags=flags & 0xFFFFFFFF, flags2=flags >> 32,
            max_background=MAX_BACKGROUND, congestion_threshold=MAX_BACKGROUND * 3 // 4,
            max_write=MAX_WRITE_BYTES, time_gran=1, max_pages=MAX_WRITE_BYTES // 4096,
            max_stack_depth=1 if flags & _abi.PASSTHROUGH else 0,
        )
        self._reply(head.unique, reply)
        self.negotiated = Negotiated(protocol, bool(flags & _abi.PASSTHROUGH))
        log.info("FUSE session: kernel protocol %s, passthrough %s", protocol,
                 "on" if self.negotiated.passthrough else "off")

    async def _serve_one(self, buf: bytearray, n: int, limiter: trio.Semaphore) -> None:
        head = None
        started = time.monotonic_ns()
        try:
            head = _abi.IN_HEADER.unpack(buf)
            if head.len != n:
                raise _Malformed(f"header says {head.len} bytes, read {n}")
            op = head.opcode
            if op < len(self.served):
                self.served[op] += 1
            body = memoryview(buf)[_abi.IN_HEADER.size:n]
            if op == _abi.FORGET:
                await self.ops.forget([(head.nodeid, _abi.FORGET_IN.unpack(body).nlookup)])
                return
            if op == _abi.BATCH_FORGET:
                await self._batch_forget(body)
                return
            if op == _abi.INTERRUPT:
                self._interrupt(_abi.INTERRUPT_IN.unpack(body).unique)
                return
            handler = self._handlers.get(op)
            if handler is None:
                self._reply_error(head.unique, errno.ENOSYS)
                return
            if op in _INTERRUPTIBLE:
                await self._interruptible(handler, head, body)
                return
            self._reply(head.unique, await handler(head, body))
        except pyfuse3.FUSEError as exc:
            self._reply_error(head.unique, exc.errno)  # type: ignore[union-attr]
        except (_Malformed, IndexError, ValueError, struct.error) as exc:
            log.error("malformed FUSE request (opcode %s): %s; answered EIO", getattr(head, "opcode", "?"), exc)
            if head is not None:
                self._reply_error(head.unique, errno.EIO)
        except trio.Cancelled:
            raise
        except Exception:  # a bug in the session: say so, keep serving
            log.exception("BUG serving FUSE request (opcode %s); answering EIO", getattr(head, "opcode", "?"))
            if head is not None:
                self._reply_error(head.unique, errno.EIO)
        finally:
            if head is not None and head.opcode < len(self.busy_ns):
                self.busy_ns[head.opcode] += time.monotonic_ns() - started
            self._recycle(buf)
            limiter.release()

    async def _interruptible(self, handler, head, body) -> None:
        if head.unique in self._interrupted:
            self._interrupted.discard(head.unique)
            self._reply_error(head.unique, errno.EINTR)
            return
        scope = self._running[head.unique] = trio.CancelScope()
        try:
            with scope:
                out = await handler(head, body)
        finally:
            del self._running[head.unique]
        if scope.cancelled_caught:
            self._reply_error(head.unique, errno.EINTR)
        else:
            self._reply(head.unique, out)

    def _interrupt(self, unique: int) -> None:
        scope = self._running.get(unique)
        if scope is not None:
            scope.cancel()
            return
        # not seen yet (interrupts jump the queue), or not interruptible, or already answered
        if len(self._interrupted) >= INTERRUPTS_KEPT:
            self._interrupted.clear()
        self._interrupted.add(unique)

    def counts(self) -> dict:
        """Requests served so far: all, and the data ones (zero for files the kernel serves itself)."""
        return {"requests": sum(self.served), "read": self.served[_abi.READ], "write": self.served[_abi.WRITE],
                "passthrough_files": self.passthrough_files,
                "by_opcode": {_abi.OPCODE_NAMES.get(op, str(op)).lower(): n for op, n in enumerate(self.served) if n},
                "ms_by_opcode": {_abi.OPCODE_NAMES.get(op, str(op)).lower(): round(ns / 1e6, 3)
                                 for op, ns in enumerate(self.busy_ns) if ns}}

    # ------------------------------------------------------------ passthrough
    @property
    def passthrough(self) -> bool:
        """Whether opens may hand the kernel a backing file (negotiated in INIT)."""
        return self.negotiated is not None and self.negotiated.passthrough

    def backing_open(self, fd: int) -> int:
        """Register ``fd`` with the kernel as a backing file; its id (FUSE_DEV_IOC_BACKING_OPEN)."""
        backing_id = backing_open(self.fd, fd)
        self.passthrough_files += 1
        return backing_id

    def backing_close(self, backing_id: int) -> None:
        try:
            backing_close(self.fd, backing_id)
        except OSError as exc:
            if self.fd >= 0:
                log.warning("could not close passthrough backing id %d: %s", backing_id, exc)

    # ------------------------------------------------------------ replies and notifications
    def _send(self, error: int, unique: int, payload=b"") -> None:
        """One message to the kernel: a reply (``error`` 0 or -errno) or a notification (``error`` its code, unique 0)."""
        header = _abi.OUT_HEADER.struct.pack(_abi.OUT_HEADER.size + len(payload), error, unique)
        try:
            os.writev(self.fd, [header, payload] if len(payload) else [header])
        except FileNotFoundError:
            pass  # the kernel no longer waits for it (an interrupted request) or knows the inode (a notification)
        except OSError as exc:
            if exc.errno not in (errno.ENODEV, errno.EBADF):  # unmounted / closed meanwhile
                raise

    def _reply(self, unique: int, payload=b"") -> None:
        self._send(0, unique, payload)

    def _reply_error(self, unique: int, err: int) -> None:
        self._send(-(err or errno.EIO), unique)

    def _notify(self, code: int, payload: bytes) -> None:
        if self.fd >= 0:
            self._send(code, 0, payload)

    def invalidate_inode(self, ino: int, attr_only: bool = False) -> None:
        """Drop the kernel's attributes of ``ino`` (and, unless ``attr_only``, its cached pages)."""
        self._notify(_abi.NOTIFY_INVAL_INODE, _abi.NOTIFY_INVAL_INODE_OUT.pack(ino=ino, off=-1 if attr_only else 0))

    def readdir_reply(self, token: DirBuffer, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        size = _abi.dirent_size(len(name), plus=True)
        if size > token.room:
            return False
        record = (entry_out(attr) + _abi.DIRENT_HEAD.struct.pack(attr.st_ino, next_id, len(name), (attr.st_mode >> 12) & 0xF)
                  + name)
        token.parts.append(record + b"\0" * (size - len(record)))
        token.room -= size
        return True

    # ------------------------------------------------------------ requests
    @staticmethod
    def _ctx(head) -> Context:
        return Context(head.uid, head.gid, head.pid)

    async def _batch_forget(self, body) -> None:
        count = _abi.BATCH_FORGET_IN.unpack(body).count
        at = _abi.BATCH_FORGET_IN.size
        items = []
        for i in range(count):
            one = _abi.FORGET_ONE.unpack(body, at + i * _abi.FORGET_ONE.size)
            items.append((one.nodeid, one.nlookup))
        await self.ops.forget(items)

    async def _lookup(self, head, body):
        (name,) = _split_names(bytes(body), 1)
        return entry_out(await self.ops.lookup(head.nodeid, name, self._ctx(head)))

    async def _getattr(self, head, body):
        return attr_out(await self.ops.getattr(head.nodeid, self._ctx(head)))

    async def _setattr(self, head, body):
        s = _abi.SETATTR_IN.unpack(body)
        attr = pyfuse3.EntryAttributes()
        now = time.time_ns()
        attr.st_size = s.size
        attr.st_mode = s.mode
        attr.st_uid = s.uid
        attr.st_gid = s.gid
        attr.st_atime_ns = now if s.valid & _abi.FATTR_ATIME_NOW else s.atime * 1_000_000_000 + s.atimensec
        attr.st_mtime_ns = now if s.valid & _abi.FATTR_MTIME_NOW else s.mtime * 1_000_000_000 + s.mtimensec
        attr.st_ctime_ns = s.ctime * 1_000_000_000 + s.ctimensec
        fh = s.fh if s.valid & _abi.FATTR_FH else None
        return attr_out(await self.ops.setattr(head.nodeid, attr, SetattrFields(s.valid), fh, self._ctx(head)))

    async def _fallocate(self, head, body):
        f = _abi.FALLOCATE_IN.unpack(body)
        await self.ops.fallocate(f.fh, f.offset, f.length, f.mode)
        return b""

    async def _lseek(self, head, body):
        s = _abi.LSEEK_IN.unpack(body)
        return _abi.LSEEK_OUT.pack(offset=await self.ops.lseek(s.fh, s.offset, s.whence))

    async def _readlink(self, head, body):
        return await self.ops.readlink(head.nodeid, self._ctx(head))

    async def _symlink(self, head, body):
        name, target = _split_names(bytes(body), 2)
        return entry_out(await self.ops.symlink(head.nodeid, name, target, self._ctx(head)))

    async def _mknod(self, head, body):
        m = _abi.MKNOD_IN.unpack(body)
        (name,) = _split_names(bytes(body[_abi.MKNOD_IN.size:]), 1)
        return entry_out(await self.ops.mknod(head.nodeid, name, m.mode, m.rdev, Context(head.uid, head.gid, head.pid, m.umask)))

    async def _mkdir(self, head, body):
        m = _abi.MKDIR_IN.unpack(body)
        (name,) = _split_names(bytes(body[_abi.MKDIR_IN.size:]), 1)
        # the kernel sends the mode without S_IFDIR
        return entry_out(await self.ops.mkdir(head.nodeid, name, m.mode | 0o40000, Context(head.uid, head.gid, head.pid, m.umask)))

    async def _unlink(self, head, body):
        (name,) = _split_names(bytes(body), 1)
        await self.ops.unlink(head.nodeid, name, self._ctx(head))
        return b""

    async def _rmdir(self, head, body):
        (name,) = _split_names(bytes(body), 1)
        await self.ops.rmdir(head.nodeid, name, self._ctx(head))
        return b""

    async def _rename(self, head, body):
        r = _abi.RENAME_IN.unpack(body)
        old, new = _split_names(bytes(body[_abi.RENAME_IN.size:]), 2)
        await self.ops.rename(head.nodeid, old, r.newdir, new, 0, self._ctx(head))
        return b""

    async def _rename2(self, head, body):
        r = _abi.RENAME2_IN.unpack(body)
        old, new = _split_names(bytes(body[_abi.RENAME2_IN.size:]), 2)
        await self.ops.rename(head.nodeid, old, r.newdir, new, r.flags, self._ctx(head))
        return b""

    async def _link(self, head, body):
        r = _abi.LINK_IN.unpack(body)
        (name,) = _split_names(bytes(body[_abi.LINK_IN.size:]), 1)
        return entry_out(await self.ops.link(r.oldnodeid, head.nodeid, name, self._ctx(head)))

    def _open_out(self, fi: pyfuse3.FileInfo) -> bytes:
        flags = ((_abi.FOPEN_DIRECT_IO if fi.direct_io else 0) | (_abi.FOPEN_KEEP_CACHE if fi.keep_cache else 0)
                 | (_abi.FOPEN_NONSEEKABLE if fi.nonseekable else 0))
        backing_id = self.ops.backing_id_of(fi.fh)
        if backing_id:
            flags = _abi.FOPEN_PASSTHROUGH
        return _abi.OPEN_OUT.struct.pack(fi.fh, flags, backing_id)

    async def _open(self, head, body):
        o = _abi.OPEN_IN.unpack(body)
        return self._open_out(await self.ops.open(head.nodeid, o.flags, self._ctx(head)))

    async def _create(self, head, body):
        c = _abi.CREATE_IN.unpack(body)
        (name,) = _split_names(bytes(body[_abi.CREATE_IN.size:]), 1)
        fi, attr = await self.ops.create(head.nodeid, name, c.mode, c.flags, Context(head.uid, head.gid, head.pid, c.umask))
        return entry_out(attr) + self._open_out(fi)

    async def _read(self, head, body):
        r = _abi.READ_IN.unpack(body)
        return await self.ops.read(r.fh, r.offset, r.size)  # (sent as it is: no copy)

    async def _write(self, head, body):
        w = _abi.WRITE_IN.unpack(body)
        data = body[_abi.WRITE_IN.size:_abi.WRITE_IN.size + w.size]
        if len(data) != w.size:
            raise _Malformed(f"WRITE of {w.size} bytes carries {len(data)}")
        kill = bool(w.write_flags & _abi.WRITE_KILL_SUIDGID)  # the writer lacks CAP_FSETID
        return _abi.WRITE_OUT.pack(size=await self.ops.write(w.fh, w.offset, data, kill_suidgid=kill))

    async def _statfs(self, head, body):
        s = await self.ops.statfs(self._ctx(head))
        return _abi.KSTATFS.pack(blocks=s.f_blocks, bfree=s.f_bfree, bavail=s.f_bavail, files=s.f_files,
                                 ffree=s.f_ffree, bsize=s.f_bsize, namelen=s.f_namemax, frsize=s.f_frsize)

    async def _release(self, head, body):
        await self.ops.release(_abi.RELEASE_IN.unpack(body).fh)
        return b""

    async def _flush(self, head, body):
        await self.ops.flush(_abi.FLUSH_IN.unpack(body).fh)
        return b""

    async def _fsync(self, head, body):
        f = _abi.FSYNC_IN.unpack(body)
        await self.ops.fsync(f.fh, bool(f.fsync_flags & _abi.FSYNC_FDATASYNC))
        return b""

    async def _opendir(self, head, body):
        fh = await self.ops.opendir(head.nodeid, self._ctx(head))
        return _abi.OPEN_OUT.pack(fh=fh)

    async def _readdirplus(self, head, body):
        r = _abi.READ_IN.unpack(body)
        token = DirBuffer(r.size)
        await self.ops.readdir(r.fh, r.offset, token)
        return b"".join(token.parts)  # one buffer: a reply may hold more records than writev takes iovecs

    async def _releasedir(self, head, body):
        await self.ops.releasedir(_abi.RELEASE_IN.unpack(body).fh)
        return b""

    async def _fsyncdir(self, head, body):
        f = _abi.FSYNC_IN.unpack(body)
        await self.ops.fsyncdir(f.fh, bool(f.fsync_flags & _abi.FSYNC_FDATASYNC))
        return b""

    async def _setxattr(self, head, body):
        s = _abi.SETXATTR_IN_COMPAT.unpack(body)  # SETXATTR_EXT is not negotiated
        raw = bytes(body[_abi.SETXATTR_IN_COMPAT.size:])
        nul = raw.find(b"\0")
        if nul < 0 or len(raw) < nul + 1 + s.size:
            raise _Malformed("SETXATTR name or value cut short")
        name, ctx = raw[:nul], self._ctx(head)
        if s.flags & ~(os.XATTR_CREATE | os.XATTR_REPLACE):
            raise pyfuse3.FUSEError(errno.EINVAL)
        # XATTR_CREATE / XATTR_REPLACE as pyfuse3 does them: ask first
        if s.flags & os.XATTR_CREATE:
            try:
                await self.ops.getxattr(head.nodeid, name, ctx)
            except pyfuse3.FUSEError as exc:
                if exc.errno != pyfuse3.ENOATTR:
                    raise
            else:
                raise pyfuse3.FUSEError(errno.EEXIST)
        elif s.flags & os.XATTR_REPLACE:
            await self.ops.getxattr(head.nodeid, name, ctx)
        await self.ops.setxattr(head.nodeid, name, raw[nul + 1 : nul + 1 + s.size], ctx)
        return b""

    @staticmethod
    def _sized(value: bytes, size: int) -> bytes:
        """getxattr/listxattr: size 0 asks how big; too small a buffer is ERANGE."""
        if size == 0:
            return _abi.GETXATTR_OUT.pack(size=len(value))
        if len(value) > size:
            raise pyfuse3.FUSEError(errno.ERANGE)
        return value

    async def _getxattr(self, head, body):
        g = _abi.GETXATTR_IN.unpack(body)
        (name,) = _split_names(bytes(body[_abi.GETXATTR_IN.size:]), 1)
        return self._sized(await self.ops.getxattr(head.nodeid, name, self._ctx(head)), g.size)

    async def _listxattr(self, head, body):
        g = _abi.GETXATTR_IN.unpack(body)
        names = await self.ops.listxattr(head.nodeid, self._ctx(head))
        return self._sized(b"".join(n + b"\0" for n in names), g.size)

    async def _removexattr(self, head, body):
        (name,) = _split_names(bytes(body), 1)
        await self.ops.removexattr(head.nodeid, name, self._ctx(head))
        return b""

    async def _destroy(self, head, body):
        return b""
