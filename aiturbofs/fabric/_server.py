"""The server end of a fabric connection: answers one authenticated client.

One task reads requests and starts a task per request, but stops reading
while ``in_flight_max`` are running: a client that ignores the bound gets
backpressure, not more concurrency.  PUT payloads are verified before the
handler sees them.
"""

from __future__ import annotations

from typing import Protocol

import trio

from .._errors import AiturboError, IntegrityError, InvalidArgument, NotSupported, PeerBroken
from .._limits import CHUNK_BYTES, FABRIC_SEND_TIMEOUT_S
from .._nursery import open_nursery
from ._base import ChunkHandler, Named, PeerCounters, PeerInfo
from ._streams import log, send_error, stream_errors, verify_chunk
from ._wire import (
    EXTENSIONS,
    REQUESTS,
    Frame,
    FrameReader,
    FrameType,
    decode_json,
    encode_json,
    encode_message,
    send_frame,
)


class SessionTransport(Protocol):
    """What a ``ServerSession`` uses of the transport that serves it (a ``StreamTransport``).

    Typed by what it does, not by the class: the transport module imports
    this one to build its sessions, so this one does not import it back.
    """

    node: str
    kind: str
    in_flight_max: int
    _hash_limiter: trio.CapacityLimiter


class SessionBroken(Exception):
    """Raised while answering a request when the connection itself is no longer usable.

    Not an ``AiturboError``, so it is never sent back as that request's
    ERROR: the session ends and the client sees ``PeerBroken``.
    """


def named_reply(key: bytes, got):
    """The reply key and bytes of a handler's answer to a request for chunk ``key`` (``Named``: its digest)."""
    reply_key, data = (got.digest, got.data) if isinstance(got, Named) else (key, got)
    assert len(data) <= CHUNK_BYTES, "a handler returned more than a chunk"
    return reply_key, data


class ServerSession:
    """Answers the requests of one authenticated client."""

    def __init__(self, transport: SessionTransport, stream: trio.abc.Stream, reader: FrameReader, info: PeerInfo, handler: ChunkHandler, counters: PeerCounters):
        self._transport = transport
        self._stream = stream
        self._reader = reader
        self._info = info
        self._handler = handler
        self._counters = counters
        self._slots = trio.Semaphore(transport.in_flight_max)
        self._send_lock = trio.StrictFIFOLock()
        self._garbled = False  # a reply was cut off mid-frame: nothing more may be sent
        self._failure: str | None = None
        self._who = f"{info.node!r} at {info.address}"

    async def run(self) -> None:
        """Serve until the client hangs up or breaks the protocol (then logged, never raised)."""
        async with open_nursery() as nursery:
            try:
                while True:
                    await self._slots.acquire()  # backpressure: no reading while all slots are busy
                    with stream_errors(f"receive from {self._who}"):
                        frame = await self._reader.receive()
                    if frame is None:
                        break
                    self._counters.bytes_received += frame.wire_bytes
                    self._counters.frames_received += 1
                    if frame.type not in REQUESTS or frame.request_id == 0:
                        raise PeerBroken(f"{self._who} sent a {frame.type.name} frame where requests are expected")
                    nursery.start_soon(self._answer, frame, nursery.cancel_scope)
            except PeerBroken as e:
                self._failure = self._failure or str(e)
            # The client is gone or misbehaved: replies still being worked on
            # could not be delivered, so stop them.
            nursery.cancel_scope.cancel()
        if self._failure is not None:
            log.warning("fabric: dropped connection from %s", self._failure)
            if not self._garbled:
                await send_error(self._stream, self._failure)
        log.debug("fabric: connection from %s ended", self._who)

    async def _answer(self, frame: Frame, session_scope: trio.CancelScope) -> None:
        try:
            ftype, key, body = await self._reply_to(frame)
            await self._send(frame.request_id, ftype, key, body)
        except PeerBroken as e:
            self._failure = self._failure or str(e)
            session_scope.cancel()
        finally:
            self._slots.release()

    async def _reply_to(self, frame: Frame) -> tuple[FrameType, bytes, bytes]:
        try:
            if frame.type in EXTENSIONS:
                return await self._extension(frame)
            if frame.type == FrameType.GET_CHUNK:
                return await self._get(frame.key)
            if frame.type == FrameType.PUT_CHUNK:
                return await self._put(frame.key, frame.body)
            if frame.type == FrameType.CONTROL:
                return await self._control(frame.body)
            assert frame.type == FrameType.PING
            return FrameType.PONG, b"", b""
        except SessionBroken as e:
            raise PeerBroken(str(e)) from None
        except AiturboError as e:
            return FrameType.ERROR, b"", encode_message(f"{type(e).__name__}: {e}")
        except Exception as e:  # a handler's bug or race fails its request, never the node
            log.error("fabric: %s request from %s failed: %r", frame.type.name, self._who, e, exc_info=True)
            return FrameType.ERROR, b"", encode_message(f"{type(e).__name__}: {e}")

    async def _extension(self, frame: Frame):
        """A transport-extension request; this transport has none (RDMA overrides this)."""
        if frame.type == FrameType.RDMA_CONNECT:
            raise NotSupported(f"node {self._transport.node!r} has no RDMA (its fabric runs over {self._transport.kind})")
        raise SessionBroken(f"{self._who} sent {frame.type.name} on a connection without RDMA")

    async def _get(self, key: bytes):
        got = await self._handler.get_chunk(self._info, key)
        if got is None:
            return FrameType.NOT_FOUND, b"", b""
        reply_key, data = named_reply(key, got)
        self._counters.chunks_sent += 1
        return FrameType.CHUNK, reply_key, data

    async def _put(self, key: bytes, data: bytearray):
        what = f"chunk {key.hex()[:16]}… put by {self._who}"
        try:
            await verify_chunk(data, key, what, self._transport._hash_limiter)
        except IntegrityError as e:
            self._counters.corrupt_frames += 1
            log.warning("fabric: rejected a corrupt chunk: %s", e)
            return FrameType.REJECTED, b"", encode_message(str(e))
        self._counters.chunks_received += 1
        if await self._handler.put_chunk(self._info, key, data):
            return FrameType.ACK, b"", b""
        return FrameType.REJECTED, b"", encode_message(f"node {self._transport.node!r} refused the chunk")

    async def _control(self, raw: bytearray):
        try:
            body = decode_json(raw)
        except ValueError as e:
            raise InvalidArgument(f"malformed control body: {e}") from None
        answer = await self._handler.control(self._info, body)
        return FrameType.CONTROL_REPLY, b"", encode_json(answer)

    async def _send(self, request_id: int, ftype: FrameType, key: bytes, body) -> None:
        async with self._send_lock:
            if self._garbled:
                raise PeerBroken(f"connection to {self._who} is already broken")
            try:
                with stream_errors(f"reply to {self._who}"), trio.fail_after(FABRIC_SEND_TIMEOUT_S):
                    sent = await send_frame(self._stream, ftype, request_id, key, body)
            except BaseException:
                self._garbled = True  # part of the frame may be out
                raise
        self._counters.bytes_sent += sent
        self._counters.frames_sent += 1
