"""The loopback address the tests' servers listen on, and free ports on it.

Kept apart from the pytest plugin: the server helpers that use it
(``s3server``, ``pgserver``, ``cluster``) are imported by benchmarks/ too,
where no test session runs.
"""

import socket

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A port nothing listens on right now (the OS picks it).

    Only right now: another process may take it before the caller binds it
    (``PgServer`` and the cluster's fabric ports try again with a fresh one).
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
