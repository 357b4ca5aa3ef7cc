"""The client end of an RDMA connection: a ``StreamPeer`` whose chunk payloads use a queue pair.

The queue pair is set up on the first GET or PUT (see ``_rdma`` for the
exchange), or the peer's payloads stay on TCP, logged.  Each RDMA call lends
one slot of the transport's lent region to the server, which writes the
chunk into it (GET) or reads it from there (PUT) before it replies.  A slot
comes back on the reply, never earlier: a call abandoned by its caller
leaves it lent until the late reply arrives, or until the queue pair is
destroyed when the connection ends.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Protocol

import trio

from .._errors import InvalidArgument, PeerBroken, RemoteError
from .._limits import (
    CHUNK_BYTES,
    FABRIC_CALL_TIMEOUT_S,
    FABRIC_RDMA_PAYLOAD_BYTES_MIN,
    FABRIC_RDMA_SETUP_TIMEOUT_S,
    HASH_BYTES,
)
from ._client import PeerTransport, StreamPeer, _Call
from ._rdma_wire import LentMemory, decode_accept, decode_length, encode_endpoint, encode_slot, encode_slot_length
from ._slots import Slot, SlotPool, copy_in, copy_out
from ._streams import log
from ._verbs import QueuePair, VerbsError
from ._wire import Frame, FrameType


class RdmaPeerTransport(PeerTransport, Protocol):
    """What an ``RdmaPeer`` uses of the transport that made it (an ``RdmaTransport``)."""

    _lent: LentMemory
    _lent_slots: SlotPool
    _probe_token: bytes

    @property
    def device_name(self) -> str: ...

    def _open_qp(self, *, remote_access: bool) -> QueuePair: ...

    def _close_qp(self, qp: QueuePair) -> None: ...


class RdmaPeer(StreamPeer):
    """A ``StreamPeer`` whose chunk payloads move over an RC queue pair once set up."""

    _transport: RdmaPeerTransport

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._qp: QueuePair | None = None
        self._path: str | None = None  # "rdma" or "tcp", chosen on the first chunk call
        self._choosing = trio.Lock()
        self._orphans: dict[int, Slot] = {}  # request id -> slot of a call its caller abandoned

    @property
    def payload_path(self) -> str | None:
        """How chunk payloads move to and from this peer: "rdma", "tcp", or None (not chosen yet)."""
        return self._path

    async def _get(self, key: bytes, timeout: float, *, named: bool) -> tuple[bytes, bytearray] | None:
        assert len(key) == HASH_BYTES, "chunk keys are 32-byte BLAKE3 digests"
        deadline = trio.current_time() + timeout
        if not await self._uses_rdma(deadline):
            return await super()._get(key, _left(deadline), named=named)
        expected = {FrameType.CHUNK_RDMA, FrameType.CHUNK, FrameType.NOT_FOUND}
        async with self._lend(deadline) as (slot, call):
            reply = await self._call(FrameType.GET_CHUNK_RDMA, key, encode_slot(slot.index), _left(deadline), expected, call)
            if reply.type == FrameType.NOT_FOUND:
                return None
            if reply.type == FrameType.CHUNK:  # small: it came in the frame
                return reply.key, await self._accept_chunk(key, reply.key, reply.body, named=named)
            length = self._checked(decode_length, reply.body)
            data = await copy_out(slot.view[:length], self._transport._hash_limiter)
        self.counters.bytes_received += length
        self.counters.rdma_bytes += length
        return reply.key, await self._accept_chunk(key, reply.key, data, named=named)

    async def put_chunk(self, key: bytes, data, *, timeout: float = FABRIC_CALL_TIMEOUT_S) -> bool:
        assert len(key) == HASH_BYTES, "chunk keys are 32-byte BLAKE3 digests"
        assert len(data) <= CHUNK_BYTES, "a chunk is at most CHUNK_BYTES"
        deadline = trio.current_time() + timeout
        if len(data) < FABRIC_RDMA_PAYLOAD_BYTES_MIN or not await self._uses_rdma(deadline):
            return await super().put_chunk(key, data, timeout=_left(deadline))
        length = len(data)
        async with self._lend(deadline) as (slot, call):
            await copy_in(slot.view, data, self._transport._hash_limiter)
            body = encode_slot_length(slot.index, length)
            reply = await self._call(FrameType.PUT_CHUNK_RDMA, key, body, _left(deadline), {FrameType.ACK, FrameType.REJECTED}, call)
        self.counters.bytes_sent += length  # the server has read them, whatever it thought of them
        self.counters.rdma_bytes += length
        if reply.type == FrameType.REJECTED:
            log.info("fabric: %r refused chunk %s…: %s", self.info.node, key.hex()[:16], bytes(reply.body).decode("utf-8", "replace"))
            return False
        self.counters.chunks_sent += 1
        return True

    # --- setting RDMA up ----------------------------------------------------------------
    async def _uses_rdma(self, deadline: float) -> bool:
        if self._path is None:
            async with self._choosing:
                if self._failure is not None:
                    self._raise()
                if self._path is None:
                    # Shielded like a frame send: a set-up cut short would leave the two
                    # ends disagreeing.  Each step is still bounded by its own timeout.
                    with trio.CancelScope(shield=True):
                        self._path = await self._choose_path(deadline)
        return self._path == "rdma"

    async def _choose_path(self, deadline: float) -> str:
        """Set up the queue pair with this peer: "rdma", or "tcp" (logged) if it cannot be had."""
        transport, who = self._transport, f"{self.info.node!r} at {self.info.address}"
        try:
            self._qp = transport._open_qp(remote_access=True)
        except VerbsError as e:
            log.warning("fabric: chunks with %s go over TCP: no RDMA queue pair here (%s)", who, e)
            return "tcp"
        step = "RDMA_CONNECT"
        try:
            offer = encode_endpoint(self._qp.local, transport._lent)
            reply = await self._call(FrameType.RDMA_CONNECT, b"", offer, _left(deadline, FABRIC_RDMA_SETUP_TIMEOUT_S), {FrameType.RDMA_ACCEPT})
            step = "queue-pair connect"
            self._qp.connect(self._checked(decode_accept, reply.body))
            step = "RDMA path check"
            await self._call(FrameType.RDMA_PROBE, b"", transport._probe_token, _left(deadline, FABRIC_RDMA_SETUP_TIMEOUT_S), {FrameType.ACK})
        except (RemoteError, VerbsError) as e:
            self._drop_qp()
            if step == "RDMA_CONNECT":  # the peer has no RDMA, or none to spare: expected in mixed clusters
                log.info("fabric: chunks with %s go over TCP: %s", who, e)
            else:
                log.warning("fabric: chunks with %s go over TCP: %s failed: %s", who, step, e)
            return "tcp"
        log.info("fabric: chunks with %s go over RDMA (%s, queue pair %d)", who, transport.device_name, self._qp.local.qpn)
        return "rdma"

    def _checked(self, decode, body):
        """A peer's RDMA field decoded, or the peer is broken: it broke the protocol."""
        try:
            return decode(body)
        except InvalidArgument as e:
            self._fail(PeerBroken, f"{self.info.node!r} at {self.info.address} sent a bad RDMA field: {e}")
            self._raise()

    # --- lent slots -----------------------------------------------------------------------
    @asynccontextmanager
    async def _lend(self, deadline: float):
        """A lent slot and the call that uses it; freed only when the server is done with it."""
        pool = self._transport._lent_slots
        slot = None
        with trio.move_on_at(deadline):
            slot = await pool.acquire()
        if slot is None:
            self._fail(PeerBroken, f"{self.info.node!r} at {self.info.address}: no RDMA buffer came free within the call's "
                       f"timeout (all {pool.count} are lent to slower calls)")
            self._raise()
        call = _Call()
        try:
            yield slot, call
        finally:
            if call.sent and call.reply is None and self._failure is None:
                assert call.request_id is not None  # _call sets it before it sends
                self._orphans[call.request_id] = slot  # the server may still write it: its late reply frees it
            else:
                pool.release(slot)

    def _dispatch(self, frame: Frame) -> None:
        super()._dispatch(frame)
        slot = self._orphans.pop(frame.request_id, None)
        if slot is not None:
            self._transport._lent_slots.release(slot)

    def _fail(self, cls, message: str) -> None:
        if self._failure is not None:
            return
        super()._fail(cls, message)
        self._drop_qp()

    def _drop_qp(self) -> None:
        """Destroy the queue pair first: then no server can touch the slots it was lent."""
        if self._qp is not None:
            self._transport._close_qp(self._qp)
            self._qp = None
        for slot in self._orphans.values():
            self._transport._lent_slots.release(slot)
        self._orphans.clear()


def _left(deadline: float, cap: float = float("inf")) -> float:
    return max(0.0, min(deadline - trio.current_time(), cap))
