"""Bodies of the RDMA extension frames: queue-pair endpoints and slot references.

RDMA_CONNECT carries the client's endpoint and the memory it lends for its
own requests (base address, rkey, slot count); RDMA_ACCEPT carries the
server's endpoint and lends nothing; RDMA_PROBE a token the server must read
back; GET_CHUNK_RDMA and PUT_CHUNK_RDMA name one lent slot (and a length);
CHUNK_RDMA says how many bytes were written into it.  Fixed binary layouts
(big-endian), and every field is checked against ``_limits`` on decode, so a
peer's numbers never reach the verbs layer unchecked: ``InvalidArgument``
says which field is wrong.  An endpoint::

    version u8 | mtu u8 | rd_atomic u8 | flags u8 | qpn u32 | psn u32 | lid u16 | reserved u16
    | gid 16 bytes | lent addr u64 | lent rkey u32 | lent slots u32 | slot bytes u32

Nothing here is secret: an rkey only opens the lent slots, and only to a
queue pair that the lending node connected to an authenticated peer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .._errors import InvalidArgument
from .._limits import CHUNK_BYTES, FABRIC_RDMA_READS_MAX, FABRIC_RDMA_SLOTS_MAX
from ._verbs import MTU_BYTES, QpAddress

EXTENSION_VERSION = 1
ENDPOINT = struct.Struct(">BBBBIIHH16sQIII")
ENDPOINT_BYTES = ENDPOINT.size
PROBE_TOKEN_BYTES = 16
_U32 = struct.Struct(">I")
_U32_PAIR = struct.Struct(">II")
SLOT_BYTES = _U32.size  # GET_CHUNK_RDMA body
LENGTH_BYTES = _U32.size  # CHUNK_RDMA body
SLOT_LENGTH_BYTES = _U32_PAIR.size  # PUT_CHUNK_RDMA body
_U24 = 1 << 24


@dataclass(frozen=True)
class LentMemory:
    """Slots of CHUNK_BYTES a client lends to one server, then one probe page."""

    addr: int
    rkey: int
    slots: int

    def slot_addr(self, index: int) -> int:
        assert 0 <= index < self.slots
        return self.addr + index * CHUNK_BYTES

    @property
    def probe_addr(self) -> int:
        return self.addr + self.slots * CHUNK_BYTES


def encode_endpoint(qp: QpAddress, lent: LentMemory | None = None) -> bytes:
    addr, rkey, slots = (lent.addr, lent.rkey, lent.slots) if lent else (0, 0, 0)
    return ENDPOINT.pack(EXTENSION_VERSION, qp.mtu, qp.rd_atomic, 0, qp.qpn, qp.psn, qp.lid, 0, qp.gid,
                         addr, rkey, slots, CHUNK_BYTES if lent else 0)


def _decode(body) -> tuple[QpAddress, LentMemory | None]:
    if len(body) != ENDPOINT_BYTES:
        raise InvalidArgument(f"RDMA endpoint of {len(body)} bytes, expected {ENDPOINT_BYTES}")
    version, mtu, rd_atomic, flags, qpn, psn, lid, reserved, gid, addr, rkey, slots, slot_bytes = ENDPOINT.unpack(bytes(body))
    if version != EXTENSION_VERSION:
        raise InvalidArgument(f"RDMA extension version {version}, this node speaks version {EXTENSION_VERSION}")
    if flags or reserved:
        raise InvalidArgument("RDMA endpoint has reserved bits set")
    if mtu not in MTU_BYTES:
        raise InvalidArgument(f"RDMA endpoint: path MTU code {mtu} is not one of 1..5")
    if not 1 <= rd_atomic <= FABRIC_RDMA_READS_MAX:
        raise InvalidArgument(f"RDMA endpoint: {rd_atomic} READs in flight, want 1..{FABRIC_RDMA_READS_MAX}")
    if not 2 <= qpn < _U24:  # QPs 0 and 1 are the special SMI/GSI queue pairs
        raise InvalidArgument(f"RDMA endpoint: queue pair number {qpn} is not a 24-bit RC queue pair")
    if psn >= _U24:
        raise InvalidArgument(f"RDMA endpoint: packet sequence number {psn} exceeds 24 bits")
    if not any(gid) and not lid:
        raise InvalidArgument("RDMA endpoint has neither a GID nor a LID")
    qp = QpAddress(qpn=qpn, psn=psn, lid=lid, gid=gid, mtu=mtu, rd_atomic=rd_atomic)
    if not (addr or rkey or slots or slot_bytes):
        return qp, None
    if slot_bytes != CHUNK_BYTES:
        raise InvalidArgument(f"RDMA endpoint lends slots of {slot_bytes} bytes; chunks here are {CHUNK_BYTES}")
    if not 1 <= slots <= FABRIC_RDMA_SLOTS_MAX:
        raise InvalidArgument(f"RDMA endpoint lends {slots} slots, want 1..{FABRIC_RDMA_SLOTS_MAX}")
    if addr == 0 or addr + slots * CHUNK_BYTES + PROBE_TOKEN_BYTES > 1 << 64:
        raise InvalidArgument(f"RDMA endpoint lends memory at 0x{addr:x}, which cannot hold {slots} slots")
    return qp, LentMemory(addr=addr, rkey=rkey, slots=slots)


def decode_offer(body) -> tuple[QpAddress, LentMemory]:
    """RDMA_CONNECT: the client's endpoint, which must lend memory."""
    qp, lent = _decode(body)
    if lent is None:
        raise InvalidArgument("RDMA_CONNECT lends no memory")
    return qp, lent


def decode_accept(body) -> QpAddress:
    """RDMA_ACCEPT: the server's endpoint, which must lend nothing."""
    qp, lent = _decode(body)
    if lent is not None:
        raise InvalidArgument("RDMA_ACCEPT lends memory; servers never expose theirs")
    return qp


def encode_slot(index: int) -> bytes:
    return _U32.pack(index)


def decode_slot(body, lent: LentMemory) -> int:
    (index,) = _U32.unpack(bytes(body))
    if index >= lent.slots:
        raise InvalidArgument(f"slot {index} is not one of the {lent.slots} lent")
    return index


def encode_length(length: int) -> bytes:
    return _U32.pack(length)


def decode_length(body) -> int:
    (length,) = _U32.unpack(bytes(body))
    if not 1 <= length <= CHUNK_BYTES:
        raise InvalidArgument(f"chunk length {length} is outside 1..{CHUNK_BYTES}")
    return length


def encode_slot_length(index: int, length: int) -> bytes:
    return _U32_PAIR.pack(index, length)


def decode_slot_length(body, lent: LentMemory) -> tuple[int, int]:
    index, length = _U32_PAIR.unpack(bytes(body))
    return decode_slot(encode_slot(index), lent), decode_length(encode_length(length))
