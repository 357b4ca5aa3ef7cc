"""Can this host give the kernel our backing files (FUSE passthrough)?  Asked of the kernel itself.

``probe_passthrough`` mounts a throwaway FUSE connection of its own (mount(2) of
/dev/fuse on a temporary directory), reads the kernel's INIT, answers it
negotiating passthrough (``FUSE_INIT_EXT`` + ``FUSE_PASSTHROUGH``,
``max_stack_depth`` 1: a tmpfs or ext4 backing file), registers a backing
file (``FUSE_DEV_IOC_BACKING_OPEN``) and closes it again, then unmounts.
Every step that can fail says why: no /dev/fuse, no CAP_SYS_ADMIN for the
mount or for the ioctl (unprivileged containers), a kernel older than 6.9
(protocol < 7.40) or one that does not offer passthrough in INIT.  It takes
a few milliseconds and leaves nothing behind.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import shutil
import tempfile
from dataclasses import dataclass

from .._syscalls import MS_NODEV, MS_NOSUID, mount, unmount_lazy
from . import _abi

log = logging.getLogger("aiturbofs.fuse")


@dataclass(frozen=True)
class Passthrough:
    available: bool
    reason: str  # why not, or what was negotiated
    protocol: str = ""  # the kernel's INIT version, e.g. "7.45"


def probe_passthrough() -> Passthrough:
    try:
        dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return Passthrough(False, f"cannot open /dev/fuse: {exc.strerror}")
    mnt = tempfile.mkdtemp(prefix="aiturbofs-probe-")
    mounted = False
    try:
        opts = f"fd={dev},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}"
        e = mount("aiturbofs-probe", mnt, "fuse.aiturbofs-probe", MS_NOSUID | MS_NODEV, opts)
        if e:
            why = "needs CAP_SYS_ADMIN" if e == errno.EPERM else os.strerror(e)
            return Passthrough(False, f"mount(2) of /dev/fuse failed: {why}")
        mounted = True
        return _negotiate(dev)
    except OSError as exc:
        return Passthrough(False, f"FUSE handshake failed: {exc}")
    finally:
        e = unmount_lazy(mnt) if mounted else 0
        if e:
            log.warning("passthrough probe: could not unmount %s: %s", mnt, os.strerror(e))
        os.close(dev)  # ends the connection
        shutil.rmtree(mnt, ignore_errors=True)


INIT_WAIT_S = 5.0  # the kernel sends INIT as the mount returns; never wait for ever


def _negotiate(dev: int) -> Passthrough:
    if not select.select([dev], [], [], INIT_WAIT_S)[0]:
        raise OSError(errno.ETIMEDOUT, f"no INIT request within {INIT_WAIT_S:.0f} s")
    buf = os.read(dev, _abi.MIN_READ_BUFFER + (1 << 20))
    head = _abi.IN_HEADER.unpack(buf)
    if head.opcode != _abi.INIT:
        raise OSError(errno.EPROTO, f"first request is opcode {head.opcode}, not INIT")
    init = _abi.INIT_IN.unpack(buf, _abi.IN_HEADER.size)
    protocol = f"{init.major}.{init.minor}"
    offered = init.flags | ((init.flags2 << 32) if init.flags & _abi.INIT_EXT else 0)
    want = _abi.INIT_EXT | _abi.PASSTHROUGH if offered & _abi.PASSTHROUGH else 0
    flags = offered & want
    reply = _abi.INIT_OUT.pack(
        major=_abi.KERNEL_VERSION, minor=min(init.minor, _abi.KERNEL_MINOR_VERSION),
        max_readahead=init.max_readahead, flags=flags & 0xFFFFFFFF, flags2=flags >> 32,
        max_background=16, congestion_threshold=12, max_write=1 << 20, time_gran=1, max_stack_depth=1,
    )
    os.write(dev, _abi.OUT_HEADER.pack(len=_abi.OUT_HEADER.size + len(reply), error=0, unique=head.unique) + reply)
    if init.major != _abi.KERNEL_VERSION or init.minor < _abi.KERNEL_MINOR_VERSION:
        return Passthrough(False, f"the kernel speaks FUSE {protocol}; passthrough needs 7.40 (Linux 6.9)", protocol)
    if not offered & _abi.PASSTHROUGH:
        return Passthrough(False, f"the kernel (FUSE {protocol}) does not offer passthrough in INIT "
                                  "(CONFIG_FUSE_PASSTHROUGH off?)", protocol)
    with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as backing:
        try:
            backing_id = backing_open(dev, backing.fileno())
        except OSError as exc:
            # EPERM for both: no CAP_SYS_ADMIN (a container), or the kernel did not enable passthrough
            why = ("refused (EPERM): it needs CAP_SYS_ADMIN in the initial user namespace"
                   if exc.errno == errno.EPERM else exc.strerror)
            return Passthrough(False, f"FUSE_DEV_IOC_BACKING_OPEN failed: {why}", protocol)
        backing_close(dev, backing_id)
    return Passthrough(True, f"negotiated with FUSE {protocol}: a backing file registered as id {backing_id}", protocol)


def backing_open(dev: int, fd: int) -> int:
    """Register ``fd`` as a backing file on the FUSE connection ``dev``; the kernel's id for it (> 0)."""
    return fcntl.ioctl(dev, _abi.DEV_IOC_BACKING_OPEN, bytearray(_abi.BACKING_MAP.pack(fd=fd)), True)


def backing_close(dev: int, backing_id: int) -> None:
    """Drop a registration; files the kernel opened with it keep their backing file."""
    fcntl.ioctl(dev, _abi.DEV_IOC_BACKING_CLOSE, bytearray(backing_id.to_bytes(4, "little")), True)
