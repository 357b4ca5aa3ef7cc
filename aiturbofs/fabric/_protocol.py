"""The fabric protocol over any ``trio.abc.Stream``: what TCP and memory share.

``StreamTransport`` authenticates every connection (``_auth``), then hands
it to a ``StreamPeer`` (``_client``: we ask) or a ``ServerSession``
(``_server``: we answer).  Chunks are verified against their BLAKE3 keys on
receipt, on both sides.  Subclasses supply how raw streams are made:
``_open_stream(address)`` and ``_serve_streams``; one that extends the
protocol (RDMA) also names its own ``_peer_class`` and ``_session_class``.
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import AsyncExitStack

import trio

from .._errors import AuthFailed, PeerBroken, PeerClosed
from .._limits import (
    FABRIC_CONNECT_TIMEOUT_S,
    FABRIC_CONNECTIONS_MAX,
    FABRIC_HANDSHAKE_TIMEOUT_S,
    FABRIC_HASH_THREADS_MAX,
    FABRIC_IN_FLIGHT_MAX,
)
from .._nursery import open_nursery
from ._auth import client_handshake, server_handshake
from ._base import ChunkHandler, Peer, PeerInfo, Transport
from ._client import StreamPeer
from ._server import ServerSession
from ._streams import StreamHandler, log, send_error, stream_errors
from ._wire import FrameReader


class StreamTransport(Transport):
    """A transport whose connections are trio byte streams."""

    _peer_class = StreamPeer  # what ``connect`` returns (a subclass may extend the protocol...)
    _session_class = ServerSession  # ...and what answers a served connection

    def __init__(self, node: str, secret: bytes, *, in_flight_max: int = FABRIC_IN_FLIGHT_MAX):
        super().__init__(node, secret, in_flight_max=in_flight_max)
        self._hash_limiter = trio.CapacityLimiter(FABRIC_HASH_THREADS_MAX)
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._peers: set[StreamPeer] = set()
        self._connections = 0  # served connections, authenticated or not

    # --- what a subclass supplies --------------------------------------------------
    @abstractmethod
    async def _open_stream(self, address: str) -> trio.abc.Stream:
        """A raw byte stream to ``address`` (foreign errors allowed; the caller maps and bounds them)."""

    @abstractmethod
    async def _serve_streams(self, handle: StreamHandler, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept raw streams on a fresh address: ``task_status.started(address)``, then
        ``handle(stream, peer_address)`` for each, concurrently, until cancelled."""

    def _reader(self, stream: trio.abc.Stream) -> FrameReader:
        """How frames are read from ``stream`` (a subclass may add a zero-copy path)."""
        return FrameReader(stream)

    # --- lifetime ----------------------------------------------------------------------
    async def __aenter__(self) -> StreamTransport:
        assert self._stack is None, "a transport is entered once"
        self._stack = AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(open_nursery())
        return self

    async def __aexit__(self, *exc) -> bool | None:
        assert self._stack is not None, "__aexit__ without __aenter__"
        await self.aclose()
        return await self._stack.__aexit__(*exc)

    async def aclose(self) -> None:
        for peer in list(self._peers):
            await peer.aclose()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # --- client side --------------------------------------------------------------------
    async def connect(self, address: str) -> Peer:
        if self._nursery is None or self._nursery.cancel_scope.cancel_called:
            raise PeerClosed(f"fabric transport of {self.node!r} is not open (use it as `async with`)")
        with stream_errors(f"connect to {address}"), trio.fail_after(FABRIC_CONNECT_TIMEOUT_S):
            stream = await self._open_stream(address)
        try:
            reader = self._reader(stream)
            with stream_errors(f"handshake with {address}"), trio.fail_after(FABRIC_HANDSHAKE_TIMEOUT_S):
                node = await client_handshake(stream, reader, self.node, self._secret, address)
        except AuthFailed as e:
            log.warning("fabric: authentication failed: %s", e)
            await trio.aclose_forcefully(stream)
            raise
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        peer = self._peer_class(self, stream, reader, PeerInfo(node, address), self._counters_for(node))
        self._peers.add(peer)
        self._nursery.start_soon(peer._receive_loop)
        log.debug("fabric: connected to %r at %s", node, address)
        return peer

    # --- server side ----------------------------------------------------------------------
    async def serve(self, handler: ChunkHandler, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async def handle(stream: trio.abc.Stream, address: str) -> None:
            await self._serve_connection(handler, stream, address)

        async with open_nursery() as nursery:
            address = await nursery.start(self._serve_streams, handle)
            log.info("fabric: %s transport of node %r serving on %s", self.kind, self.node, address)
            task_status.started(address)

    async def _serve_connection(self, handler: ChunkHandler, stream: trio.abc.Stream, address: str) -> None:
        if self._connections >= FABRIC_CONNECTIONS_MAX:
            log.warning("fabric: refused %s: already serving %d connections", address, self._connections)
            await trio.aclose_forcefully(stream)
            return
        self._connections += 1
        try:
            reader = self._reader(stream)
            try:
                with stream_errors(f"handshake with {address}"), trio.fail_after(FABRIC_HANDSHAKE_TIMEOUT_S):
                    node = await server_handshake(stream, reader, self.node, self._secret, address)
            except AuthFailed as e:
                log.warning("fabric: rejected a connection: %s", e)
                await send_error(stream, "authentication failed")
                return
            except PeerBroken as e:
                log.warning("fabric: dropped %s during the handshake: %s", address, e)
                await send_error(stream, str(e))
                return
            info = PeerInfo(node, address)
            await self._session_class(self, stream, reader, info, handler, self._counters_for(node)).run()
        finally:
            self._connections -= 1
            await trio.aclose_forcefully(stream)
