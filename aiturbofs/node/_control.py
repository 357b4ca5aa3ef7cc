"""The control socket: ``aiturbo status`` and friends talk to the daemon here.

One JSON request line per connection, one JSON answer line back.  The socket
is created 0600 in a 0700 directory under /run: only root may talk to it.  The
daemon also checks each client's credentials (SO_PEERCRED), so a socket that
became reachable by others (a loosened mode, a hard link elsewhere) still
serves only root and the daemon's own user.
"""

import json
import logging
import os
import socket
import struct

import trio

from .._control_client import call as call  # the client side, for the daemon's own tests and tools
from .._limits import CONTROL_CALL_TIMEOUT_S, CONTROL_CLIENTS_MAX, CONTROL_REQUEST_BYTES_MAX, CONTROL_WAITS_MAX

log = logging.getLogger(__name__)


async def serve(path: str, dispatch, *, long_polls: frozenset[str] = frozenset(),
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``dispatch(request: dict) -> dict`` on the unix socket ``path``.

    A command in ``long_polls`` sleeps until something happens (``wait``): once
    read, it counts against CONTROL_WAITS_MAX instead of the CONTROL_CLIENTS_MAX
    requests that do work, so sleepers never keep ``aiturbo status`` waiting.
    """
    # The directory is private, so the socket may be bound with any mode and
    # narrowed before it listens: setting the umask instead would change it
    # for the whole process, worker threads creating backend files included.
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    if os.path.exists(path):
        os.unlink(path)  # stale from a crash; the state-dir lock proves we own it
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(CONTROL_CLIENTS_MAX)
    workers = trio.CapacityLimiter(CONTROL_CLIENTS_MAX)
    sleepers = trio.CapacityLimiter(CONTROL_WAITS_MAX)

    async def handle(stream: trio.SocketStream) -> None:
        async with _Slot(workers) as slot, stream:
            uid = _peer_uid(stream.socket)
            with trio.move_on_after(CONTROL_CALL_TIMEOUT_S):
                data = b""
                try:
                    while not data.endswith(b"\n") and len(data) < CONTROL_REQUEST_BYTES_MAX:
                        more = await stream.receive_some(4096)
                        if not more:
                            break
                        data += more
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # reset by the client mid-request: nothing to answer
                if uid not in (0, os.geteuid()):
                    # The request was read (not parsed) only so that the client
                    # gets this answer instead of a broken pipe.
                    log.warning("control socket %s: refused a request from uid %s (only root may control the daemon)", path, uid)
                    answer = {"ok": False, "error": f"permission denied: uid {uid} may not control this daemon"}
                    try:
                        await stream.send_all(json.dumps(answer).encode() + b"\n")
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # the client already left; nothing was done for it
                    return
                try:
                    request = json.loads(data)
                    if not isinstance(request, dict):
                        raise ValueError("request must be a JSON object")
                    if request.get("cmd") in long_polls:
                        await slot.move_to(sleepers)
                    answer = await dispatch(request)
                except Exception as exc:  # noqa: BLE001 - a bad request must not stop the server
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                try:
                    await stream.send_all(json.dumps(answer).encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    # A client that hung up (^C on `aiturbo wait`) must not end
                    # serve_listeners, which would take the daemon down with it.
                    log.info("control socket %s: client left before its answer", path)

    try:
        task_status.started()
        await trio.serve_listeners(handle, [trio.SocketListener(sock)])
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class _Slot:
    """One token of a CapacityLimiter, which may move to another (a request found to be a long poll)."""

    def __init__(self, limiter: trio.CapacityLimiter):
        self._limiter = limiter
        self._held: trio.CapacityLimiter | None = None

    async def __aenter__(self) -> "_Slot":
        await self._limiter.acquire()
        self._held = self._limiter
        return self

    async def move_to(self, limiter: trio.CapacityLimiter) -> None:
        assert self._held is not None
        self._held.release()
        self._held = None
        await limiter.acquire()
        self._held = limiter

    async def __aexit__(self, *exc) -> None:
        if self._held is not None:
            self._held.release()


def _peer_uid(sock) -> int | None:
    """The uid of the process at the other end of a unix socket (None if the kernel does not say)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid
