"""The verbs seam: what the RDMA transport needs from an RDMA device, and no more.

``Device`` is implemented by ``_pyverbs`` (a NIC or soft-RoCE, through
rdma-core's Python bindings) and by ``_loopverbs`` (an in-process imitation
that lets the transport's protocol run in tests without hardware).  The
transport uses one device, one completion queue, two registered regions and
one reliable-connected queue pair per peer, and only signalled RDMA READ and
WRITE work requests: no SEND/RECV, so no receive queues to keep stocked.

Every method is a non-blocking verbs call made on the trio thread, except
``poll_wait``, which runs in a worker thread when the completion channel has
no file descriptor to wait on.  Failures raise ``VerbsError``; what one means
(fall back to TCP, break the connection, refuse the config) is the caller's call.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # ibv_mtu -> bytes


class VerbsError(Exception):
    """A verbs call failed; the message says which and why."""


class Op(enum.Enum):
    READ = "RDMA READ"  # remote memory -> local slot
    WRITE = "RDMA WRITE"  # local slot -> remote memory


@dataclass(frozen=True)
class QpAddress:
    """What a peer needs to connect its queue pair to ours (sent over the authenticated channel)."""

    qpn: int  # queue pair number (24 bits)
    psn: int  # first packet sequence number we send with (24 bits, random)
    lid: int  # port LID (InfiniBand; 0 on RoCE)
    gid: bytes  # 16-byte port GID (RoCE: derived from the netdev's IP address)
    mtu: int  # active path MTU, as ibv_mtu (1..5)
    rd_atomic: int  # RDMA READs we accept in flight as responder


@dataclass(frozen=True)
class Completion:
    wr_id: int
    error: str | None  # None: success; else the work completion's status, readable


@dataclass(frozen=True)
class Region:
    """Registered memory: its bytes, and its verbs identity (rkey 0 when not remotely accessible)."""

    view: memoryview
    addr: int
    lkey: int
    rkey: int


class QueuePair(ABC):
    """One reliable-connected queue pair, created in INIT with its access rights fixed."""

    local: QpAddress

    @abstractmethod
    def connect(self, remote: QpAddress) -> None:
        """INIT -> RTR -> RTS towards ``remote``."""

    @abstractmethod
    def post(self, wr_id: int, op: Op, region: Region, offset: int, length: int, remote_addr: int, rkey: int) -> None:
        """Post one signalled ``op`` between ``region[offset:offset+length]`` and remote memory."""

    @abstractmethod
    def close(self) -> None:
        """Destroy the queue pair (idempotent).

        After it returns the device no longer touches memory on behalf of
        this queue pair, and none of its work requests complete any more.
        """


class Device(ABC):
    """An opened RDMA port: protection domain, completion queue, registered memory."""

    name: str  # for logs: device, port, link layer, GID index
    completion_fd: int | None  # readable when ``arm``ed and a completion arrived; None: use ``poll_wait``

    @abstractmethod
    def register(self, nbytes: int, *, remote: bool) -> Region:
        """Allocate and register ``nbytes``; ``remote``: peers may RDMA READ and WRITE it."""

    @abstractmethod
    def open_qp(self, *, remote_access: bool, send_depth: int) -> QueuePair:
        """A new RC queue pair on the completion queue; ``remote_access``: peers may
        READ/WRITE our remotely accessible regions through it."""

    @abstractmethod
    def arm(self) -> None:
        """Request an event on ``completion_fd`` for the next completion."""

    @abstractmethod
    def consume_event(self) -> None:
        """Take (and acknowledge) the event that made ``completion_fd`` readable, if any."""

    @abstractmethod
    def poll(self, max_entries: int) -> list[Completion]:
        """Completions waiting now, at most ``max_entries``; never blocks."""

    @abstractmethod
    def poll_wait(self, timeout_s: float) -> list[Completion]:
        """In a worker thread: poll until a completion arrives or ``timeout_s`` passes."""

    @abstractmethod
    def close(self) -> None:
        """Destroy everything (idempotent); queue pairs first, then memory."""
