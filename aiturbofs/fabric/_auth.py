"""Cluster-secret authentication of fabric peers: the secret file and the handshake.

Mutual challenge/response, four frames at the start of every connection::

    client -> HELLO(nonce_c, name_c)
    server -> CHALLENGE(nonce_s, name_s)
    client -> RESPONSE(HMAC(secret, "client" | nonce_c | nonce_s | name_c | name_s))
    server -> OK(HMAC(secret, "server" | nonce_c | nonce_s | name_c | name_s))

The secret never crosses the wire.  Both nonces are fresh random bytes per
connection, so a recorded exchange cannot be replayed; the role label keeps a
MAC of one direction from being reflected back as the other; both node names
are bound into the MAC, so a proof is for this pair of nodes only.  The client
proves first, so the server reveals nothing to a peer that does not know the
secret.  This authenticates the two ends, not each later frame: chunk payloads
are protected by their BLAKE3 keys, control bodies rely on the network path.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

import trio

from .._errors import AuthFailed, ConfigError, PeerBroken
from .._limits import FABRIC_SECRET_BYTES_MAX, FABRIC_SECRET_BYTES_MIN
from ._wire import (
    NONCE_BYTES,
    VERSION,
    Frame,
    FrameReader,
    FrameType,
    decode_hello,
    decode_message,
    encode_hello,
    send_frame,
)


def load_secret(path: str) -> bytes:
    """The cluster secret in ``path``, without its trailing newline.

    ``ConfigError`` if the file is missing, not a regular file, not owned by
    the running user, accessible to group or others (any of ``0o077``), or
    shorter than ``FABRIC_SECRET_BYTES_MIN`` bytes.
    """
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"cluster secret {path}: not a regular file")
            if st.st_uid != os.geteuid():
                raise ConfigError(f"cluster secret {path}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
            if st.st_mode & 0o077:
                raise ConfigError(
                    f"cluster secret {path}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others read it; chmod 600 {path}"
                )
            data = f.read(FABRIC_SECRET_BYTES_MAX + 1)
    except OSError as e:
        raise ConfigError(f"cluster secret {path}: {e.strerror or e}") from e
    if len(data) > FABRIC_SECRET_BYTES_MAX:
        raise ConfigError(f"cluster secret {path}: longer than {FABRIC_SECRET_BYTES_MAX} bytes; is it the right file?")
    data = data.removesuffix(b"\n").removesuffix(b"\r")
    check_secret(data, path)
    return data


def check_secret(secret: bytes, what: str = "cluster secret") -> None:
    if len(secret) < FABRIC_SECRET_BYTES_MIN:
        raise ConfigError(
            f"{what}: {len(secret)} bytes, at least {FABRIC_SECRET_BYTES_MIN} are needed "
            "(e.g. head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE)"
        )


def _mac(secret: bytes, role: bytes, nonce_c: bytes, nonce_s: bytes, name_c: str, name_s: str) -> bytes:
    msg = [b"aiturbofs fabric v%d\0" % VERSION, role, b"\0", nonce_c, nonce_s]
    for name in (name_c, name_s):
        raw = name.encode("utf-8")
        msg += [len(raw).to_bytes(2, "big"), raw]
    return hmac.new(secret, b"".join(msg), hashlib.sha256).digest()


async def _expect(reader: FrameReader, want: FrameType, address: str, *, refusal=PeerBroken) -> Frame:
    frame = await reader.receive()
    if frame is None:
        raise refusal(f"{address} closed the connection during the handshake (waiting for {want.name})")
    if frame.type == FrameType.ERROR:
        raise refusal(f"{address} refused the connection: {decode_message(frame.body)}")
    if frame.type != want or frame.request_id != 0:
        raise PeerBroken(f"{address} sent {frame.type.name} during the handshake (expected {want.name})")
    return frame


async def client_handshake(stream: trio.abc.Stream, reader: FrameReader, node: str, secret: bytes, address: str) -> str:
    """Authenticate with the server at ``address``; returns its node name.

    ``AuthFailed`` if either side does not prove knowledge of ``secret``;
    ``PeerBroken`` for anything else that goes wrong.  Stream errors
    propagate unmapped; the caller bounds the time and closes the stream.
    """
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    await send_frame(stream, FrameType.HELLO, 0, body=encode_hello(nonce_c, node))
    nonce_s, name_s = decode_hello((await _expect(reader, FrameType.CHALLENGE, address)).body)
    await send_frame(stream, FrameType.RESPONSE, 0, body=_mac(secret, b"client", nonce_c, nonce_s, node, name_s))
    # An ERROR or a hang-up now means the server did not accept our proof.
    ok = await _expect(reader, FrameType.OK, address, refusal=AuthFailed)
    if not hmac.compare_digest(bytes(ok.body), _mac(secret, b"server", nonce_c, nonce_s, node, name_s)):
        raise AuthFailed(f"{address} (node {name_s!r}) failed to prove it knows the cluster secret")
    return name_s


async def server_handshake(stream: trio.abc.Stream, reader: FrameReader, node: str, secret: bytes, address: str) -> str:
    """Authenticate the client at ``address``; returns its node name.

    Nothing but the handshake is read before the client has proved itself:
    a chunk request sent early is a protocol error.  Errors as in
    ``client_handshake``.
    """
    hello = await _expect(reader, FrameType.HELLO, address)
    nonce_c, name_c = decode_hello(hello.body)
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    await send_frame(stream, FrameType.CHALLENGE, 0, body=encode_hello(nonce_s, node))
    response = await _expect(reader, FrameType.RESPONSE, address)
    if not hmac.compare_digest(bytes(response.body), _mac(secret, b"client", nonce_c, nonce_s, name_c, node)):
        raise AuthFailed(f"{address} (claims node {name_c!r}) failed to prove it knows the cluster secret")
    await send_frame(stream, FrameType.OK, 0, body=_mac(secret, b"server", nonce_c, nonce_s, name_c, node))
    return name_c
