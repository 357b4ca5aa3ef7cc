"""The server end of an RDMA connection: a ``ServerSession`` that also answers the RDMA extension.

On RDMA_CONNECT it opens a queue pair without remote access, connects it to
the client's and answers with its endpoint; on RDMA_PROBE it reads the
client's token back over the queue pair.  After that it moves every payload
itself, between one of its own slots and the slot the client lent:
RDMA WRITE for a GET, RDMA READ for a PUT, and replies only once the work
request completed.  A failed or stuck work request ends the session
(``SessionBroken``); a slot a work request may still touch is parked until
the queue pair is destroyed.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Protocol

from .._errors import InvalidArgument, NotSupported
from .._limits import FABRIC_RDMA_PAYLOAD_BYTES_MIN, FABRIC_RDMA_PROBE_TIMEOUT_S, FABRIC_RDMA_WR_TIMEOUT_S
from ._rdma_wire import LentMemory, decode_offer, decode_slot, decode_slot_length, encode_endpoint, encode_length
from ._server import ServerSession, SessionBroken, SessionTransport, named_reply
from ._slots import Slot, SlotPool, copy_in, copy_out
from ._streams import log
from ._verbs import Op, QueuePair, VerbsError
from ._wire import Frame, FrameType


class RdmaSessionTransport(SessionTransport, Protocol):
    """What an ``RdmaSession`` uses of the transport that serves it (an ``RdmaTransport``)."""

    _own_slots: SlotPool

    @property
    def device_name(self) -> str: ...

    def _open_qp(self, *, remote_access: bool) -> QueuePair: ...

    def _close_qp(self, qp: QueuePair) -> None: ...

    async def _move(self, qp: QueuePair, op: Op, slot: Slot, length: int, remote_addr: int, rkey: int, *, timeout_s: float) -> None: ...


class RdmaSession(ServerSession):
    """Answers one client like ``ServerSession``, plus the RDMA extension when asked."""

    _transport: RdmaSessionTransport

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._qp: QueuePair | None = None
        self._lent: LentMemory | None = None
        self._checked = False  # the probe read back the client's token
        self._probing = False
        self._parked: list[Slot] = []  # own slots a work request may still touch: freed with the QP

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            self._drop_qp()

    def _rdma_path(self) -> tuple[QueuePair, LentMemory]:
        """The queue pair and the client's lent memory: RDMA_CONNECT sets both, ``_drop_qp`` clears both."""
        assert self._qp is not None and self._lent is not None, "no RDMA_CONNECT on this session"
        return self._qp, self._lent

    def _drop_qp(self) -> None:
        if self._qp is not None:
            self._transport._close_qp(self._qp)
            self._qp, self._lent, self._checked = None, None, False
        for slot in self._parked:
            slot.in_flight = False  # its queue pair is gone: nothing can touch it any more
            self._transport._own_slots.release(slot)
        self._parked.clear()

    async def _extension(self, frame: Frame):
        if frame.type == FrameType.RDMA_CONNECT:
            return self._connect(frame.body)
        if self._qp is None:
            raise SessionBroken(f"{self._who} sent {frame.type.name} before RDMA_CONNECT")
        if frame.type == FrameType.RDMA_PROBE:
            return await self._probe(bytes(frame.body))
        if not self._checked:
            raise SessionBroken(f"{self._who} sent {frame.type.name} before the RDMA path check")
        _, lent = self._rdma_path()
        try:
            if frame.type == FrameType.GET_CHUNK_RDMA:
                index = decode_slot(frame.body, lent)
            else:
                index, length = decode_slot_length(frame.body, lent)
        except InvalidArgument as e:
            raise SessionBroken(f"{self._who} sent a bad {frame.type.name}: {e}") from None
        if frame.type == FrameType.GET_CHUNK_RDMA:
            return await self._get_rdma(frame.key, index)
        return await self._put_rdma(frame.key, index, length)

    def _connect(self, body) -> tuple[FrameType, bytes, bytes]:
        if self._qp is not None:
            raise InvalidArgument("RDMA is already set up on this connection")
        remote, lent = decode_offer(body)
        try:
            qp = self._transport._open_qp(remote_access=False)
        except VerbsError as e:
            log.warning("fabric: no RDMA queue pair for %s: %s", self._who, e)
            raise NotSupported(f"node {self._transport.node!r} cannot open an RDMA queue pair: {e}") from None
        try:
            qp.connect(remote)
        except VerbsError as e:
            self._transport._close_qp(qp)
            log.warning("fabric: cannot connect an RDMA queue pair to %s: %s", self._who, e)
            raise NotSupported(f"node {self._transport.node!r} cannot reach your queue pair: {e}") from None
        self._qp, self._lent = qp, lent
        return FrameType.RDMA_ACCEPT, b"", encode_endpoint(qp.local)

    async def _probe(self, token: bytes) -> tuple[FrameType, bytes, bytes]:
        if self._checked or self._probing:
            raise InvalidArgument("the RDMA path is already checked, or being checked")
        qp, lent = self._rdma_path()  # _extension checked that RDMA_CONNECT came first
        self._probing = True
        failure = None
        try:
            async with self._slot() as slot:
                try:
                    await self._transport._move(qp, Op.READ, slot, len(token), lent.probe_addr, lent.rkey,
                                                timeout_s=FABRIC_RDMA_PROBE_TIMEOUT_S)
                    if bytes(slot.view[: len(token)]) != token:
                        failure = "it read back other bytes than the client sent"
                except VerbsError as e:
                    failure = str(e)
        finally:
            self._probing = False
        if failure is not None:
            self._drop_qp()
            log.warning("fabric: RDMA path check with %s failed (%s): its chunks go over TCP", self._who, failure)
            raise NotSupported(f"node {self._transport.node!r} cannot RDMA-read your memory: {failure}")
        self._checked = True  # from here on the queue pair stays until the session ends
        log.info("fabric: chunks with %s go over RDMA (%s, queue pair %d)", self._who, self._transport.device_name,
                 qp.local.qpn)
        return FrameType.ACK, b"", b""

    async def _get_rdma(self, key: bytes, index: int):
        got = await self._handler.get_chunk(self._info, key)
        if got is None:
            return FrameType.NOT_FOUND, b"", b""
        key, data = named_reply(key, got)
        length = len(data)
        if length < FABRIC_RDMA_PAYLOAD_BYTES_MIN:
            self._counters.chunks_sent += 1
            return FrameType.CHUNK, key, data
        async with self._slot() as slot:
            await copy_in(slot.view, data, self._transport._hash_limiter)
            await self._rdma(Op.WRITE, slot, length, self._rdma_path()[1].slot_addr(index))
        self._counters.bytes_sent += length
        self._counters.rdma_bytes += length
        self._counters.chunks_sent += 1
        return FrameType.CHUNK_RDMA, key, encode_length(length)

    async def _put_rdma(self, key: bytes, index: int, length: int):
        async with self._slot() as slot:
            await self._rdma(Op.READ, slot, length, self._rdma_path()[1].slot_addr(index))
            self._counters.bytes_received += length
            self._counters.rdma_bytes += length
            data = await copy_out(slot.view[:length], self._transport._hash_limiter)
        return await self._put(key, data)  # verified there, then handed to the handler

    async def _rdma(self, op: Op, slot: Slot, length: int, remote_addr: int) -> None:
        qp, lent = self._rdma_path()
        try:
            await self._transport._move(qp, op, slot, length, remote_addr, lent.rkey,
                                        timeout_s=FABRIC_RDMA_WR_TIMEOUT_S)
        except VerbsError as e:
            raise SessionBroken(f"{self._who}: RDMA failed: {e}") from None

    @asynccontextmanager
    async def _slot(self):
        pool = self._transport._own_slots
        slot = await pool.acquire()
        try:
            yield slot
        finally:
            if slot.in_flight:
                self._parked.append(slot)
            else:
                pool.release(slot)
