"""The fabric wire format: length-prefixed, versioned frames on a byte stream.

A frame is a fixed 20-byte header followed by its payload::

    magic "ATFB" | version u8 | type u8 | flags u16 | request id u64 | payload length u32

(big-endian).  Chunk-bearing frames (GET_CHUNK, CHUNK, PUT_CHUNK) start their
payload with the 32-byte BLAKE3 key, then the chunk bytes raw; control bodies
are compact JSON; the handshake bodies are fixed binary layouts.  The magic and
the version byte sit at the same offsets in every version, so a peer of another
version is told so, clearly, instead of being misparsed.

Every length is checked against its frame type's bound (``_limits``) before a
byte of the payload is read or allocated; a frame that breaks a rule raises
``PeerBroken`` with a message saying which.  This module owns the byte layout
only: no authentication, no request bookkeeping, no error mapping of streams.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, overload

import trio

from .._errors import InvalidArgument, PeerBroken
from .._limits import (
    CHUNK_BYTES,
    FABRIC_CONTROL_BYTES_MAX,
    FABRIC_FRAME_BYTES_MAX,
    FABRIC_MESSAGE_BYTES_MAX,
    FABRIC_NODE_NAME_BYTES_MAX,
    FABRIC_RECEIVE_BYTES,
    HASH_BYTES,
    KiB,
)
from ._rdma_wire import ENDPOINT_BYTES, LENGTH_BYTES, PROBE_TOKEN_BYTES, SLOT_BYTES, SLOT_LENGTH_BYTES

MAGIC = b"ATFB"
VERSION = 1
HEADER = struct.Struct(">4sBBHQI")
HEADER_BYTES = HEADER.size
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
_COALESCE_BYTES_MAX = 64 * KiB  # smaller payloads go out in one send with their header


class FrameType(enum.IntEnum):
    # authentication (request id 0)
    HELLO = 0x01  # client: nonce, node name
    CHALLENGE = 0x02  # server: nonce, node name
    RESPONSE = 0x03  # client: its MAC
    OK = 0x04  # server: its MAC
    # chunks
    GET_CHUNK = 0x10  # key
    CHUNK = 0x11  # key, data
    NOT_FOUND = 0x12  # (empty)
    PUT_CHUNK = 0x13  # key, data
    ACK = 0x14  # (empty)
    REJECTED = 0x15  # reason (UTF-8)
    # control plane messages carried for the layers above
    CONTROL = 0x20  # JSON object
    CONTROL_REPLY = 0x21  # JSON object
    # liveness
    PING = 0x30
    PONG = 0x31
    # a request failed (request id > 0) or the connection is being dropped (request id 0)
    ERROR = 0x3F  # message (UTF-8)
    # 0x80-0xFF: transport extensions, after authentication only (bodies: ``_rdma_wire``).
    # A server without RDMA answers RDMA_CONNECT with ERROR; the others need a set-up queue pair.
    RDMA_CONNECT = 0x80  # client: its queue-pair endpoint and the memory it lends
    RDMA_ACCEPT = 0x81  # server: its queue-pair endpoint
    RDMA_PROBE = 0x82  # client: a token the server RDMA-reads back from the lent probe page (reply ACK)
    GET_CHUNK_RDMA = 0x83  # key, slot: write the chunk into that lent slot
    CHUNK_RDMA = 0x84  # key, length: written (a small chunk comes back as a plain CHUNK instead)
    PUT_CHUNK_RDMA = 0x85  # key, slot, length: read the chunk from that lent slot


KEYED = frozenset(
    {FrameType.GET_CHUNK, FrameType.CHUNK, FrameType.PUT_CHUNK, FrameType.GET_CHUNK_RDMA, FrameType.CHUNK_RDMA, FrameType.PUT_CHUNK_RDMA}
)
EXTENSIONS = frozenset({FrameType.RDMA_CONNECT, FrameType.RDMA_PROBE, FrameType.GET_CHUNK_RDMA, FrameType.PUT_CHUNK_RDMA})
REQUESTS = frozenset({FrameType.GET_CHUNK, FrameType.PUT_CHUNK, FrameType.CONTROL, FrameType.PING}) | EXTENSIONS
REPLIES = frozenset(
    {
        FrameType.CHUNK,
        FrameType.NOT_FOUND,
        FrameType.ACK,
        FrameType.REJECTED,
        FrameType.CONTROL_REPLY,
        FrameType.PONG,
        FrameType.ERROR,
        FrameType.RDMA_ACCEPT,
        FrameType.CHUNK_RDMA,
    }
)

# type -> (payload bytes min, payload bytes max), key included
_HELLO_BOUNDS = (NONCE_BYTES + 1, NONCE_BYTES + FABRIC_NODE_NAME_BYTES_MAX)
_BOUNDS = {
    FrameType.HELLO: _HELLO_BOUNDS,
    FrameType.CHALLENGE: _HELLO_BOUNDS,
    FrameType.RESPONSE: (MAC_BYTES, MAC_BYTES),
    FrameType.OK: (MAC_BYTES, MAC_BYTES),
    FrameType.GET_CHUNK: (HASH_BYTES, HASH_BYTES),
    FrameType.CHUNK: (HASH_BYTES, HASH_BYTES + CHUNK_BYTES),
    FrameType.NOT_FOUND: (0, 0),
    FrameType.PUT_CHUNK: (HASH_BYTES, HASH_BYTES + CHUNK_BYTES),
    FrameType.ACK: (0, 0),
    FrameType.REJECTED: (0, FABRIC_MESSAGE_BYTES_MAX),
    FrameType.CONTROL: (2, FABRIC_CONTROL_BYTES_MAX),  # at least "{}"
    FrameType.CONTROL_REPLY: (2, FABRIC_CONTROL_BYTES_MAX),
    FrameType.PING: (0, 0),
    FrameType.PONG: (0, 0),
    FrameType.ERROR: (0, FABRIC_MESSAGE_BYTES_MAX),
    FrameType.RDMA_CONNECT: (ENDPOINT_BYTES, ENDPOINT_BYTES),
    FrameType.RDMA_ACCEPT: (ENDPOINT_BYTES, ENDPOINT_BYTES),
    FrameType.RDMA_PROBE: (PROBE_TOKEN_BYTES, PROBE_TOKEN_BYTES),
    FrameType.GET_CHUNK_RDMA: (HASH_BYTES + SLOT_BYTES, HASH_BYTES + SLOT_BYTES),
    FrameType.CHUNK_RDMA: (HASH_BYTES + LENGTH_BYTES, HASH_BYTES + LENGTH_BYTES),
    FrameType.PUT_CHUNK_RDMA: (HASH_BYTES + SLOT_LENGTH_BYTES, HASH_BYTES + SLOT_LENGTH_BYTES),
}
assert set(_BOUNDS) == set(FrameType)
assert max(hi for _, hi in _BOUNDS.values()) <= FABRIC_FRAME_BYTES_MAX


@dataclass(slots=True)
class Frame:
    type: FrameType
    request_id: int
    key: bytes  # the chunk key of KEYED frames, else b""
    body: bytearray  # everything after the key

    @property
    def wire_bytes(self) -> int:
        return HEADER_BYTES + len(self.key) + len(self.body)


def parse_header(header) -> tuple[FrameType, int, int]:
    """``(type, request id, payload length)`` of a 20-byte header, every field checked."""
    magic, version, type_, flags, request_id, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise PeerBroken(f"not an aiturbofs fabric peer (frame starts with {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise PeerBroken(f"fabric protocol version mismatch: peer speaks version {version}, this node speaks version {VERSION}")
    try:
        ftype = FrameType(type_)
    except ValueError:
        raise PeerBroken(f"unknown frame type 0x{type_:02x}") from None
    if flags:
        raise PeerBroken(f"{ftype.name} frame has reserved flags 0x{flags:04x} set")
    lo, hi = _BOUNDS[ftype]
    if not lo <= length <= hi:
        raise PeerBroken(f"{ftype.name} frame payload of {length} bytes is outside its bounds [{lo}, {hi}]")
    return ftype, request_id, length


def encode_header(ftype: FrameType, request_id: int, length: int) -> bytes:
    lo, hi = _BOUNDS[ftype]
    assert lo <= length <= hi, f"outgoing {ftype.name} frame of {length} bytes breaks [{lo}, {hi}]"
    return HEADER.pack(MAGIC, VERSION, ftype, 0, request_id, length)


async def send_frame(stream: trio.abc.SendStream, ftype: FrameType, request_id: int, key: bytes = b"", body=b"") -> int:
    """Write one frame; returns its size on the wire.

    Like ``send_all``, a cancelled send may have written part of the frame:
    the stream must then be closed.  Stream errors propagate unmapped.
    """
    assert (len(key) == HASH_BYTES) if ftype in KEYED else not key, f"{ftype.name}: bad key"
    length = len(key) + len(body)
    head = encode_header(ftype, request_id, length) + key
    if len(body) <= _COALESCE_BYTES_MAX:
        await stream.send_all(head + bytes(body))
    else:  # a chunk goes out from its own buffer, uncopied
        await stream.send_all(head)
        await stream.send_all(body)
    return HEADER_BYTES + length


class FrameReader:
    """Reads whole frames from a stream, checking each header before its payload."""

    def __init__(self, stream: trio.abc.ReceiveStream, receive_into: Callable[[memoryview], Awaitable[int]] | None = None):
        """``receive_into(buffer) -> count`` (optional) lets chunk payloads land in their
        final buffer straight from the socket, saving a copy; it must read from ``stream``."""
        self._stream = stream
        self._receive_into = receive_into
        self._pending: bytes | bytearray = b""  # bytes received beyond the last frame read
        self._pos = 0

    async def receive(self) -> Frame | None:
        """The next frame, or None if the peer closed the stream between frames.

        Raises ``PeerBroken`` for a malformed frame or a stream that ends inside
        one; the stream's own errors propagate unmapped.
        """
        header = await self._read(HEADER_BYTES, at_frame_start=True)
        if header is None:
            return None
        ftype, request_id, length = parse_header(header)
        key = b""
        if ftype in KEYED:
            key = bytes(await self._read(HASH_BYTES))
            length -= HASH_BYTES
        return Frame(ftype, request_id, key, await self._read(length))

    @overload
    async def _read(self, n: int, *, at_frame_start: Literal[False] = ...) -> bytearray: ...
    @overload
    async def _read(self, n: int, *, at_frame_start: bool) -> bytearray | None: ...

    async def _read(self, n: int, *, at_frame_start: bool = False) -> bytearray | None:
        """``n`` bytes; ``None`` only ``at_frame_start``, if the stream ended cleanly there."""
        if n > FABRIC_RECEIVE_BYTES and self._receive_into is not None:
            return await self._read_into(n)
        out = bytearray()
        while True:
            take = min(len(self._pending) - self._pos, n - len(out))
            if take:
                out += memoryview(self._pending)[self._pos : self._pos + take]
                self._pos += take
            if len(out) == n:
                return out
            # Never more than FABRIC_RECEIVE_BYTES per receive: a hostile length
            # cannot make us allocate more than that ahead of the data itself.
            data = await self._stream.receive_some(FABRIC_RECEIVE_BYTES)
            if not data:
                if at_frame_start and not out:
                    return None
                raise PeerBroken(f"connection closed in the middle of a frame ({len(out)} of {n} bytes read)")
            self._pending, self._pos = data, 0

    async def _read_into(self, n: int) -> bytearray:
        assert self._receive_into is not None  # _read calls this only with a receive_into
        out = bytearray(n)  # n is within its frame type's bound: checked by parse_header
        with memoryview(out) as view:
            filled = min(len(self._pending) - self._pos, n)
            view[:filled] = memoryview(self._pending)[self._pos : self._pos + filled]
            self._pos += filled
            while filled < n:
                count = await self._receive_into(view[filled:])
                if not count:
                    raise PeerBroken(f"connection closed in the middle of a frame ({filled} of {n} bytes read)")
                filled += count
        return out


# --- bodies -------------------------------------------------------------------------


def encode_hello(nonce: bytes, node: str) -> bytes:
    """HELLO / CHALLENGE body: a fresh nonce and the sender's node name."""
    assert len(nonce) == NONCE_BYTES
    return nonce + check_node_name(node)


def decode_hello(body: bytes | bytearray) -> tuple[bytes, str]:
    nonce, name = bytes(body[:NONCE_BYTES]), bytes(body[NONCE_BYTES:])
    try:
        return nonce, name.decode("utf-8")
    except UnicodeDecodeError:
        raise PeerBroken(f"node name {name[:32]!r} is not UTF-8") from None


def check_node_name(node: str) -> bytes:
    raw = node.encode("utf-8")
    if not 1 <= len(raw) <= FABRIC_NODE_NAME_BYTES_MAX:
        raise InvalidArgument(f"fabric node name {node!r}: want 1 to {FABRIC_NODE_NAME_BYTES_MAX} UTF-8 bytes")
    return raw


def encode_json(obj: dict) -> bytes:
    """A control body; ``InvalidArgument`` if it is not a JSON object or too big."""
    if not isinstance(obj, dict):
        raise InvalidArgument(f"a fabric control body must be a dict, not {type(obj).__name__}")
    try:
        raw = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"fabric control body is not JSON: {e}") from e
    if len(raw) > FABRIC_CONTROL_BYTES_MAX:
        raise InvalidArgument(f"fabric control body of {len(raw)} bytes exceeds {FABRIC_CONTROL_BYTES_MAX}")
    return raw


def decode_json(body) -> dict:
    """A received control body; ``ValueError`` unless it is a JSON object."""
    obj = json.loads(bytes(body).decode("utf-8"))
    if not isinstance(obj, dict):
        raise ValueError(f"a control body must be a JSON object, not {type(obj).__name__}")
    return obj


def encode_message(message: str) -> bytes:
    """An ERROR / REJECTED reason, cut to its bound on a character boundary."""
    raw = message.encode("utf-8")[:FABRIC_MESSAGE_BYTES_MAX]
    return raw.decode("utf-8", "ignore").encode("utf-8")


def decode_message(body) -> str:
    return bytes(body).decode("utf-8", "replace")
