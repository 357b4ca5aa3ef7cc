"""The fabric over RDMA: TCP carries the authenticated conversation, RC queue pairs the chunk bytes.

Everything but chunk payloads is the TCP transport unchanged: the HMAC
handshake, control messages, PING, errors, and payloads under
``FABRIC_RDMA_PAYLOAD_BYTES_MIN``.  On its first GET or PUT of a chunk to a
peer, the client sets RDMA up on that authenticated connection:

    client -> RDMA_CONNECT(its QP address, the memory it lends: addr, rkey, slots)
    server -> RDMA_ACCEPT(its QP address)        (both QPs now RTS)
    client -> RDMA_PROBE(token)
    server    RDMA-READs the token from the client's probe page
    server -> ACK                                 (else ERROR: the path is dead)

A server without RDMA (a ``TcpTransport``, or a node whose device refuses)
answers RDMA_CONNECT with ERROR, and a failed probe ends in ERROR too: the
client then moves that peer's payloads over TCP, and logs why.

After that, the server moves every payload, in both directions, between the
client's lent slots and its own registered slots:

    GET_CHUNK_RDMA(key, slot)        -> server RDMA-WRITEs the chunk there -> CHUNK_RDMA(key, length)
    PUT_CHUNK_RDMA(key, slot, length) -> server RDMA-READs it from there   -> ACK / REJECTED

The reply goes out only after the work request completed, and the client
frees its slot only on the reply (or once its queue pair is destroyed), so no
late write ever lands in a reused slot.  Both sides copy a payload out of its
slot before checking its BLAKE3 key, so the bytes handed on are the bytes
checked.  The server's own slots are registered for local access only: a
peer can reach the memory a node lends for its own requests, never the
memory it serves from.

Memory: ``slots`` CHUNK_BYTES buffers per role, registered once when the
transport is made; work requests in flight are bounded by the server slots
(each holds one); the completion queue is waited on through its channel's
file descriptor (``trio.lowlevel.wait_readable``), or polled in a worker
thread where pyverbs does not expose it.  A failed or stuck work request
breaks the connection (``PeerBroken``), like a TCP error.
"""

from __future__ import annotations

import itertools
import secrets
from typing import TYPE_CHECKING

import trio

from .._errors import ConfigError
from .._limits import (
    CHUNK_BYTES,
    FABRIC_IN_FLIGHT_MAX,
    FABRIC_RDMA_POLL_BATCH,
    FABRIC_RDMA_POLL_ROUND_S,
    FABRIC_RDMA_PROBE_BYTES,
    FABRIC_RDMA_QPS_MAX,
    FABRIC_RDMA_SLOTS,
    FABRIC_RDMA_SLOTS_MAX,
)
from ._rdma_client import RdmaPeer, RdmaPeerTransport
from ._rdma_server import RdmaSession, RdmaSessionTransport
from ._rdma_wire import PROBE_TOKEN_BYTES, LentMemory
from ._slots import Slot, SlotPool
from ._streams import log
from ._tcp import DEFAULT_PORT, TcpTransport
from ._verbs import Completion, Device, Op, QueuePair, VerbsError


class _Work:
    """A posted work request waiting for its completion."""

    __slots__ = ("done", "error", "slot")

    def __init__(self, slot: Slot):
        self.slot = slot
        self.done = trio.Event()
        self.error: str | None = None


class RdmaTransport(TcpTransport):
    """TCP for the authenticated connection, RDMA for chunk payloads where both ends have it.

    ``device``: a device name (``mlx5_0``, ``rxe0``; ``NAME:PORT`` picks the
    port), None for the first with an active port, or a ``Device`` (tests
    pass a ``LoopbackDevice``).  ``ConfigError`` if it cannot be opened or its
    memory cannot be registered.
    """

    kind = "rdma"
    _peer_class = RdmaPeer
    _session_class = RdmaSession

    def __init__(self, node: str, secret: bytes, *, host: str = "", port: int = DEFAULT_PORT, device: str | Device | None = None,
                 slots: int = FABRIC_RDMA_SLOTS, in_flight_max: int = FABRIC_IN_FLIGHT_MAX):
        super().__init__(node, secret, host=host, port=port, in_flight_max=in_flight_max)
        assert 1 <= slots <= FABRIC_RDMA_SLOTS_MAX
        if not isinstance(device, Device):
            from ._pyverbs import PyverbsDevice

            try:
                device = PyverbsDevice(device, cq_depth=2 * slots)
            except VerbsError as e:
                raise ConfigError(f"RDMA transport: {e}") from None
        self._device = device
        try:
            self._lent_region = device.register(slots * CHUNK_BYTES + FABRIC_RDMA_PROBE_BYTES, remote=True)
            self._own_region = device.register(slots * CHUNK_BYTES, remote=False)
        except VerbsError as e:
            device.close()
            raise ConfigError(f"RDMA transport: {e}") from None
        self._lent_slots = SlotPool(self._lent_region.view, slots, CHUNK_BYTES)  # lent to servers for our requests
        self._own_slots = SlotPool(self._own_region.view, slots, CHUNK_BYTES)  # what we serve from and into
        self._lent = LentMemory(addr=self._lent_region.addr, rkey=self._lent_region.rkey, slots=slots)
        self._probe_token = secrets.token_bytes(PROBE_TOKEN_BYTES)
        probe = slots * CHUNK_BYTES
        self._lent_region.view[probe : probe + PROBE_TOKEN_BYTES] = self._probe_token
        self._works: dict[int, _Work] = {}
        self._wr_ids = itertools.count(1)
        self._qps = 0
        self._posted = trio.Event()
        self._cq_failure: str | None = None

    @property
    def device_name(self) -> str:
        return self._device.name

    async def __aenter__(self) -> RdmaTransport:
        await super().__aenter__()
        assert self._nursery is not None  # opened by StreamTransport.__aenter__
        self._nursery.start_soon(self._complete_loop)
        return self

    async def __aexit__(self, *exc) -> bool | None:
        try:
            return await super().__aexit__(*exc)
        finally:
            self._device.close()  # the completion loop has ended with the nursery

    # --- queue pairs and work requests ------------------------------------------------------
    def _open_qp(self, *, remote_access: bool) -> QueuePair:
        if self._cq_failure is not None:
            raise VerbsError(self._cq_failure)
        if self._qps >= FABRIC_RDMA_QPS_MAX:
            raise VerbsError(f"already {self._qps} queue pairs open (FABRIC_RDMA_QPS_MAX)")
        # A client-role QP posts nothing (its server moves the bytes); a server-role QP
        # has at most one request in flight per own slot.
        qp = self._device.open_qp(remote_access=remote_access, send_depth=1 if remote_access else self._own_slots.count)
        self._qps += 1
        return qp

    def _close_qp(self, qp: QueuePair) -> None:
        self._qps -= 1
        try:
            qp.close()
        except VerbsError as e:
            log.warning("fabric: %s", e)

    async def _move(self, qp: QueuePair, op: Op, slot: Slot, length: int, remote_addr: int, rkey: int, *, timeout_s: float) -> None:
        """Run one work request between an own ``slot`` and remote memory; ``VerbsError`` if it fails or hangs.

        Afterwards ``slot.in_flight`` says whether the device may still touch
        the slot (a timeout or cancellation): then only closing ``qp`` frees it.
        """
        if self._cq_failure is not None:
            raise VerbsError(self._cq_failure)
        if self._nursery is None or self._nursery.cancel_scope.cancel_called:
            raise VerbsError(f"the RDMA transport of {self.node!r} is closed")
        wr_id = next(self._wr_ids)
        qp.post(wr_id, op, self._own_region, slot.offset, length, remote_addr, rkey)
        work = self._works[wr_id] = _Work(slot)
        slot.in_flight = True
        self._posted.set()
        try:
            with trio.move_on_after(timeout_s):
                await work.done.wait()
        finally:
            self._works.pop(wr_id, None)  # a late completion finds nothing and leaves the slot parked
        if not work.done.is_set():
            raise VerbsError(f"{op.value} of {length} bytes: no completion within {timeout_s} s")
        if work.error is not None:
            raise VerbsError(f"{op.value} of {length} bytes: {work.error}")

    def _deliver(self, completions: list[Completion]) -> None:
        for done in completions:
            work = self._works.pop(done.wr_id, None)
            if work is not None:
                work.slot.in_flight = False
                work.error = done.error
                work.done.set()

    async def _complete_loop(self) -> None:
        """Hand completions to the waiting work requests (runs in the transport's nursery)."""
        device = self._device
        try:
            if device.completion_fd is None:
                await self._poll_in_thread()
            else:
                device.arm()
                while True:  # armed before each drain, so no completion goes unnoticed
                    while len(batch := device.poll(FABRIC_RDMA_POLL_BATCH)) == FABRIC_RDMA_POLL_BATCH:
                        self._deliver(batch)
                    self._deliver(batch)
                    await trio.lowlevel.wait_readable(device.completion_fd)
                    device.consume_event()
                    device.arm()
        except VerbsError as e:
            self._cq_failure = f"the completion queue of {device.name} failed: {e}"
            log.error("fabric: %s; RDMA transfers fail from now on", self._cq_failure)
            for work in self._works.values():  # their slots stay in flight: freed with their queue pairs
                work.error = self._cq_failure
                work.done.set()
            self._works.clear()

    async def _poll_in_thread(self) -> None:
        while True:
            if not self._works:
                await self._posted.wait()
                self._posted = trio.Event()
                continue
            self._deliver(await trio.to_thread.run_sync(self._device.poll_wait, FABRIC_RDMA_POLL_ROUND_S))


# RdmaPeer and RdmaSession type their transport by what they use of it; they are
# built through _peer_class and _session_class, where no call is checked, so
# have the type checker see here that this transport fits them.
if TYPE_CHECKING:
    _peer_transport: type[RdmaPeerTransport] = RdmaTransport
    _session_transport: type[RdmaSessionTransport] = RdmaTransport
