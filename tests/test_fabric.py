"""The fabric: wire format, cluster-secret auth, and the transport conformance suite.

``TransportConformance`` is what every transport must pass; ``TestTCP`` and
``TestMemory`` supply only the ``make_transport`` fixture.  Byte-level attacks
(unauthenticated frames, oversized lengths, other versions, tampering) use the
transports' raw stream seam (``_open_stream`` / ``_serve_streams``), so they run
on every transport too.
"""

import logging
import os
import struct
import tracemalloc
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from aiturbofs import chunk
from aiturbofs._errors import AuthFailed, ConfigError, IntegrityError, InvalidArgument, NotFound, PeerBroken, PeerClosed, RemoteError
from aiturbofs._limits import CHUNK_BYTES, FABRIC_CONTROL_BYTES_MAX, FABRIC_FRAME_BYTES_MAX, FABRIC_IN_FLIGHT_MAX
from aiturbofs.fabric import MemoryNetwork, MemoryTransport, TcpTransport, load_secret
from aiturbofs.fabric._wire import HEADER, MAGIC, VERSION, FrameReader, FrameType, encode_hello, send_frame

SECRET = b"correct horse battery staple 42!"
WRONG = b"incorrect horse battery staple 0"
TEST_TIMEOUT_S = 15


def run(fn, *args):
    async def guarded():
        with trio.fail_after(TEST_TIMEOUT_S):
            return await fn(*args)

    return trio.run(guarded)


def keyed(data: bytes) -> tuple[bytes, bytes]:
    return chunk.digest(data), data


class Store:
    """A ChunkHandler that records what it was asked."""

    def __init__(self, *, delay_s: float = 0.0, hang: bool = False):
        self.chunks: dict[bytes, bytes] = {}
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
            return self.chunks.get(key)
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
    def test_round_trips(self, make_transport):
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
                    served = server.counters()["client"]
                    assert served.chunks_received == 3 and served.chunks_sent == 3
                    assert served.bytes_received == c.bytes_sent and served.bytes_sent == c.bytes_received
                    await peer.aclose()

        run(main)

    def test_not_found_and_refused(self, make_transport):
        async def main():
            store = Store()
            async with self.serving(make_transport, store) as (_, address, _), make_transport("client", SECRET) as client:
                peer = await client.connect(address)
                assert await peer.get_chunk(chunk.digest(b"never stored")) is None
                key, data = keyed(b"seven!!")
                assert await peer.put_chunk(key, data) is False  # the handler said no
                assert await peer.ping() >= 0

        run(main)

    def test_control(self, make_transport):
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

        run(main)

    def test_concurrent_requests_are_multiplexed_and_bounded(self, make_transport):
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

                        async def get(key):
                            results[key] = await peer.get_chunk(key)

                        start = trio.current_time()
                        async with trio.open_nursery() as nursery:
                            for key, _ in chunks:
                                nursery.start_soon(get, key)
                        elapsed = trio.current_time() - start
                        assert results == dict(chunks)
                        assert store.active_max == 4, store.active_max  # concurrent, and never more
                        assert elapsed < 50 * 0.02 * 0.75  # really multiplexed: one by one takes 1 s

        run(main)

    # --- authentication -----------------------------------------------------------------
    def test_client_with_wrong_secret_is_rejected(self, make_transport, caplog):
        async def main():
            store = Store()
            async with self.serving(make_transport, store) as (_, address, _), make_transport("intruder", WRONG) as client:
                with pytest.raises(AuthFailed):
                    await client.connect(address)
            assert store.calls == 0

        with caplog.at_level(logging.WARNING, logger="aiturbofs.fabric"):
            run(main)
        rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
        assert rejected and "intruder" in rejected[0] and "secret" in rejected[0], caplog.text

    def test_server_with_wrong_secret_is_rejected(self, make_transport):
        async def main():
            rogue = Store()
            async with self.serving(make_transport, rogue, secret=WRONG) as (_, address, _), make_transport("client", SECRET) as client:
                with pytest.raises(AuthFailed):
                    await client.connect(address)
            assert rogue.calls == 0

        run(main)

    def test_client_checks_the_server_proof(self, make_transport):
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

        run(main)

    def test_unauthenticated_frames_are_never_served(self, make_transport):
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

        run(main)

    # --- integrity ----------------------------------------------------------------------
    def test_corrupt_payload_is_detected_both_ways(self, make_transport):
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

        run(main)

    # --- failures -----------------------------------------------------------------------
    def test_peer_dying_mid_call_breaks_pending_and_later_calls(self, make_transport):
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

        run(main)

    def test_calls_after_aclose_raise_peer_closed(self, make_transport):
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

        run(main)

    def test_per_call_timeout(self, make_transport):
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

        run(main)

    def test_connect_to_nobody(self, make_transport):
        async def main():
            async with make_transport("server", SECRET) as server, trio.open_nursery() as nursery:
                address = await nursery.start(server.serve, Store())
                nursery.cancel_scope.cancel()
            async with make_transport("client", SECRET) as client:
                with pytest.raises(PeerBroken):
                    await client.connect(address)

        run(main)

    # --- malformed frames ---------------------------------------------------------------
    def test_oversized_length_prefix_is_rejected(self, make_transport):
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

        run(main)

    def test_version_mismatch_is_reported(self, make_transport, caplog):
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
            run(main)
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


class TestTCP(TransportConformance):
    @pytest.fixture
    def make_transport(self):
        def make(node, secret, **kw):
            return TcpTransport(node, secret, host="127.0.0.1", port=0, **kw)

        return make


class TestMemory(TransportConformance):
    @pytest.fixture
    def make_transport(self):
        network = MemoryNetwork()

        def make(node, secret, **kw):
            return MemoryTransport(network, node, secret, **kw)

        return make


# --- the wire format alone ----------------------------------------------------------------


async def _reader_of(raw: bytes) -> FrameReader:
    send, receive = trio.testing.memory_stream_one_way_pair()
    await send.send_all(raw)
    await send.aclose()
    return FrameReader(receive)


def test_oversized_length_prefix_allocates_nothing():
    async def main():
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

    run(main)


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
def test_malformed_frames(raw, message):
    async def main():
        with pytest.raises(PeerBroken, match=message):
            await (await _reader_of(raw)).receive()

    run(main)


def _into(stream):
    """A receive_into for memory streams, to run FrameReader's zero-copy path (TCP uses recv_into)."""

    async def receive_into(view):
        data = await stream.receive_some(len(view))
        view[: len(data)] = data
        return len(data)

    return receive_into


@pytest.mark.parametrize("zero_copy", [False, True])
def test_frames_round_trip_and_clean_eof(zero_copy):
    async def main():
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

    run(main)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_stream_ending_inside_a_big_frame(zero_copy):
    async def main():
        send, receive = trio.testing.memory_stream_pair()
        await send.send_all(header(FrameType.CHUNK, 32 + CHUNK_BYTES) + bytes(32 + 1000))
        await send.aclose()
        reader = FrameReader(receive, _into(receive) if zero_copy else None)
        with pytest.raises(PeerBroken, match=f"1000 of {CHUNK_BYTES} bytes"):
            await reader.receive()

    run(main)


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
