"""A fault-injecting HTTP relay in front of the S3 test server.

``FaultyS3Proxy`` listens on loopback and relays each HTTP request of a
client (the daemon, with ``-o s3_endpoint=proxy.endpoint``) to the moto
server, one request at a time per client connection, so that it can fail
requests one by one and count them.  Its modes are switched by the test
while traffic flows (``set(...)``):

- ``down``: every new connection is reset at once, and every request on a
  kept-alive connection gets its connection reset instead of an answer (what
  a client sees when the endpoint's host is gone or its load balancer drops
  it).  Nothing reaches the server.
- ``error_rate=p``: a fraction ``p`` of requests is answered with a real
  S3-style XML error (500 InternalError or 503 SlowDown, chosen at random).
  For idempotent methods (GET, HEAD, PUT, DELETE) half of those errors come
  *after* the request was forwarded and done: the part is stored, the object
  written, the upload aborted, and only the answer says otherwise.  That is
  the nastier realistic case for multipart uploads (a lost answer, which a
  client cannot tell from a lost request), and it is what catches a part
  counted twice or an abort assumed done.  POSTs (CreateMultipartUpload,
  CompleteMultipartUpload) are failed without forwarding: their repetition
  is not harmless, and S3 itself fails them before acting on a 5xx.
- ``delay_s=d`` or ``delay_s=(lo, hi)``: every request waits that long (a
  uniform draw) before it is forwarded: a slow server, not a slow link.

Every request is logged with its arrival time, method and what happened to
it (``forwarded``, ``error``, ``error-after``, ``reset``; a connection reset
while down is logged as method ``CONNECT``), so a test can
check retry rates (``rate``, ``per_second``).  ``close()`` stops accepting
and closes every socket; use it as a context manager.
"""

from __future__ import annotations

import collections
import http.client
import random
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass

HOST = "127.0.0.1"
HEAD_BYTES_MAX = 64 * 1024  # a request head longer than this is a broken client
UPSTREAM_TIMEOUT_S = 120.0
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE"})
_ERRORS = (
    (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
)
# Response headers the relay sets itself (it frames every answer with Content-Length).
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


@dataclass(frozen=True)
class Request:
    at: float  # time.monotonic() when its head arrived
    method: str
    target: str  # path and query
    outcome: str  # forwarded | error | error-after | reset


class _Reset(Exception):
    """Drop this client connection with a TCP reset."""


class FaultyS3Proxy:
    """See the module doc.  ``endpoint`` is what the daemon is given."""

    def __init__(self, target_port: int, *, seed: int = 0):
        self.target = (HOST, target_port)
        self.down = False
        self.error_rate = 0.0
        self.error_methods: frozenset[str] | None = None  # None: errors hit every method
        self.delay_s: float | tuple[float, float] = 0.0
        self.log: list[Request] = []
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = False
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://{HOST}:{self.port}"
        threading.Thread(target=self._accept, daemon=True, name="faulty-s3-proxy").start()

    # -- what the test uses --

    def set(self, *, down: bool | None = None, error_rate: float | None = None,
            delay_s: float | tuple[float, float] | None = None, error_methods: frozenset[str] | None = None) -> None:
        """Switch modes; arguments left out keep their value.  ``error_methods``
        goes with ``error_rate``: only these HTTP methods get errors (None: all)."""
        with self._lock:
            if down is not None:
                self.down = down
            if error_rate is not None:
                assert 0.0 <= error_rate <= 1.0, error_rate
                self.error_rate = error_rate
                self.error_methods = error_methods
            if delay_s is not None:
                self.delay_s = delay_s
        if down:
            self._reset_idle()

    def requests(self, since: float = 0.0, until: float = float("inf"), method: str | None = None,
                 outcome: str | None = None) -> list[Request]:
        with self._lock:
            log = list(self.log)
        return [r for r in log if since <= r.at < until and (method is None or r.method == method)
                and (outcome is None or r.outcome == outcome)]

    def rate(self, since: float, until: float, method: str | None = None) -> float:
        """Requests per second that arrived in ``[since, until)``."""
        return len(self.requests(since, until, method)) / max(until - since, 1e-9)

    def per_second(self, since: float, until: float) -> list[collections.Counter]:
        """One Counter of methods per whole second of ``[since, until)``."""
        seconds = [collections.Counter() for _ in range(max(1, int(until - since + 0.999)))]
        for r in self.requests(since, until):
            seconds[min(int(r.at - since), len(seconds) - 1)][r.method] += 1
        return seconds

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _close(s)

    def __enter__(self) -> FaultyS3Proxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the relay --

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down:
                self._note("CONNECT", "", "reset")  # a connection attempt is a retry too
                _reset(client)
                continue
            with self._lock:
                self._socks.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _reset_idle(self) -> None:
        """Going down: kept-alive connections die too (a reset, not a clean close)."""
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _reset(s)

    def _serve(self, client: socket.socket) -> None:
        reader = _Reader(client)
        upstream: http.client.HTTPConnection | None = None
        try:
            while not self._closed:
                head = reader.head()
                if head is None:
                    return  # the client closed its connection
                method, target, headers = head
                if headers.get("expect", "").lower() == "100-continue":
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = reader.body(headers)
                outcome, delay_s = self._decide(method)
                if delay_s:
                    time.sleep(delay_s)
                self._note(method, target, outcome)
                if outcome == "reset":
                    raise _Reset
                if outcome == "error":
                    client.sendall(self._error(method))
                    continue
                if upstream is None:
                    upstream = http.client.HTTPConnection(*self.target, timeout=UPSTREAM_TIMEOUT_S)
                answer = _forward(upstream, method, target, headers, body)
                if self.down:
                    raise _Reset  # went down while the server was working on it
                client.sendall(self._error(method) if outcome == "error-after" else answer)
        except _Reset:
            _reset(client)
        except (OSError, http.client.HTTPException, ValueError):
            pass
        finally:
            with self._lock:
                self._socks.discard(client)
            _close(client)
            if upstream is not None:
                upstream.close()

    def _decide(self, method: str) -> tuple[str, float]:
        with self._lock:
            if self.down:
                return "reset", 0.0
            delay = self.delay_s
            delay_s = self._random.uniform(*delay) if isinstance(delay, tuple) else delay
            if self._random.random() >= self.error_rate or (
                    self.error_methods is not None and method not in self.error_methods):
                return "forwarded", delay_s
            after = method in IDEMPOTENT and self._random.random() < 0.5
            return ("error-after" if after else "error"), delay_s

    def _note(self, method: str, target: str, outcome: str) -> None:
        with self._lock:
            self.log.append(Request(time.monotonic(), method, target, outcome))

    def _error(self, method: str) -> bytes:
        """An S3 XML error; a HEAD's has the head only (its Content-Length
        still says how long the body would be, as S3's does)."""
        with self._lock:
            status, reason, code, message = self._random.choice(_ERRORS)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>"
        ).encode()
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nx-amz-request-id: {uuid.uuid4().hex[:16].upper()}\r\n\r\n"
        )
        return head.encode() + (b"" if method == "HEAD" else body)


class _Reader:
    """Reads HTTP/1.1 requests off one client socket."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._buf = b""

    def _fill(self) -> bool:
        data = self._sock.recv(1 << 20)
        self._buf += data
        return bool(data)

    def head(self) -> tuple[str, str, dict[str, str]] | None:
        while b"\r\n\r\n" not in self._buf:
            if len(self._buf) > HEAD_BYTES_MAX:
                raise ValueError("request head too long")
            if not self._fill():
                return None
        raw, self._buf = self._buf.split(b"\r\n\r\n", 1)
        lines = raw.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return method, target, headers

    def body(self, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return self._chunked()
        return self._exactly(int(headers.get("content-length", "0")))

    def _exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._fill():
                raise ValueError("client closed mid-body")
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def _line(self) -> bytes:
        while b"\r\n" not in self._buf:
            if not self._fill():
                raise ValueError("client closed mid-chunk")
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line

    def _chunked(self) -> bytes:
        out = []
        while True:
            size = int(self._line().split(b";")[0], 16)
            if size == 0:
                while self._line():
                    pass  # trailers
                return b"".join(out)
            out.append(self._exactly(size))
            self._exactly(2)


def _forward(upstream: http.client.HTTPConnection, method: str, target: str,
             headers: dict[str, str], body: bytes) -> bytes:
    """One request to the server; the whole answer, framed for a kept-alive client."""
    out_headers = {k: v for k, v in headers.items() if k not in ("expect", "transfer-encoding", "connection")}
    if body or method in ("PUT", "POST"):
        out_headers["content-length"] = str(len(body))
    upstream.request(method, target, body=body, headers=out_headers)
    response = upstream.getresponse()
    payload = response.read()
    lines = [f"HTTP/1.1 {response.status} {response.reason}"]
    for name, value in response.getheaders():
        if name.lower() not in _HOP_HEADERS:
            lines.append(f"{name}: {value}")
    if method == "HEAD":  # the length of what a GET would return; no body follows
        lines.append(f"Content-Length: {response.getheader('content-length', '0')}")
    else:
        lines.append(f"Content-Length: {len(payload)}")
    if response.will_close:
        upstream.close()  # reconnects on the next request
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if method == "HEAD" else payload)


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the peer sees ECONNRESET, not a clean EOF."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)  # wakes a thread blocked reading it (no packet is sent)
    except OSError:
        pass
    _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
