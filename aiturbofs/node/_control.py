"""The control socket: ``aiturbo status`` and friends talk to the daemon here.

One JSON request line per connection, one JSON answer line back.  The socket
is created 0600 in a 0700 directory under /run: only root may talk to it.
"""

import json
import logging
import os
import socket

import trio

from .._limits import CONTROL_CALL_TIMEOUT_S, CONTROL_CLIENTS_MAX, CONTROL_REQUEST_BYTES_MAX

log = logging.getLogger(__name__)


async def serve(path: str, dispatch, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``dispatch(request: dict) -> dict`` on the unix socket ``path``."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)  # stale from a crash; the state-dir lock proves we own it
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        await sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(CONTROL_CLIENTS_MAX)
    limiter = trio.CapacityLimiter(CONTROL_CLIENTS_MAX)

    async def handle(stream: trio.SocketStream) -> None:
        async with limiter, stream:
            with trio.move_on_after(CONTROL_CALL_TIMEOUT_S):
                data = b""
                while not data.endswith(b"\n") and len(data) < CONTROL_REQUEST_BYTES_MAX:
                    more = await stream.receive_some(4096)
                    if not more:
                        break
                    data += more
                try:
                    request = json.loads(data)
                    if not isinstance(request, dict):
                        raise ValueError("request must be a JSON object")
                    answer = await dispatch(request)
                except Exception as exc:  # noqa: BLE001 - a bad request must not stop the server
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                await stream.send_all(json.dumps(answer).encode() + b"\n")

    try:
        task_status.started()
        await trio.serve_listeners(handle, [trio.SocketListener(sock)])
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def call(path: str, request: dict, timeout_s: float = CONTROL_CALL_TIMEOUT_S) -> dict:
    """Client side (blocking): send ``request``, return the daemon's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            more = s.recv(65536)
            if not more:
                break
            data += more
    return json.loads(data)
