"""The fabric: wire format, cluster-secret auth, and the transport conformance suite.

``TransportConformance`` is what every transport must pass; ``TestTransports``
runs it once per entry of ``TRANSPORTS`` by supplying only the
``make_transport`` fixture: TCP, memory, RDMA over the in-process loopback
verbs (both completion modes), RDMA meeting TCP in either role (per-peer
fallback), and RDMA on a real device when there is one (see docs/rdma.md).
Byte-level attacks (unauthenticated frames, oversized lengths, other versions,
tampering) use the transports' raw stream seam (``_open_stream`` /
``_serve_streams``), so they run on every transport too.  The RDMA-specific
parts (set-up, fallback, slot bookkeeping, work-request failures, transport
choice) follow the suite.
"""

import logging
import os
import struct
import sys
import tracemalloc
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from aiturbofs import chunk
from aiturbofs._errors import (
    AuthFailed,
    ConfigError,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PeerBroken,
    PeerClosed,
    PeerSlow,
    RemoteError,
)
from aiturbofs._limits import (
    CHUNK_BYTES,
    FABRIC_CONTROL_BYTES_MAX,
    FABRIC_FRAME_BYTES_MAX,
    FABRIC_IN_FLIGHT_MAX,
    FABRIC_RDMA_PAYLOAD_BYTES_MIN,
    FABRIC_RDMA_READS_MAX,
    FABRIC_RDMA_SLOTS_MAX,
)
from aiturbofs.fabric import (
    LoopbackDevice,
    MemoryNetwork,
    MemoryTransport,
    Named,
    RdmaTransport,
    TcpTransport,
    _loopverbs,
    _pyverbs,
    _rdma_client,
    _select,
    _slots,
    load_secret,
    open_transport,
    rdma_devices,
)
from aiturbofs.fabric._pyverbs import probe as probe_rdma
from aiturbofs.fabric._rdma_wire import (
    ENDPOINT,
    ENDPOINT_BYTES,
    LentMemory,
    decode_accept,
    decode_length,
    decode_offer,
    decode_slot,
    decode_slot_length,
    encode_endpoint,
    encode_length,
    encode_slot,
    encode_slot_length,
)
from aiturbofs.fabric._slots import SlotPool
from aiturbofs.fabric._verbs import Op, QpAddress, Region, VerbsError
from aiturbofs.fabric._wire import HEADER, MAGIC, VERSION, FrameReader, FrameType, encode_hello, send_frame

SECRET = b"correct horse battery staple 42!"
WRONG = b"incorrect horse battery staple 0"
TEST_TIMEOUT_S = 15

pytestmark = pytest.mark.fail_after(TEST_TIMEOUT_S)


def keyed(data: bytes) -> tuple[bytes, bytes]:
    return chunk.digest(data), data


class Store:
    """A ChunkHandler that records what it was asked."""

    def __init__(self, *, delay_s: float = 0.0, hang: bool = False):
        self.chunks: dict[bytes, bytes] = {}
        self.named: dict[bytes, Named] = {}  # chunks asked for by a name (an imported object's), with their digest
        self.delay_s = delay_s
        self.hang = hang
        self.calls = 0
        self.puts = 0
        self.active = 0
        self.active_max = 0
        self.entered = trio.Event()

    async def get_chunk(self, peer, key):
        self.calls += 1
        self.active += 1
        self.active_max = max(self.active_max, self.active)
        try:
            await trio.sleep(self.delay_s)
            if self.hang:
                self.entered.set()
                await trio.sleep_forever()
            return self.named[key] if key in self.named else self.chunks.get(key)
        finally:
            self.active -= 1

    async def put_chunk(self, peer, key, data):
        self.calls += 1
        self.puts += 1
        assert chunk.digest(data) == key
        self.chunks[key] = bytes(data)
        return len(data) != 7  # a size this node "refuses", to test REJECTED

    async def control(self, peer, body):
        self.calls += 1
        if body.get("op") == "missing":
            raise NotFound("no such thing")
        if body.get("op") == "crash":  # a handler's bug or a race (a spill file gone mid-read)
            raise FileNotFoundError(2, "No such file or directory", "spill/ab12")
        if body.get("op") == "slow":  # an upload to a slow backend on the peer's side
            await trio.sleep(body["s"])
        return {"echo": body, "from": peer.node}


def header(ftype: int, length: int, *, version: int = VERSION, request_id: int = 0, magic: bytes = MAGIC) -> bytes:
    return HEADER.pack(magic, version, ftype, 0, request_id, length)


async def read_all_frames(stream, reader: FrameReader | None = None) -> list:
    """Frames until the peer hangs up (a reader error ends the list too); then closes ``stream``."""
    reader, frames = reader or FrameReader(stream), []
    async with stream:
        with trio.fail_after(5):
            try:
                while (frame := await reader.receive()) is not None:
                    frames.append(frame)
            except (PeerBroken, trio.BrokenResourceError):
                pass
    return frames


class TransportConformance:
    """Every fabric transport passes these; subclasses supply ``make_transport`` only.

    ``make_transport(node, secret, **kw)`` returns an unopened Transport whose
    ``serve`` listens on a fresh address reachable by the others of the test.
    """

    @asynccontextmanager
    async def serving(self, make, handler, *, secret=SECRET, **kw):
        """Serve ``handler``; yields (transport, address, a scope that stops the server alone)."""
        server_scope = trio.CancelScope()

        async def serve(task_status):
            with server_scope:
                await transport.serve(handler, task_status=task_status)

        async with make("server", secret, **kw) as transport, trio.open_nursery() as nursery:
            address = await nursery.start(serve)
            yield transport, address, server_scope
            nursery.cancel_scope.cancel()

    # --- chunks -------------------------------------------------------------------------
    async def test_round_trips(self, make_transport):
        async def main():
            store = Store()
            async with self.serving(make_transport, store) as (server, address, _):
                async with make_transport("client", SECRET) as client:
                    peer = await client.connect(address)
                    assert peer.info.node == "server" and peer.state == "open"
                    chunks = [keyed(os.urandom(n)) for n in (0, 1, CHUNK_BYTES)]
                    for key, data in chunks:
                        assert await peer.put_chunk(key, data) is True
                        assert store.chunks[key] == data
                    for key, data in chunks:
                        got = await peer.get_chunk(key)
                        assert got == data
                    c = peer.counters
                    assert c.chunks_sent == 3 and c.chunks_received == 3 and c.corrupt_frames == 0
                    assert c.bytes_sent > CHUNK_BYTES and c.bytes_received > CHUNK_BYTES
                    # the payloads took the path this pairing should give them
                    assert getattr(peer, "payload_path", None) == make_transport.payload_path
                    assert c.rdma_bytes == (2 * CHUNK_BYTES if make_transport.payload_path == "rdma" else 0)
                    served = server.counters()["client"]
                    assert served.chunks_received == 3 and served.chunks_sent == 3
                    assert served.bytes_received == c.bytes_sent and served.bytes_sent == c.bytes_received
                    await peer.aclose()

        await main()

    async def test_not_found_and_refused(self, make_transport):
        async def main():
            store = Store()
            async with self.serving(make_transport, store) as (_, address, _), make_transport("client", SECRET) as client:
                peer = await client.connect(address)
                assert await peer.get_chunk(chunk.digest(b"never stored")) is None
                key, data = keyed(b"seven!!")
                assert await peer.put_chunk(key, data) is False  # the handler said no
                assert await peer.ping() >= 0

        await main()

    async def test_named_chunks_carry_their_digest(self, make_transport):
        """A chunk asked for by a name comes back with the digest of its bytes, verified on arrival."""
        async def main():
            store = Store()
            small, large = os.urandom(100), os.urandom(CHUNK_BYTES)  # in the frame, and the payload path
            names = [chunk.digest(b"name of " + bytes([i])) for i in range(3)]
            store.named[names[0]] = Named(chunk.digest(small), small)
            store.named[names[1]] = Named(chunk.digest(large), large)
            store.named[names[2]] = Named(chunk.digest(b"other bytes"), large)  # a digest that lies
            async with self.serving(make_transport, store) as (_, address, _), make_transport("client", SECRET) as client:
                peer = await client.connect(address)
                assert await peer.get_named_chunk(names[0]) == (chunk.digest(small), small)
                assert await peer.get_named_chunk(names[1]) == (chunk.digest(large), large)
                with pytest.raises(IntegrityError, match="BLAKE3 mismatch"):
                    await peer.get_named_chunk(names[2])
                with pytest.raises(IntegrityError, match="carries key"):  # asked by content key, answered by name
                    await peer.get_chunk(names[0])
                assert await peer.get_named_chunk(chunk.digest(b"never named")) is None
                assert peer.counters.corrupt_frames == 2 and peer.counters.chunks_received == 2
                assert peer.state == "open"

        await main()

    async def test_a_failing_handler_fails_one_request_not_the_connection(self, make_transport):
        # A foreign exception in a request handler once reached the daemon's
        # root nursery and unmounted it, staged data and all.
        async def main():
            async with self.serving(make_transport, Store()) as (_, address, _), make_transport("client", SECRET) as client:
                peer = await client.connect(address)
                for _ in range(2):
                    with pytest.raises(RemoteError, match="FileNotFoundError"):
                        await peer.control({"op": "crash"})
                assert peer.state == "open"
                assert (await peer.control({"op": "again"}))["echo"] == {"op": "again"}
                assert await peer.ping() >= 0

        await main()

    async def test_a_slow_long_call_fails_alone_and_keeps_the_connection(self, make_transport):
        # D13: one slow upload_part (a slow backend on the peer) timed out and
        # broke the connection every other call of the two nodes shared.
        async def main():
            async with self.serving(make_transport, Store()) as (_, address, _), make_transport("client", SECRET) as client:
                peer = await client.connect(address)
                async with trio.open_nursery() as nursery:
                    others = []

                    async def meanwhile():
                        for _ in range(5):
                            others.append(await peer.ping())
                            await trio.sleep(0.05)

                    nursery.start_soon(meanwhile)
                    with pytest.raises(PeerSlow, match="no reply to CONTROL within 0.5 s"):
                        await peer.control({"op": "slow", "s": 1.5}, timeout=0.5, keep_on_timeout=True)
                assert len(others) == 5 and peer.state == "open"
                await trio.sleep(1.2)  # its late reply arrives and is dropped
                assert (await peer.control({"op": "again"}))["echo"] == {"op": "again"}
                assert peer.state == "open"
                with pytest.raises(PeerBroken):  # without the flag a silent peer is a hung one
                    await peer.control({"op": "slow", "s": 5}, timeout=0.3)
                assert peer.state == "broken"

        await main()

    async def test_control(self, make_transport):
        async def main():
            async with self.serving(make_transport, Store()) as (_, address, _), make_transport("client", SECRET) as client:
                peer = await client.connect(address)
                body = {"op": "qp", "info": {"qpn": 7, "gid": "fe80::1"}, "list": [1, 2.5, None]}
                assert await peer.control(body) == {"echo": body, "from": "client"}
                with pytest.raises(RemoteError, match="no such thing"):
                    await peer.control({"op": "missing"})
                with pytest.raises(InvalidArgument):
                    await peer.control({"blob": "x" * FABRIC_CONTROL_BYTES_MAX})
                with pytest.raises(InvalidArgument):
                    await peer.control({"not json": object()})
                assert peer.state == "open"
                assert (await peer.control({"op": "again"}))["echo"] == {"op": "again"}

        await main()

    async def test_concurrent_requests_are_multiplexed_and_bounded(self, make_transport):
        async def main():
            # Once with the client honouring the bound, once with a client that
            # allows more than the server: the server's own bound must hold.
            for client_max, server_max in ((4, 16), (16, 4)):
                store = Store(delay_s=0.02)
                chunks = [keyed(os.urandom(1000 + i)) for i in range(50)]
                store.chunks.update(chunks)
                async with self.serving(make_transport, store, in_flight_max=server_max) as (_, address, _):
                    async with make_transport("client", SECRET, in_flight_max=client_max) as client:
                        peer = await client.connect(address)
                        results = {}

                        async def get(key, peer=peer, results=results):
                            results[key] = await peer.get_chunk(key)

                        start = trio.current_time()
                        async with trio.open_nursery() as nursery:
                            for key, _ in chunks:
                                nursery.start_soon(get, key)
                        elapsed = trio.current_time() - start
                        assert results == dict(chunks)
                        assert store.active_max == 4, store.active_max  # concurrent, and never more
                        assert elapsed < 50 * 0.02 * 0.75  # really multiplexed: one by one takes 1 s

        await main()

    # --- authentication -----------------------------------------------------------------
    async def test_client_with_wrong_secret_is_rejected(self, make_transport, caplog):
        async def main():
            store = Store()
            async with self.serving(make_transport, store) as (_, address, _), make_transport("intruder", WRONG) as client:
                with pytest.raises(AuthFailed):
                    await client.connect(address)
            assert store.calls == 0

        with caplog.at_level(logging.WARNING, logger="aiturbofs.fabric"):
            await main()
        rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
        assert rejected and "intruder" in rejected[0] and "secret" in rejected[0], caplog.text

    async def test_server_with_wrong_secret_is_rejected(self, make_transport):
        async def main():
            rogue = Store()
            async with self.serving(make_transport, rogue, secret=WRONG) as (_, address, _), make_transport("client", SECRET) as client:
                with pytest.raises(AuthFailed):
                    await client.connect(address)
            assert rogue.calls == 0

        await main()

    async def test_client_checks_the_server_proof(self, make_transport):
        """A server that skips checking us and fakes its own proof gets nothing from us."""
        seen = []

        async def fake_server(stream, _address):
            reader = FrameReader(stream)
            hello = await reader.receive()
            await send_frame(stream, FrameType.CHALLENGE, 0, body=encode_hello(os.urandom(32), "server"))
            await reader.receive()  # RESPONSE: not checked
            await send_frame(stream, FrameType.OK, 0, body=os.urandom(32))
            seen.extend([hello.type] + [f.type for f in await read_all_frames(stream, reader)])

        async def main():
            async with make_transport("client", SECRET) as client, trio.open_nursery() as nursery:
                address = await nursery.start(client._serve_streams, fake_server)
                with pytest.raises(AuthFailed, match="failed to prove"):
                    await client.connect(address)
                await trio.sleep(0.1)
                nursery.cancel_scope.cancel()
            assert seen == [FrameType.HELLO]  # the client hung up: no request ever left it

        await main()

    async def test_unauthenticated_frames_are_never_served(self, make_transport):
        async def main():
            store = Store()
            key, data = keyed(b"injected")
            store.chunks[chunk.digest(b"secret data")] = b"secret data"
            async with self.serving(make_transport, store) as (server, address, _):
                # 1. requests straight away, no handshake
                stream = await server._open_stream(address)
                await send_frame(stream, FrameType.PUT_CHUNK, 1, key, data)
                await send_frame(stream, FrameType.GET_CHUNK, 2, chunk.digest(b"secret data"))
                frames = await read_all_frames(stream)
                assert [f.type for f in frames] == [FrameType.ERROR]
                # 2. a handshake with a forged proof, then requests
                stream = await server._open_stream(address)
                await send_frame(stream, FrameType.HELLO, 0, body=encode_hello(os.urandom(32), "forger"))
                await send_frame(stream, FrameType.RESPONSE, 0, body=os.urandom(32))
                await send_frame(stream, FrameType.PUT_CHUNK, 1, key, data)
                frames = await read_all_frames(stream)
                assert [f.type for f in frames] == [FrameType.CHALLENGE, FrameType.ERROR]
                assert b"authentication failed" in frames[-1].body
            assert store.calls == 0

        await main()

    # --- integrity ----------------------------------------------------------------------
    async def test_corrupt_payload_is_detected_both_ways(self, make_transport, monkeypatch):
        # RDMA payloads bypass the proxy: corrupt those where they land instead.
        monkeypatch.setattr(_slots, "_landed", flipped)

        async def main():
            store = Store()
            small, large = keyed(os.urandom(100)), keyed(os.urandom(2 * 1024 * 1024))  # inline and threaded hashing
            store.chunks.update([small, large])
            async with self.serving(make_transport, store) as (server, address, _), make_transport("client", SECRET) as client:
                async with trio.open_nursery() as nursery:
                    proxy = await nursery.start(tamper_proxy, client, address)
                    peer = await client.connect(proxy)
                    for key, _ in (small, large):
                        with pytest.raises(IntegrityError, match="BLAKE3 mismatch"):
                            await peer.get_chunk(key)
                    assert peer.counters.corrupt_frames == 2 and peer.counters.chunks_received == 0
                    stored_before = dict(store.chunks)
                    for key, data in (keyed(os.urandom(100)), keyed(os.urandom(2 * 1024 * 1024))):
                        assert await peer.put_chunk(key, data) is False
                    assert store.puts == 0 and store.chunks == stored_before
                    assert server.counters()["client"].corrupt_frames == 2
                    assert peer.state == "open"  # corruption is per chunk, the connection survives
                    await peer.ping()
                    nursery.cancel_scope.cancel()

        await main()

    # --- failures -----------------------------------------------------------------------
    async def test_peer_dying_mid_call_breaks_pending_and_later_calls(self, make_transport):
        async def main():
            store = Store(hang=True)
            key = chunk.digest(b"x")
            async with make_transport("client", SECRET) as client:
                async with self.serving(make_transport, store) as (_, address, server_scope):
                    peer = await client.connect(address)
                    outcome = {}

                    async def pending():
                        with pytest.raises(PeerBroken) as info:
                            await peer.get_chunk(key)
                        outcome["error"] = info.value

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(pending)
                        await store.entered.wait()
                        server_scope.cancel()  # the server goes away mid-call
                assert "error" in outcome
                assert peer.state == "broken"
                with pytest.raises(PeerBroken):
                    await peer.ping()
                with pytest.raises(PeerBroken):
                    await peer.put_chunk(*keyed(b"y"))

        await main()

    async def test_calls_after_aclose_raise_peer_closed(self, make_transport):
        async def main():
            store = Store(hang=True)
            async with self.serving(make_transport, store) as (_, address, _), make_transport("client", SECRET) as client:
                peer = await client.connect(address)
                async with trio.open_nursery() as nursery:

                    async def pending():
                        with pytest.raises(PeerClosed):
                            await peer.get_chunk(chunk.digest(b"x"))

                    nursery.start_soon(pending)
                    await store.entered.wait()
                    await peer.aclose()
                assert peer.state == "closed"
                with pytest.raises(PeerClosed):
                    await peer.get_chunk(chunk.digest(b"x"))
                with pytest.raises(PeerClosed):
                    await peer.control({})
                await peer.aclose()  # idempotent

        await main()

    async def test_per_call_timeout(self, make_transport):
        async def main():
            store = Store(hang=True)
            async with self.serving(make_transport, store) as (_, address, _), make_transport("client", SECRET) as client:
                peer = await client.connect(address)
                start = trio.current_time()
                with pytest.raises(PeerBroken, match="no reply"):
                    await peer.get_chunk(chunk.digest(b"x"), timeout=0.3)
                assert 0.3 <= trio.current_time() - start < 1.0
                with pytest.raises(PeerBroken):  # a timeout judged the peer failed
                    await peer.ping()
                with trio.fail_after(2):  # and the server let go of the abandoned request
                    while store.active:
                        await trio.sleep(0.01)

        await main()

    async def test_connect_to_nobody(self, make_transport):
        async def main():
            async with make_transport("server", SECRET) as server, trio.open_nursery() as nursery:
                address = await nursery.start(server.serve, Store())
                nursery.cancel_scope.cancel()
            async with make_transport("client", SECRET) as client:
                with pytest.raises(PeerBroken):
                    await client.connect(address)

        await main()

    # --- malformed frames ---------------------------------------------------------------
    async def test_oversized_length_prefix_is_rejected(self, make_transport):
        async def main():
            store = Store()
            async with self.serving(make_transport, store) as (server, address, _), make_transport("client", SECRET) as client:
                stream = await server._open_stream(address)
                await stream.send_all(header(FrameType.HELLO, 0xFFFFFFFF))
                frames = await read_all_frames(stream)
                assert [f.type for f in frames] == [FrameType.ERROR]
                assert b"outside its bounds" in frames[0].body
                peer = await client.connect(address)  # the server carries on
                await peer.ping()
            assert store.calls == 0

        await main()

    async def test_version_mismatch_is_reported(self, make_transport, caplog):
        async def speaks_v2(stream, _address):
            await FrameReader(stream).receive()  # HELLO
            await stream.send_all(header(FrameType.CHALLENGE, 40, version=VERSION + 1) + bytes(40))
            await read_all_frames(stream)

        async def main():
            async with self.serving(make_transport, Store()) as (server, address, _):
                stream = await server._open_stream(address)
                await stream.send_all(header(FrameType.HELLO, 40, version=VERSION + 1) + bytes(40))
                frames = await read_all_frames(stream)
                assert [f.type for f in frames] == [FrameType.ERROR]
                assert f"peer speaks version {VERSION + 1}, this node speaks version {VERSION}".encode() in frames[0].body
            async with make_transport("client", SECRET) as client, trio.open_nursery() as nursery:
                address = await nursery.start(client._serve_streams, speaks_v2)
                with pytest.raises(PeerBroken, match=f"version mismatch: peer speaks version {VERSION + 1}"):
                    await client.connect(address)
                nursery.cancel_scope.cancel()

        with caplog.at_level(logging.WARNING, logger="aiturbofs.fabric"):
            await main()
        assert "version mismatch" in caplog.text


async def tamper_proxy(transport, target: str, *, task_status=trio.TASK_STATUS_IGNORED):
    """A man in the middle that flips one byte of every chunk payload, both directions."""

    async def pump(src, dst, flip: FrameType, done: trio.CancelScope):
        reader = FrameReader(src)
        try:
            while (frame := await reader.receive()) is not None:
                if frame.type == flip and frame.body:
                    frame.body[len(frame.body) // 2] ^= 0x01
                await send_frame(dst, frame.type, frame.request_id, frame.key, frame.body)
        except (PeerBroken, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.cancel()

    async def handle(down, _address):
        up = await transport._open_stream(target)
        async with down, up, trio.open_nursery() as nursery:
            nursery.start_soon(pump, down, up, FrameType.PUT_CHUNK, nursery.cancel_scope)
            nursery.start_soon(pump, up, down, FrameType.CHUNK, nursery.cancel_scope)

    await transport._serve_streams(handle, task_status=task_status)


def flipped(view) -> bytearray:
    """``_slots._landed`` as a faulty path would deliver: one bit flipped."""
    data = bytearray(view)
    data[len(data) // 2] ^= 0x01
    return data


RDMA_DEVICES, _RDMA_ABSENT = probe_rdma()
if "not installed" in _RDMA_ABSENT:
    RDMA_SKIP = "pyverbs not installed (apt-get install python3-pyverbs; see docs/rdma.md)"
elif "pyverbs" in _RDMA_ABSENT:
    RDMA_SKIP = f"pyverbs not usable: {_RDMA_ABSENT}"
else:
    RDMA_SKIP = "no RDMA device (see docs/rdma.md to run with soft-RoCE)"


def tcp(node, secret, **kw):
    return TcpTransport(node, secret, host="127.0.0.1", port=0, **kw)


def rdma(device_factory):
    def make(node, secret, **kw):
        return RdmaTransport(node, secret, host="127.0.0.1", port=0, device=device_factory(), **kw)

    return make


def factory(kind: str):
    """``make_transport`` for one entry of TRANSPORTS, with the payload path its client should end up on."""
    loopback = rdma(LoopbackDevice)
    if kind == "tcp":
        make, path = tcp, None
    elif kind == "memory":
        network = MemoryNetwork()
        make, path = (lambda node, secret, **kw: MemoryTransport(network, node, secret, **kw)), None
    elif kind == "rdma-loopback":
        make, path = loopback, "rdma"
    elif kind == "rdma-loopback-polled":  # pyverbs without a completion-channel fd (rdma-core 44)
        make, path = rdma(lambda: LoopbackDevice(channel=False)), "rdma"
    elif kind == "rdma-client-tcp-server":
        make, path = (lambda node, secret, **kw: (tcp if node == "server" else loopback)(node, secret, **kw)), "tcp"
    elif kind == "tcp-client-rdma-server":
        make, path = (lambda node, secret, **kw: (loopback if node == "server" else tcp)(node, secret, **kw)), None
    else:
        assert kind == "rdma"
        make, path = rdma(lambda: RDMA_DEVICES[0]), "rdma"

    def make_transport(node, secret, **kw):
        return make(node, secret, **kw)

    make_transport.payload_path = path
    return make_transport


TRANSPORTS = [
    "tcp",
    "memory",
    "rdma-loopback",
    "rdma-loopback-polled",
    "rdma-client-tcp-server",
    "tcp-client-rdma-server",
    pytest.param("rdma", marks=pytest.mark.skipif(not RDMA_DEVICES, reason=RDMA_SKIP)),
]


class TestTransports(TransportConformance):
    @pytest.fixture(params=TRANSPORTS)
    def make_transport(self, request):
        return factory(request.param)


# --- the wire format alone ----------------------------------------------------------------


async def _reader_of(raw: bytes) -> FrameReader:
    send, receive = trio.testing.memory_stream_one_way_pair()
    await send.send_all(raw)
    await send.aclose()
    return FrameReader(receive)


async def test_oversized_length_prefix_allocates_nothing():
    for ftype in (FrameType.CHUNK, FrameType.CONTROL, FrameType.ERROR, FrameType.PING):
        reader = await _reader_of(header(ftype, 0xFFFFFFFF) + b"\0" * 64)
        tracemalloc.start()
        try:
            with pytest.raises(PeerBroken, match="outside its bounds"):
                await reader.receive()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 * 1024, peak
    reader = await _reader_of(header(FrameType.CHUNK, FABRIC_FRAME_BYTES_MAX + 1))
    with pytest.raises(PeerBroken):
        await reader.receive()


@pytest.mark.parametrize(
    "raw, message",
    [
        (header(FrameType.PING, 0, magic=b"GET "), "not an aiturbofs fabric peer"),
        (header(FrameType.PING, 0, version=0), "version mismatch"),
        (header(0x7E, 0), "unknown frame type 0x7e"),
        (struct.pack(">4sBBHQI", MAGIC, VERSION, FrameType.PING, 1, 0, 0), "reserved flags"),
        (header(FrameType.GET_CHUNK, 31) + bytes(31), "outside its bounds"),
        (header(FrameType.CHUNK, 100) + bytes(40), "in the middle of a frame"),
        (header(FrameType.PING, 0)[:10], "in the middle of a frame"),
    ],
)
async def test_malformed_frames(raw, message):
    with pytest.raises(PeerBroken, match=message):
        await (await _reader_of(raw)).receive()


def _into(stream):
    """A receive_into for memory streams, to run FrameReader's zero-copy path (TCP uses recv_into)."""

    async def receive_into(view):
        data = await stream.receive_some(len(view))
        view[: len(data)] = data
        return len(data)

    return receive_into


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_frames_round_trip_and_clean_eof(zero_copy):
    key, data = keyed(os.urandom(CHUNK_BYTES))  # header and body are sent apart, and read apart
    send, receive = trio.testing.memory_stream_pair()
    await send_frame(send, FrameType.PUT_CHUNK, 9, key, data)
    await send_frame(send, FrameType.PING, 10)
    await send_frame(send, FrameType.CHUNK, 11, key, data[:1000])
    await send.aclose()
    reader = FrameReader(receive, _into(receive) if zero_copy else None)
    frame = await reader.receive()
    assert (frame.type, frame.request_id, frame.key, frame.body) == (FrameType.PUT_CHUNK, 9, key, data)
    assert (await reader.receive()).type == FrameType.PING
    assert (await reader.receive()).body == data[:1000]
    assert await reader.receive() is None


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_stream_ending_inside_a_big_frame(zero_copy):
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(header(FrameType.CHUNK, 32 + CHUNK_BYTES) + bytes(32 + 1000))
    await send.aclose()
    reader = FrameReader(receive, _into(receive) if zero_copy else None)
    with pytest.raises(PeerBroken, match=f"1000 of {CHUNK_BYTES} bytes"):
        await reader.receive()


# --- the secret file ------------------------------------------------------------------------


def test_secret_file_permissions(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="group or others"):
        load_secret(str(path))
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="group or others"):
        load_secret(str(path))
    path.chmod(0o600)
    assert load_secret(str(path)) == SECRET  # trailing newline stripped
    path.write_bytes(b"short\n")
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(str(path))
    with pytest.raises(ConfigError, match="No such file"):
        load_secret(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not a regular file"):
        load_secret("/dev/null")
    if os.geteuid() == 0:  # root can hand the file to someone else
        path.write_bytes(SECRET)
        os.chown(path, 65534, -1)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            load_secret(str(path))


def test_transport_refuses_a_short_secret():
    with pytest.raises(ConfigError, match="at least 16"):
        MemoryTransport(MemoryNetwork(), "n", b"short")
    assert FABRIC_IN_FLIGHT_MAX >= 1


# --- RDMA: set-up, per-peer fallback, slots, work-request failures ----------------------------


async def test_slot_pool_bookkeeping():
    memory = memoryview(bytearray(3 * 16))
    pool = SlotPool(memory, 3, 16)
    taken = [await pool.acquire() for _ in range(3)]
    assert pool.free == 0 and sorted(s.index for s in taken) == [0, 1, 2]
    assert [s.offset for s in pool.slots] == [0, 16, 32] and all(len(s.view) == 16 for s in pool.slots)
    taken[1].view[:] = b"x" * 16
    assert bytes(memory[16:32]) == b"x" * 16  # a slot is a window on the registered memory
    waiters = []
    async def wait(n):
        waiters.append((n, await pool.acquire()))
    async with trio.open_nursery() as nursery:
        for n in range(2):
            nursery.start_soon(wait, n)
            await trio.testing.wait_all_tasks_blocked()
        for slot in (taken[0], taken[2]):
            pool.release(slot)
            await trio.testing.wait_all_tasks_blocked()
    assert [n for n, _ in waiters] == [0, 1]  # first come, first served
    with trio.move_on_after(0.05) as scope:  # cancelling a wait takes nothing
        await pool.acquire()
    assert scope.cancelled_caught and pool.free == 0
    taken[1].in_flight = True
    with pytest.raises(AssertionError, match="work request"):
        pool.release(taken[1])  # a work request may still write it
    taken[1].in_flight = False
    pool.release(taken[1])
    with pytest.raises(AssertionError, match="twice"):
        pool.release(taken[1])
    with pytest.raises(AssertionError, match="another pool"):
        SlotPool(memoryview(bytearray(16)), 1, 16).release(taken[1])
    for _, slot in waiters:
        pool.release(slot)
    assert pool.free == 3


QP = QpAddress(qpn=0x1234, psn=0xABCDE, lid=0, gid=bytes.fromhex("fe80000000000000" "0011223344556677"), mtu=5, rd_atomic=16)
LENT = LentMemory(addr=0x7F00_0000_0000, rkey=0xDEADBEEF, slots=16)


def test_endpoints_round_trip():
    offer = encode_endpoint(QP, LENT)
    assert len(offer) == ENDPOINT_BYTES
    assert decode_offer(offer) == (QP, LENT)
    assert decode_accept(encode_endpoint(QP)) == QP
    assert LENT.slot_addr(3) == LENT.addr + 3 * CHUNK_BYTES and LENT.probe_addr == LENT.addr + 16 * CHUNK_BYTES
    assert decode_slot(encode_slot(15), LENT) == 15
    assert decode_slot_length(encode_slot_length(2, CHUNK_BYTES), LENT) == (2, CHUNK_BYTES)


def _endpoint(**fields) -> bytes:
    values = dict(version=1, mtu=5, rd_atomic=16, flags=0, qpn=QP.qpn, psn=QP.psn, lid=0, reserved=0, gid=QP.gid,
                  addr=LENT.addr, rkey=LENT.rkey, slots=LENT.slots, slot_bytes=CHUNK_BYTES)
    values.update(fields)
    return ENDPOINT.pack(*values.values())


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(version=2), "extension version 2"),
        (dict(flags=1), "reserved bits"),
        (dict(reserved=1), "reserved bits"),
        (dict(mtu=0), "MTU code 0"),
        (dict(mtu=6), "MTU code 6"),
        (dict(rd_atomic=0), "0 READs"),
        (dict(rd_atomic=FABRIC_RDMA_READS_MAX + 1), "READs in flight"),
        (dict(qpn=1), "queue pair number 1"),
        (dict(qpn=1 << 24), "queue pair number"),
        (dict(psn=1 << 24), "exceeds 24 bits"),
        (dict(gid=bytes(16), lid=0), "neither a GID nor a LID"),
        (dict(slot_bytes=CHUNK_BYTES // 2), "slots of"),
        (dict(slots=FABRIC_RDMA_SLOTS_MAX + 1), "lends 1025 slots"),
        (dict(addr=0), "cannot hold"),
        (dict(addr=(1 << 64) - CHUNK_BYTES), "cannot hold"),
        (dict(addr=0, rkey=0, slots=0, slot_bytes=0), "lends no memory"),
    ],
)
def test_bad_offers_are_refused(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        decode_offer(_endpoint(**fields))


def test_bad_slot_references_are_refused():
    with pytest.raises(InvalidArgument, match="lends memory"):
        decode_accept(encode_endpoint(QP, LENT))  # a server never exposes its memory
    assert decode_accept(_endpoint(gid=bytes(16), lid=7, addr=0, rkey=0, slots=0, slot_bytes=0)).lid == 7  # IB: a LID will do
    with pytest.raises(InvalidArgument, match="slot 16 is not one of the 16"):
        decode_slot(encode_slot(16), LENT)
    with pytest.raises(InvalidArgument, match="length 0"):
        decode_slot_length(encode_slot_length(0, 0), LENT)
    with pytest.raises(InvalidArgument, match=f"length {CHUNK_BYTES + 1}"):
        decode_length(encode_length(CHUNK_BYTES + 1))


@asynccontextmanager
async def rdma_pair(handler, *, server_device=None, client_device=None, server=None, **client_kw):
    """A served RDMA transport (loopback verbs unless given) and a client connected to it."""
    server = server or RdmaTransport("server", SECRET, host="127.0.0.1", port=0, device=server_device or LoopbackDevice())
    client = RdmaTransport("client", SECRET, host="127.0.0.1", port=0, device=client_device or LoopbackDevice(), **client_kw)
    async with server, trio.open_nursery() as nursery:
        address = await nursery.start(server.serve, handler)
        async with client:
            yield server, client, await client.connect(address)
        nursery.cancel_scope.cancel()


async def settled(server, client, *, qps_left=0):
    """Wait until every slot is back in its pool and the queue pairs are gone (sessions end asynchronously)."""
    with trio.fail_after(5):
        while server._own_slots.free < server._own_slots.count or server._qps > qps_left:
            await trio.sleep(0.01)
    assert client._lent_slots.free == client._lent_slots.count


async def test_rdma_is_set_up_on_first_chunk_call_only():
    async with rdma_pair(Store()) as (server, client, peer):
        assert await peer.control({"op": "hello"})
        await peer.ping()
        assert peer.payload_path is None and client._qps == 0 and server._qps == 0  # control alone needs no QP
        key, data = keyed(os.urandom(FABRIC_RDMA_PAYLOAD_BYTES_MIN))
        assert await peer.put_chunk(key, data)
        assert peer.payload_path == "rdma" and client._qps == 1 and server._qps == 1
        assert peer.counters.rdma_bytes == len(data)
        small = keyed(b"tiny")  # below FABRIC_RDMA_PAYLOAD_BYTES_MIN: rides in the TCP frame
        assert await peer.put_chunk(*small)
        assert await peer.get_chunk(small[0]) == b"tiny" and peer.counters.rdma_bytes == len(data)


async def test_rdma_client_falls_back_to_tcp_with_a_tcp_server(caplog):
    async def main():
        store = Store()
        async with TcpTransport("server", SECRET, host="127.0.0.1", port=0) as server, trio.open_nursery() as nursery:
            address = await nursery.start(server.serve, store)
            async with RdmaTransport("client", SECRET, host="127.0.0.1", port=0, device=LoopbackDevice()) as client:
                peer = await client.connect(address)
                key, data = keyed(os.urandom(CHUNK_BYTES))
                assert await peer.put_chunk(key, data) and await peer.get_chunk(key) == data
                assert peer.payload_path == "tcp" and peer.counters.rdma_bytes == 0
                assert client._qps == 0 and client._lent_slots.free == client._lent_slots.count
                assert store.calls == 2  # the RDMA offer never reached the handler
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.INFO, logger="aiturbofs.fabric"):
        await main()
    assert "chunks with 'server'" in caplog.text and "go over TCP" in caplog.text and "has no RDMA" in caplog.text


async def test_failed_path_check_falls_back_to_tcp(caplog):
    """Queue pairs that connect but cannot reach each other (another fabric, a firewall): TCP, logged."""

    async def main():
        client_device = LoopbackDevice()
        _loopverbs._devices.pop(client_device.gid)  # the server's packets find nobody there
        store = Store()
        async with rdma_pair(store, client_device=client_device) as (server, client, peer):
            key, data = keyed(os.urandom(CHUNK_BYTES))
            assert await peer.put_chunk(key, data) and await peer.get_chunk(key) == data
            assert peer.payload_path == "tcp" and peer.counters.rdma_bytes == 0
            await settled(server, client)
            assert client._qps == 0

    with caplog.at_level(logging.INFO, logger="aiturbofs.fabric"):
        await main()
    assert "RDMA path check" in caplog.text and "RETRY_EXC_ERR" in caplog.text


async def test_many_transfers_share_few_slots():
    store = Store()
    chunks = [keyed(os.urandom(FABRIC_RDMA_PAYLOAD_BYTES_MIN + 1000 * i)) for i in range(12)]
    server = RdmaTransport("server", SECRET, host="127.0.0.1", port=0, device=LoopbackDevice(channel=False), slots=2)
    async with rdma_pair(store, server=server, slots=3) as (server, client, peer):
        async with trio.open_nursery() as nursery:
            for key, data in chunks:
                nursery.start_soon(peer.put_chunk, key, data)
        assert store.chunks == dict(chunks)
        got = {}
        async def get(key):
            got[key] = await peer.get_chunk(key)
        async with trio.open_nursery() as nursery:
            for key, _ in chunks:
                nursery.start_soon(get, key)
        assert got == dict(chunks)
        assert peer.counters.rdma_bytes == 2 * sum(len(d) for _, d in chunks)
        await settled(server, client, qps_left=1)


async def test_cancelled_get_keeps_its_slot_lent_until_the_reply():
    """The server may still write into the slot of an abandoned call: it is not reused before the reply."""

    release = trio.Event()
    big = keyed(os.urandom(FABRIC_RDMA_PAYLOAD_BYTES_MIN))
    class Slow(Store):
        async def get_chunk(self, peer, key):
            await release.wait()
            return await super().get_chunk(peer, key)
    store = Slow()
    store.chunks.update([big])
    async with rdma_pair(store) as (_, client, peer):
        assert await peer.put_chunk(*big)  # sets RDMA up
        pool = client._lent_slots
        with trio.move_on_after(0.2):  # our own cancel scope: abandons the call, judges nobody
            await peer.get_chunk(big[0])
        assert peer.state == "open" and pool.free == pool.count - 1 and len(peer._orphans) == 1
        release.set()
        with trio.fail_after(5):
            while pool.free < pool.count:
                await trio.sleep(0.01)  # the late reply freed it
        assert await peer.get_chunk(big[0]) == big[1]


async def test_stuck_work_request_breaks_the_connection_and_frees_its_slot():
    device = LoopbackDevice()
    store = Store()
    big = keyed(os.urandom(CHUNK_BYTES))
    store.chunks.update([big])
    async with rdma_pair(store, server_device=device) as (server, client, peer):
        assert await peer.get_chunk(big[0]) == big[1]
        device.stall = True  # the server's next RDMA WRITE never completes
        with pytest.raises(PeerBroken, match="no reply"):
            await peer.get_chunk(big[0], timeout=0.5)
        with pytest.raises(PeerBroken):
            await peer.ping()
        await settled(server, client)  # the parked slot came back once the queue pair was gone


async def test_queue_pair_error_breaks_the_connection():
    store = Store()
    big = keyed(os.urandom(CHUNK_BYTES))
    store.chunks.update([big])
    async with rdma_pair(store) as (server, client, peer):
        assert await peer.get_chunk(big[0]) == big[1]
        peer._qp.state = "error"  # the client's queue pair failed: the server's WRITE cannot land
        with pytest.raises(PeerBroken, match="RETRY_EXC_ERR"):
            await peer.get_chunk(big[0])
        assert peer.state == "broken"
        await settled(server, client)


async def test_bad_slot_reference_drops_the_connection(monkeypatch):
    store = Store()
    big = keyed(os.urandom(CHUNK_BYTES))
    store.chunks.update([big])
    async with rdma_pair(store) as (server, client, peer):
        assert await peer.get_chunk(big[0]) == big[1]
        monkeypatch.setattr(_rdma_client, "encode_slot", lambda index: encode_slot(client._lent.slots))
        with pytest.raises(PeerBroken, match="slot 16 is not one of the 16 lent"):
            await peer.get_chunk(big[0])
        await settled(server, client)


async def test_rdma_frames_without_rdma_drop_the_connection():
    async with rdma_pair(Store()) as (server, client, peer):
        with pytest.raises(PeerBroken, match="GET_CHUNK_RDMA before RDMA_CONNECT"):
            await peer._call(FrameType.GET_CHUNK_RDMA, chunk.digest(b"x"), encode_slot(0), 5, {FrameType.CHUNK_RDMA})
    async with TcpTransport("server", SECRET, host="127.0.0.1", port=0) as server, trio.open_nursery() as nursery:
        address = await nursery.start(server.serve, Store())
        async with TcpTransport("client", SECRET, host="127.0.0.1", port=0) as client:
            peer = await client.connect(address)
            with pytest.raises(RemoteError, match="has no RDMA"):
                await peer._call(FrameType.RDMA_CONNECT, b"", encode_endpoint(QP, LENT), 5, {FrameType.RDMA_ACCEPT})
            await peer.ping()  # a refusal, not a failure
            with pytest.raises(PeerBroken, match="without RDMA"):
                await peer._call(FrameType.PUT_CHUNK_RDMA, chunk.digest(b"x"), encode_slot_length(0, 1), 5, {FrameType.ACK})
        nursery.cancel_scope.cancel()


async def test_served_memory_is_not_reachable_by_peers():
    """A client's queue pair can reach nothing of the server's: only servers move bytes, into lent memory."""

    async with rdma_pair(Store()) as (server, client, peer):
        assert await peer.put_chunk(*keyed(os.urandom(CHUNK_BYTES)))
        for region in (server._own_region, server._lent_region):  # served from; lent by the server for its own calls
            peer._qp.post(99, Op.READ, client._own_region, 0, 16, region.addr, region.rkey)
            (completion,) = client._device.poll(16)
            assert completion.wr_id == 99 and "REM_ACCESS_ERR" in completion.error
            peer._qp.state = "rts"


def _pyverbs_or_skip():
    try:
        return _pyverbs.load()
    except VerbsError as e:
        pytest.skip(f"pyverbs not installed: {e}")


@pytest.mark.parametrize("ethernet", [True, False], ids=["roce", "infiniband"])
def test_pyverbs_objects_build_against_the_installed_bindings(ethernet):
    """What the pyverbs adapter hands to the verbs, built with the real bindings (no device needed)."""
    mods = _pyverbs_or_skip()
    e = mods[3]
    init, attr = _pyverbs.init_attrs(mods, None, port=1, send_depth=16, remote_access=True)
    assert init.qp_type == e.ibv_qp_type.IBV_QPT_RC and init.max_send_wr == 16 and init.sq_sig_all == 1
    remote_bits = e.ibv_access_flags.IBV_ACCESS_REMOTE_READ | e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
    assert attr.qp_access_flags & remote_bits == remote_bits
    _, attr = _pyverbs.init_attrs(mods, None, port=1, send_depth=1, remote_access=False)
    assert attr.qp_access_flags & remote_bits == 0  # what a node serves from is never remotely accessible
    local = QpAddress(qpn=0x11, psn=0x22, lid=3, gid=bytes(range(16)), mtu=5, rd_atomic=8)
    remote = QpAddress(qpn=0x44, psn=0x55, lid=6, gid=bytes(range(16, 32)), mtu=3, rd_atomic=4)
    attr = _pyverbs.rts_attr(mods, port=1, ethernet=ethernet, gid_index=3, local=local, remote=remote, rd_atomic_out=16)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.path_mtu) == (0x44, 0x55, 0x22, 3)
    assert (attr.max_dest_rd_atomic, attr.max_rd_atomic) == (8, 4)
    assert attr.ah_attr.dlid == 6 and attr.ah_attr.is_global == int(ethernet)
    if ethernet:
        assert attr.ah_attr.dgid == _pyverbs._gid_text(remote.gid) and attr.ah_attr.sgid_index == 3
    region = Region(view=memoryview(bytearray(64)), addr=0x1000, lkey=7, rkey=0)
    request = _pyverbs.work_request(mods, 9, Op.READ, region, 16, 32, 0x7F00_0000_0000, 0xBEEF)
    assert (request.wr_id, request.opcode, request.num_sge) == (9, e.ibv_wr_opcode.IBV_WR_RDMA_READ, 1)
    assert request.send_flags == e.ibv_send_flags.IBV_SEND_SIGNALED


def test_roce_gid_choice_prefers_routable_ipv4():
    mods = _pyverbs_or_skip()
    addr, e = mods[0], mods[3]
    link_local, ipv4 = "fe80:0000:0000:0000:0211:22ff:fe33:4455", "0000:0000:0000:0000:0000:ffff:0a00:0001"
    v1, v2 = e.ibv_gid_type_sysfs.IBV_GID_TYPE_SYSFS_IB_ROCE_V1, e.ibv_gid_type_sysfs.IBV_GID_TYPE_SYSFS_ROCE_V2
    table = [(link_local, v1), (link_local, v2), ("0000:" * 7 + "0000", v2), (ipv4, v1), (ipv4, v2)]

    class Ctx:  # a port's GID table, as Context.query_gid / query_gid_type give it
        def query_gid(self, port, index):
            return addr.GID(table[index][0])

        def query_gid_type(self, port, index):
            return table[index][1]

    assert _pyverbs.pick_gid(mods, Ctx(), 1, len(table), ethernet=True) == (4, bytes(10) + b"\xff\xff\x0a\x00\x00\x01")
    assert _pyverbs.pick_gid(mods, Ctx(), 1, 3, ethernet=True)[0] == 1  # no IPv4 yet: RoCE v2 still wins
    assert _pyverbs.pick_gid(mods, Ctx(), 1, len(table), ethernet=False)[0] == 0
    del table[:]
    with pytest.raises(VerbsError, match="no usable GID"):
        _pyverbs.pick_gid(mods, Ctx(), 1, 8, ethernet=True)


# --- choosing the transport ------------------------------------------------------------------------


def test_rdma_devices_never_raises(monkeypatch):
    devices = rdma_devices()
    assert isinstance(devices, list)
    if not os.path.isdir("/sys/class/infiniband"):
        assert devices == []
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # as if not installed
    for name in [m for m in sys.modules if m.startswith("pyverbs.")]:
        monkeypatch.delitem(sys.modules, name)
    assert rdma_devices() == []
    assert "pyverbs is not installed" in probe_rdma()[1]


def test_auto_without_a_device_is_tcp_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(_select, "probe", lambda: ([], "no RDMA device (test)"))
    with caplog.at_level(logging.INFO, logger="aiturbofs.fabric"):
        transport = open_transport("auto", "n1", SECRET, host="127.0.0.1", port=0)
    assert isinstance(transport, TcpTransport) and transport.kind == "tcp"
    assert "TCP transport (transport=auto): no RDMA device (test)" in caplog.text
    with pytest.raises(ConfigError, match=r"transport=rdma: no RDMA device \(test\); see docs/rdma.md"):
        open_transport("rdma", "n1", SECRET, host="127.0.0.1", port=0)
    with pytest.raises(ConfigError, match="want one of auto, tcp, rdma"):
        open_transport("infiniband", "n1", SECRET)
    assert open_transport("tcp", "n1", SECRET).kind == "tcp"


def test_auto_with_an_unusable_device_is_tcp(monkeypatch, caplog):
    monkeypatch.setattr(_select, "probe", lambda: (["mlx9_0"], ""))  # listed, but it will not open here
    with caplog.at_level(logging.INFO, logger="aiturbofs.fabric"):
        assert open_transport("auto", "n1", SECRET).kind == "tcp"
    assert "RDMA device mlx9_0 is there but cannot be used" in caplog.text
    with pytest.raises(ConfigError, match="transport=rdma: RDMA transport: "):
        open_transport("rdma", "n1", SECRET)
    with pytest.raises(ConfigError, match="'mlx5_7' is not among the usable ones"):
        open_transport("rdma", "n1", SECRET, device="mlx5_7")


async def test_rdma_transport_runs_on_a_given_device(caplog):
    transport = RdmaTransport("n1", SECRET, host="127.0.0.1", port=0, device=LoopbackDevice("rxe9"))
    assert transport.kind == "rdma" and transport.device_name.startswith("rxe9")
    async with transport:
        pass
    assert transport._device.closed
