"""The fabric interface: a ``Transport`` connects to and serves ``Peer``s.

A transport moves chunks and small control messages between authenticated
nodes.  Implementations (TCP, RDMA, in-memory for tests) differ only in
how they reach a peer; every one passes the same conformance tests.

Error contract of every ``Peer`` call:
- ``PeerBroken``: the peer failed — connection lost, a malformed frame, or
  no answer within the call's ``timeout``.  A timeout is failure detection,
  not cancellation: it breaks the connection, and every pending and later
  call on this peer raises ``PeerBroken`` too.  (To abandon one call without
  judging the peer, cancel it with your own cancel scope instead.)
- ``PeerClosed``: this node closed the peer (``aclose``), before or during the call.
- ``IntegrityError``: a received chunk does not match its key; the bytes are
  dropped, counted in ``counters.corrupt_frames``, the connection stays up.
- ``RemoteError``: the peer's handler refused this one request.
- ``InvalidArgument``: a control body that is not a JSON object or too big.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Protocol

import trio

from .._limits import FABRIC_CALL_TIMEOUT_S, FABRIC_IN_FLIGHT_MAX, FABRIC_PING_TIMEOUT_S
from ._auth import check_secret
from ._wire import check_node_name


@dataclass(frozen=True)
class PeerInfo:
    """Who is at the other end: its authenticated node name, and its address (for logs)."""

    node: str
    address: str


@dataclass
class PeerCounters:
    """Traffic with one remote node, both directions and all its connections (for metrics)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    chunks_sent: int = 0
    chunks_received: int = 0  # verified chunks only
    corrupt_frames: int = 0  # chunks that failed their BLAKE3 check
    rdma_bytes: int = 0  # payload bytes (both ways, counted above too) that moved over an RDMA queue pair


@dataclass(frozen=True)
class Named:
    """A named chunk's bytes and the BLAKE3 digest they hash to.

    Chunks of objects imported without a manifest are asked for by a name
    (a digest of the object's identity), not by their content's hash; the
    node that has one answers with its digest, which travels in the reply's
    key so the receiver verifies the bytes (``Peer.get_named_chunk``).
    """

    digest: bytes
    data: bytes | bytearray | memoryview


class ChunkHandler(Protocol):
    """What ``Transport.serve`` calls for the requests of authenticated peers.

    Calls for one connection run concurrently, at most ``in_flight_max`` at
    once.  An ``AiturboError`` raised here is sent back to the caller as a
    ``RemoteError``; any other exception is a bug, logged with its traceback
    and also answered as a ``RemoteError``: it fails that request, never the
    connection or ``serve``.
    """

    async def get_chunk(self, peer: PeerInfo, key: bytes) -> bytes | bytearray | memoryview | Named | None:
        """The chunk's bytes (at most CHUNK_BYTES), or None if this node does not have it.

        ``key`` may be a chunk's name (see ``Named``): then answer ``Named``
        with the digest of the bytes.  The bytes are sent after this returns, so a buffer returned here must
        not be changed or recycled afterwards (return ``bytes`` when in doubt).
        """

    async def put_chunk(self, peer: PeerInfo, key: bytes, data: bytearray) -> bool:
        """Take a chunk (already verified against ``key``); False refuses it."""

    async def control(self, peer: PeerInfo, body: dict) -> dict:
        """Answer a control message (JSON objects both ways)."""


class Peer(ABC):
    """One authenticated connection to a remote node; requests are multiplexed over it."""

    info: PeerInfo
    counters: PeerCounters

    @abstractmethod
    async def get_chunk(self, key: bytes, *, timeout: float = FABRIC_CALL_TIMEOUT_S) -> bytearray | None:
        """The verified bytes of chunk ``key``, or None if the peer does not have it."""

    @abstractmethod
    async def get_named_chunk(self, name: bytes, *, timeout: float = FABRIC_CALL_TIMEOUT_S) -> tuple[bytes, bytearray] | None:
        """``(digest, bytes)`` of the chunk named ``name`` (see ``Named``), verified against the digest the
        peer sent with them, or None if the peer does not have it."""

    @abstractmethod
    async def put_chunk(self, key: bytes, data, *, timeout: float = FABRIC_CALL_TIMEOUT_S) -> bool:
        """Store a chunk on the peer: True if it took it, False if it refused or it arrived corrupt."""

    @abstractmethod
    async def control(self, body: dict, *, timeout: float = FABRIC_CALL_TIMEOUT_S, keep_on_timeout: bool = False) -> dict:
        """Send a control message to the peer's handler; returns its answer.

        No answer within ``timeout`` breaks the connection (``PeerBroken``: a
        hung peer), unless ``keep_on_timeout``: then, once the request is out,
        only this call fails (``PeerSlow``), for work that is slow on the peer
        while the link is fine.
        """

    @abstractmethod
    async def ping(self, *, timeout: float = FABRIC_PING_TIMEOUT_S) -> float:
        """Round-trip time in seconds."""

    @property
    @abstractmethod
    def state(self) -> str:
        """``"open"``, ``"broken"`` (the peer failed) or ``"closed"`` (we closed it)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close the connection; pending and later calls raise ``PeerClosed``.  Idempotent."""

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class Transport(ABC):
    """Reaches peers and serves them; use as ``async with`` (it owns the connections' tasks)."""

    kind: str  # "tcp", "memory", "rdma": logged when the node starts

    def __init__(self, node: str, secret: bytes, *, in_flight_max: int = FABRIC_IN_FLIGHT_MAX):
        check_node_name(node)
        check_secret(secret)
        assert in_flight_max >= 1
        self.node = node
        self._secret = secret
        self.in_flight_max = in_flight_max
        self._counters: dict[str, PeerCounters] = {}

    @abstractmethod
    async def serve(self, handler: ChunkHandler, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept and authenticate peers and answer their requests with ``handler``.

        Calls ``task_status.started(address)`` once peers can connect to
        ``address``; runs until cancelled.  A peer that fails authentication
        or breaks the protocol is logged and dropped, never seen by ``handler``.
        """

    @abstractmethod
    async def connect(self, address: str) -> Peer:
        """An authenticated connection to the node serving at ``address``.

        ``PeerBroken`` if it cannot be reached in time or breaks the protocol;
        ``AuthFailed`` if either side fails the cluster-secret proof.
        """

    @abstractmethod
    async def aclose(self) -> None:
        """Close every peer this transport connected (they raise ``PeerClosed``)."""

    @abstractmethod
    async def __aenter__(self) -> Transport:
        """Start the tasks the transport's connections run in; returns the transport."""

    @abstractmethod
    async def __aexit__(self, *exc) -> bool | None:
        """Close the transport (``aclose``) and end those tasks."""

    def counters(self) -> dict[str, PeerCounters]:
        """A snapshot of the traffic counters, by remote node name."""
        return {node: replace(c) for node, c in self._counters.items()}

    def _counters_for(self, node: str) -> PeerCounters:
        return self._counters.setdefault(node, PeerCounters())
