"""The fabric over TCP: the fallback wherever no RDMA device exists.

Only this module touches trio's TCP API.  Addresses are ``host:port``
strings (``[v6addr]:port`` for IPv6); TCP_NODELAY is set on every connection
because requests are small frames that must not wait for Nagle.
"""

from __future__ import annotations

import socket

import trio

from .._errors import ConfigError
from .._limits import FABRIC_ACCEPT_BACKLOG, FABRIC_IN_FLIGHT_MAX
from ._protocol import StreamTransport
from ._streams import StreamHandler
from ._wire import FrameReader

DEFAULT_PORT = 7387


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` / ``[v6]:port``; ``ConfigError`` if malformed."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"fabric address {address!r}: want host:port")
    return host, int(port)


def _tune(stream: trio.SocketStream) -> None:
    # trio sets TCP_NODELAY on its TCP streams already; say it here too, as
    # the protocol depends on it.
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)


class TcpTransport(StreamTransport):
    """Fabric over TCP; serves on ``host:port`` (port 0: a free port, reported by ``serve``)."""

    kind = "tcp"

    def __init__(self, node: str, secret: bytes, *, host: str = "", port: int = DEFAULT_PORT, in_flight_max: int = FABRIC_IN_FLIGHT_MAX):
        super().__init__(node, secret, in_flight_max=in_flight_max)
        self._host = host or None  # None: every local address
        self._port = port

    def _reader(self, stream: trio.abc.Stream) -> FrameReader:
        if isinstance(stream, trio.SocketStream):
            # Chunk payloads go from the socket straight into their buffer.
            # Errors come as OSError / ClosedResourceError: mapped like the stream's own.
            return FrameReader(stream, receive_into=stream.socket.recv_into)
        return FrameReader(stream)

    async def _open_stream(self, address: str) -> trio.abc.Stream:
        host, port = parse_address(address)
        stream = await trio.open_tcp_stream(host, port)
        _tune(stream)
        return stream

    async def _serve_streams(self, handle: StreamHandler, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self._port, host=self._host, backlog=FABRIC_ACCEPT_BACKLOG)
        host, port = listeners[0].socket.getsockname()[:2]

        async def on_stream(stream: trio.SocketStream) -> None:
            try:
                _tune(stream)
                peer = format_address(*stream.socket.getpeername()[:2])
            except OSError:  # gone before we looked
                await trio.aclose_forcefully(stream)
                return
            await handle(stream, peer)

        task_status.started(format_address(host, port))
        await trio.serve_listeners(on_stream, listeners)
