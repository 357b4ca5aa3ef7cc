"""The client end of a fabric connection: requests multiplexed over one stream.

Callers take one of ``in_flight_max`` slots, send a request under a fresh
request id and wait; one receive task per connection hands each reply to its
caller.  The first failure (or our own ``aclose``) is recorded once and every
pending and later call raises it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn, Protocol

import trio

from .._errors import AiturboError, IntegrityError, PeerBroken, PeerClosed, PeerSlow, RemoteError
from .._limits import CHUNK_BYTES, FABRIC_CALL_TIMEOUT_S, FABRIC_PING_TIMEOUT_S, FABRIC_SEND_TIMEOUT_S, HASH_BYTES
from ._base import Peer, PeerCounters, PeerInfo
from ._streams import log, stream_errors, verify_chunk
from ._wire import REPLIES, Frame, FrameReader, FrameType, decode_json, decode_message, encode_json, send_frame


class PeerTransport(Protocol):
    """What a ``StreamPeer`` uses of the transport that made it (a ``StreamTransport``).

    Typed by what it does, not by the class: the transport module imports
    this one to build its peers, so this one does not import it back.
    """

    in_flight_max: int
    _hash_limiter: trio.CapacityLimiter
    _peers: set[StreamPeer]  # its open peers: each leaves when it closes or its connection ends


class _Call:
    """A request waiting for its reply."""

    __slots__ = ("done", "reply", "error", "request_id", "sent")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: Frame | None = None
        self.error: AiturboError | None = None
        self.request_id: int | None = None
        self.sent = False  # the whole request frame went out: the peer may act on it


class StreamPeer(Peer):
    """The client end of one authenticated stream."""

    def __init__(self, transport: PeerTransport, stream: trio.abc.Stream, reader: FrameReader, info: PeerInfo, counters: PeerCounters):
        self.info = info
        self.counters = counters
        self._transport = transport
        self._stream = stream
        self._reader = reader
        self._slots = trio.Semaphore(transport.in_flight_max)
        self._send_lock = trio.StrictFIFOLock()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._failure: tuple[type[AiturboError], str] | None = None  # set once broken or closed
        self._receive_scope = trio.CancelScope()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.info.node!r} at {self.info.address} {self.state}>"

    @property
    def state(self) -> str:
        if self._failure is None:
            return "open"
        return "closed" if self._failure[0] is PeerClosed else "broken"

    # --- public calls ------------------------------------------------------------------
    async def get_chunk(self, key: bytes, *, timeout: float = FABRIC_CALL_TIMEOUT_S) -> bytearray | None:
        got = await self._get(key, timeout, named=False)
        return None if got is None else got[1]

    async def get_named_chunk(self, name: bytes, *, timeout: float = FABRIC_CALL_TIMEOUT_S) -> tuple[bytes, bytearray] | None:
        return await self._get(name, timeout, named=True)

    async def _get(self, key: bytes, timeout: float, *, named: bool) -> tuple[bytes, bytearray] | None:
        """``(digest, bytes)`` of chunk ``key`` (named: the digest is the reply's), or None."""
        assert len(key) == HASH_BYTES, "chunk keys are 32-byte BLAKE3 digests"
        reply = await self._call(FrameType.GET_CHUNK, key, b"", timeout, {FrameType.CHUNK, FrameType.NOT_FOUND})
        if reply.type == FrameType.NOT_FOUND:
            return None
        return reply.key, await self._accept_chunk(key, reply.key, reply.body, named=named)

    async def put_chunk(self, key: bytes, data, *, timeout: float = FABRIC_CALL_TIMEOUT_S) -> bool:
        assert len(key) == HASH_BYTES, "chunk keys are 32-byte BLAKE3 digests"
        assert len(data) <= CHUNK_BYTES, "a chunk is at most CHUNK_BYTES"
        reply = await self._call(FrameType.PUT_CHUNK, key, data, timeout, {FrameType.ACK, FrameType.REJECTED})
        if reply.type == FrameType.REJECTED:
            log.info("fabric: %r refused chunk %s…: %s", self.info.node, key.hex()[:16], decode_message(reply.body))
            return False
        self.counters.chunks_sent += 1
        return True

    async def control(self, body: dict, *, timeout: float = FABRIC_CALL_TIMEOUT_S, keep_on_timeout: bool = False) -> dict:
        reply = await self._call(FrameType.CONTROL, b"", encode_json(body), timeout, {FrameType.CONTROL_REPLY},
                                 keep_on_timeout=keep_on_timeout)
        try:
            return decode_json(reply.body)
        except ValueError as e:
            self._fail(PeerBroken, f"{self.info.node!r} at {self.info.address} sent a malformed control reply: {e}")
            self._raise()

    async def ping(self, *, timeout: float = FABRIC_PING_TIMEOUT_S) -> float:
        start = trio.current_time()
        await self._call(FrameType.PING, b"", b"", timeout, {FrameType.PONG})
        return trio.current_time() - start

    async def aclose(self) -> None:
        message = f"connection to {self.info.node!r} at {self.info.address} was closed by this node"
        self._fail(PeerClosed, message)  # wakes pending calls with PeerClosed
        self._failure = (PeerClosed, message)  # and later ones, even if the peer had failed first
        self._transport._peers.discard(self)
        await trio.aclose_forcefully(self._stream)

    # --- machinery ---------------------------------------------------------------------
    async def _accept_chunk(self, key: bytes, reply_key: bytes, data: bytearray, *, named: bool = False) -> bytearray:
        """``data`` if it is chunk ``key`` (``named``: if it hashes to the digest the reply carries);
        else counted, logged and ``IntegrityError``."""
        what = f"chunk {key.hex()[:16]}… from {self.info.node!r} at {self.info.address}"
        try:
            if reply_key != key and not named:
                raise IntegrityError(f"{what}: the reply carries key {reply_key.hex()[:16]}…")
            await verify_chunk(data, reply_key, what, self._transport._hash_limiter)
        except IntegrityError as e:
            self.counters.corrupt_frames += 1
            log.warning("fabric: dropped a corrupt chunk: %s", e)
            raise
        self.counters.chunks_received += 1
        return data

    def _raise(self) -> NoReturn:
        assert self._failure is not None, "raise only once the connection failed"
        cls, message = self._failure
        raise cls(message)

    def _fail(self, cls: type[AiturboError], message: str) -> None:
        """Mark the connection dead (first failure wins) and wake every waiting caller."""
        if self._failure is not None:
            return
        self._failure = (cls, message)
        if cls is PeerBroken:
            log.warning("fabric: %s", message)
        for call in self._calls.values():
            call.error = cls(message)
            call.done.set()
        self._calls.clear()
        self._receive_scope.cancel()  # the receive task closes the stream, unblocking senders

    @contextmanager
    def _edge(self, what: str) -> Iterator[None]:
        """``stream_errors``, plus: once the connection is dead, raise why it died."""
        try:
            with stream_errors(f"{what} {self.info.node!r} at {self.info.address}"):
                yield
        except PeerBroken as e:
            self._fail(PeerBroken, str(e))
            self._raise()

    async def _call(self, ftype: FrameType, key: bytes, body, timeout: float, expected: set[FrameType],
                    call: _Call | None = None, *, keep_on_timeout: bool = False) -> Frame:
        """Send one request and wait for its reply.  ``call`` (optional) lets the caller
        see, even after a cancellation, whether the request went out and was answered.
        ``keep_on_timeout``: see ``Peer.control``."""
        if self._failure is not None:
            self._raise()
        call = call or _Call()
        try:
            with trio.fail_after(timeout):
                async with self._slots:
                    if self._failure is not None:
                        self._raise()
                    request_id = call.request_id = next(self._ids)
                    self._calls[request_id] = call
                    try:
                        await self._send(ftype, request_id, key, body)
                        call.sent = True
                        await call.done.wait()
                    finally:
                        self._calls.pop(request_id, None)
        except trio.TooSlowError:
            what = f"{self.info.node!r} at {self.info.address}: no reply to {ftype.name} within {timeout} s"
            if keep_on_timeout and call.sent and self._failure is None:
                # The frame went out whole (a half-sent one breaks the stream
                # in _send): the stream is sound, the peer is only slow.
                raise PeerSlow(what) from None
            self._fail(PeerBroken, what)
            self._raise()
        if call.error is not None:
            raise call.error
        reply = call.reply
        assert reply is not None  # done was set by _dispatch with the reply, else by _fail with an error
        if reply.type == FrameType.ERROR:
            raise RemoteError(f"{self.info.node!r} at {self.info.address}: {decode_message(reply.body)}")
        if reply.type not in expected:
            self._fail(PeerBroken, f"{self.info.node!r} at {self.info.address} answered {ftype.name} with {reply.type.name}")
            self._raise()
        return reply

    async def _send(self, ftype: FrameType, request_id: int, key: bytes, body) -> None:
        # The send is shielded from outside cancellation, because a half-sent
        # frame would break the stream for every other caller; it is still
        # bounded by the call's own deadline, and missing that breaks the peer.
        deadline = min(trio.current_effective_deadline(), trio.current_time() + FABRIC_SEND_TIMEOUT_S)
        async with self._send_lock:
            if self._failure is not None:
                self._raise()
            with self._edge("send to"):
                with trio.CancelScope(shield=True, deadline=deadline) as scope:
                    sent = await send_frame(self._stream, ftype, request_id, key, body)
                if scope.cancelled_caught:
                    raise trio.TooSlowError
        self.counters.bytes_sent += sent
        self.counters.frames_sent += 1

    async def _receive_loop(self) -> None:
        """Hand each reply to its caller until the connection ends (runs in the transport's nursery)."""
        try:
            with self._receive_scope:
                while True:
                    with self._edge("receive from"):
                        frame = await self._reader.receive()
                    if frame is None:
                        self._fail(PeerBroken, f"{self.info.node!r} at {self.info.address} closed the connection")
                        return
                    self.counters.bytes_received += frame.wire_bytes
                    self.counters.frames_received += 1
                    self._dispatch(frame)
        except (PeerBroken, PeerClosed):
            pass  # recorded by _fail; every caller has been told
        finally:
            self._transport._peers.discard(self)
            await trio.aclose_forcefully(self._stream)

    def _dispatch(self, frame: Frame) -> None:
        who = f"{self.info.node!r} at {self.info.address}"
        if frame.request_id == 0:
            if frame.type == FrameType.ERROR:
                self._fail(PeerBroken, f"{who} dropped the connection: {decode_message(frame.body)}")
            else:
                self._fail(PeerBroken, f"{who} sent {frame.type.name} without a request id")
            self._raise()
        if frame.type not in REPLIES:
            self._fail(PeerBroken, f"{who} sent a {frame.type.name} frame where replies are expected")
            self._raise()
        call = self._calls.pop(frame.request_id, None)
        if call is None:
            return  # its caller was cancelled and left; the late reply is dropped
        call.reply = frame
        call.done.set()
