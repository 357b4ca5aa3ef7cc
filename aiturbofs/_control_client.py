"""The control socket's client side: where a mount's daemon listens, and one blocking request.

No trio and nothing of the daemon: ``import aiturbofs`` (its ``wait``) and
the ``aiturbo`` command use it.  The server side is ``node/_control.py``.
"""

import json
import os
import socket

from ._limits import CONTROL_CALL_TIMEOUT_S

RUN_ROOT = "/run/aiturbo"


def mount_id(mountpoint: str) -> str:
    """A stable, readable, collision-free name for a mount point."""
    import blake3

    path = os.path.abspath(mountpoint)
    readable = path.strip("/").replace("/", "-")[-48:] or "root"
    return f"{readable}-{blake3.blake3(path.encode()).hexdigest()[:8]}"


def control_socket(mountpoint: str) -> str:
    return os.path.join(RUN_ROOT, mount_id(mountpoint) + ".sock")


def mount_points(dev: int | None = None) -> list[str]:
    """Mount points of the FUSE filesystems in this mount namespace; with ``dev`` (a file's ``st_dev``),
    only where that one is mounted."""
    want = None if dev is None else f"{os.major(dev)}:{os.minor(dev)}"
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if (want is None or fields[2] == want) and fields[fields.index("-") + 1].startswith("fuse"):
                points.append(fields[4].encode().decode("unicode_escape"))
    return points


def call(path: str, request: dict, timeout_s: float = CONTROL_CALL_TIMEOUT_S) -> dict:
    """Send ``request``, return the daemon's answer (blocking)."""
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
