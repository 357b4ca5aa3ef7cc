"""Tell systemd how the daemon is doing (``Type=notify`` units): sd_notify(3), without libsystemd.

systemd names a datagram socket in ``$NOTIFY_SOCKET`` (a path, or an
abstract name written with a leading ``@``); each state is one datagram of
``KEY=VALUE`` lines.  Nothing here may fail the daemon: without the variable
it does nothing, and a send that fails is logged and forgotten (systemd then
times the start out, which is its call to make, not ours).
"""

import logging
import os
import socket

from .._limits import SD_NOTIFY_TIMEOUT_S

log = logging.getLogger(__name__)

READY = "READY=1"  # the mount is up: units ordered After= this one may use it
STOPPING = "STOPPING=1"  # the session is ending; the drain follows


def notify(state: str) -> bool:
    """Send ``state`` to the service manager; whether it was sent (False: not run by one, or it failed)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # the Linux abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SD_NOTIFY_TIMEOUT_S)  # called on the trio thread: never wait long on a full socket
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("could not tell systemd %s through NOTIFY_SOCKET=%s: %s", state, os.environ["NOTIFY_SOCKET"], exc)
        return False
    return True
