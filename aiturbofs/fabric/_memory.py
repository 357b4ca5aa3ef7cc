"""The fabric inside one process, for tests: no sockets, same protocol.

A ``MemoryNetwork`` is the switchboard: ``serve`` registers a fresh address
(``mem-1``, ``mem-2``, ...) on it, and ``connect`` hands the server one end of
a ``trio.testing.memory_stream_pair``.  Everything above the byte stream —
framing, authentication, multiplexing, verification — is the shared code of
``_protocol``, so what passes here differs from TCP only in how bytes move.
"""

from __future__ import annotations

import itertools

import trio
import trio.testing

from .._errors import PeerBroken
from .._limits import FABRIC_ACCEPT_BACKLOG, FABRIC_IN_FLIGHT_MAX
from .._nursery import open_nursery
from ._protocol import StreamTransport
from ._streams import StreamHandler


class MemoryNetwork:
    """Connects the ``MemoryTransport``s of one test by address."""

    def __init__(self) -> None:
        self._listeners: dict[str, trio.MemorySendChannel] = {}
        self._ids = itertools.count(1)

    def _listen(self) -> tuple[str, trio.MemoryReceiveChannel]:
        address = f"mem-{next(self._ids)}"
        send, receive = trio.open_memory_channel(FABRIC_ACCEPT_BACKLOG)
        self._listeners[address] = send
        return address, receive

    def _unlisten(self, address: str) -> None:
        listener = self._listeners.pop(address, None)
        if listener is not None:
            listener.close()

    async def _dial(self, address: str, client: str) -> trio.abc.Stream:
        listener = self._listeners.get(address)
        if listener is None:
            raise PeerBroken(f"connect to {address}: no one serves there (connection refused)")
        near, far = trio.testing.memory_stream_pair()
        try:
            await listener.send((far, client))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerBroken(f"connect to {address}: connection refused") from None
        return near


class MemoryTransport(StreamTransport):
    kind = "memory"

    def __init__(self, network: MemoryNetwork, node: str, secret: bytes, *, in_flight_max: int = FABRIC_IN_FLIGHT_MAX):
        super().__init__(node, secret, in_flight_max=in_flight_max)
        self._network = network
        self._dials = itertools.count(1)

    async def _open_stream(self, address: str) -> trio.abc.Stream:
        return await self._network._dial(address, f"{self.node}#{next(self._dials)}")

    async def _serve_streams(self, handle: StreamHandler, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        address, incoming = self._network._listen()
        try:
            async with open_nursery() as nursery:
                task_status.started(address)
                async for stream, client in incoming:
                    nursery.start_soon(handle, stream, client)
        finally:
            self._network._unlisten(address)
            # Hang up on dials that were queued but never served, like a closed listen socket.
            while True:
                try:
                    stream, _ = incoming.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                await trio.aclose_forcefully(stream)
            incoming.close()
