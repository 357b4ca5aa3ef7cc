"""RDMA verbs imitated inside one process, for tests: no device, the same rules.

A ``LoopbackDevice`` registers ordinary memory (an anonymous mmap, as the real
adapter does) under a random rkey at a made-up address; queue pairs of all
loopback devices of the process find each other by (GID, QPN).  RDMA READ and
WRITE are memory copies, checked the way an HCA checks them: both queue pairs
must be connected to each other with matching PSNs (else the request
"times out": ``RETRY_EXC_ERR``), the responder must grant remote access and
the rkey and range must fall inside a remotely accessible region (else
``REM_ACCESS_ERR``).  A failed request moves the queue pair to the error
state, so later ones flush, as on RC.

Completions arrive through a pipe, like a completion channel, or only by
polling with ``channel=False``: the two ways ``RdmaTransport`` waits.
``stall = True`` makes work requests hang (never complete) for timeout tests.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import threading
import time
import weakref
from collections import deque

from .._limits import FABRIC_RDMA_POLL_BATCH, FABRIC_RDMA_POLL_SLEEP_S, FABRIC_RDMA_READS_MAX
from ._verbs import Completion, Device, Op, QpAddress, QueuePair, Region, VerbsError

_devices: weakref.WeakValueDictionary[bytes, LoopbackDevice] = weakref.WeakValueDictionary()
_qpns = itertools.count(0x100)
_addresses = itertools.count(1)

RETRY_EXCEEDED = "transport retry counter exceeded (IBV_WC_RETRY_EXC_ERR)"
REMOTE_ACCESS = "remote access error (IBV_WC_REM_ACCESS_ERR)"
FLUSHED = "work request flushed (IBV_WC_WR_FLUSH_ERR)"


class LoopbackQP(QueuePair):
    def __init__(self, device: LoopbackDevice, *, remote_access: bool, send_depth: int):
        self._device = device
        self.remote_access = remote_access
        self._send_depth = send_depth
        self.local = QpAddress(qpn=next(_qpns) % (1 << 24), psn=secrets.randbits(24), lid=0, gid=device.gid,
                               mtu=5, rd_atomic=FABRIC_RDMA_READS_MAX)
        self.remote: QpAddress | None = None
        self.state = "init"  # -> "rts" -> "error"; "closed"
        self.stalled: list[int] = []

    def connect(self, remote: QpAddress) -> None:
        if self.state != "init":
            raise VerbsError(f"modify QP {self.local.qpn} to RTR: it is {self.state}, not INIT")
        self.remote = remote
        self.state = "rts"

    def post(self, wr_id: int, op: Op, region: Region, offset: int, length: int, remote_addr: int, rkey: int) -> None:
        if self.state in ("init", "closed"):
            raise VerbsError(f"post to QP {self.local.qpn}: it is {self.state}")
        assert 0 <= offset and offset + length <= len(region.view), "a local range outside its region"
        if len(self.stalled) >= self._send_depth:
            raise VerbsError(f"post to QP {self.local.qpn}: send queue full ({self._send_depth})")
        if self.state == "error":
            self._device._complete(wr_id, FLUSHED)
        elif self._device.stall:
            self.stalled.append(wr_id)
        else:
            error = self._execute(op, region, offset, length, remote_addr, rkey)
            if error:
                self.state = "error"
            self._device._complete(wr_id, error)

    def _execute(self, op: Op, region: Region, offset: int, length: int, remote_addr: int, rkey: int) -> str | None:
        there = self.remote
        assert there is not None, "post() executes only on a connected queue pair"
        device = _devices.get(there.gid)
        if device is None:
            return RETRY_EXCEEDED  # nobody answers on that path
        peer = device._qps.get(there.qpn)
        if (
            peer is None
            or peer.state != "rts"
            or peer.remote is None  # never: a queue pair in RTS is connected
            or (peer.remote.gid, peer.remote.qpn) != (self.local.gid, self.local.qpn)
            or peer.remote.psn != self.local.psn  # each side expects the PSN the other sends with
            or peer.local.psn != there.psn
        ):
            return RETRY_EXCEEDED  # nobody answers on that path
        target = device._regions.get(rkey)
        if target is None or not peer.remote_access:
            return REMOTE_ACCESS
        start = remote_addr - target.addr
        if start < 0 or start + length > len(target.view):
            return REMOTE_ACCESS
        local = region.view[offset : offset + length]
        remote = target.view[start : start + length]
        if op is Op.WRITE:
            remote[:] = local
        else:
            local[:] = remote
        return None

    def close(self) -> None:
        if self.state != "closed":
            self.state = "closed"
            self.stalled.clear()  # like a destroyed QP: its requests never complete
            self._device._qps.pop(self.local.qpn, None)


class LoopbackDevice(Device):
    def __init__(self, name: str = "loop0", *, channel: bool = True):
        self.gid = b"\xfe\x80" + bytes(6) + secrets.token_bytes(8)
        self.name = f"{name} (loopback verbs, {'completion channel' if channel else 'polled'})"
        self.stall = False
        self._qps: dict[int, LoopbackQP] = {}
        self._regions: dict[int, Region] = {}  # rkey -> remotely accessible region
        self._maps: list[mmap.mmap] = []
        self._completions: deque[Completion] = deque()
        self._lock = threading.Lock()  # poll_wait runs in a worker thread
        self._armed = False
        self._pipe = os.pipe() if channel else None
        if self._pipe:
            for fd in self._pipe:
                os.set_blocking(fd, False)
        self.completion_fd = self._pipe[0] if self._pipe else None
        self.closed = False
        _devices[self.gid] = self

    def register(self, nbytes: int, *, remote: bool) -> Region:
        memory = mmap.mmap(-1, nbytes)
        self._maps.append(memory)
        rkey = 0
        while remote and (rkey == 0 or rkey in self._regions):
            rkey = secrets.randbits(32)
        region = Region(view=memoryview(memory), addr=next(_addresses) << 40, lkey=secrets.randbits(32), rkey=rkey)
        if remote:
            self._regions[rkey] = region
        return region

    def open_qp(self, *, remote_access: bool, send_depth: int) -> LoopbackQP:
        if self.closed:
            raise VerbsError(f"{self.name} is closed")
        qp = LoopbackQP(self, remote_access=remote_access, send_depth=send_depth)
        self._qps[qp.local.qpn] = qp
        return qp

    def _complete(self, wr_id: int, error: str | None) -> None:
        with self._lock:
            self._completions.append(Completion(wr_id, error))
            if self._armed and self._pipe:
                self._armed = False
                os.write(self._pipe[1], b"!")

    def arm(self) -> None:
        with self._lock:
            self._armed = True

    def consume_event(self) -> None:
        assert self._pipe is not None, "called only when completion_fd is set, i.e. with a channel"
        try:
            os.read(self._pipe[0], 64)
        except BlockingIOError:
            pass

    def poll(self, max_entries: int) -> list[Completion]:
        with self._lock:
            return [self._completions.popleft() for _ in range(min(max_entries, len(self._completions)))]

    def poll_wait(self, timeout_s: float) -> list[Completion]:
        deadline = time.monotonic() + timeout_s
        while not (done := self.poll(FABRIC_RDMA_POLL_BATCH)) and time.monotonic() < deadline:
            time.sleep(FABRIC_RDMA_POLL_SLEEP_S)
        return done

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for qp in list(self._qps.values()):
            qp.close()
        self._regions.clear()
        _devices.pop(self.gid, None)
        if self._pipe:
            for fd in self._pipe:
                os.close(fd)
