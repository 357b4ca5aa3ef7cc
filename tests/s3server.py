"""A moto S3 server on loopback, for tests.

``S3Server`` runs moto's standalone server (the ``moto_server`` entry point,
started with this interpreter as ``python -m moto.server``) in its own
process group on a fixed port, so tests can ``stop()`` it to simulate an
outage and ``start()`` it again on the SAME port.  moto keeps everything in
memory: a restarted server has no buckets and no objects.

The test process talks to it with the dummy credentials ``testing`` that
``start()`` puts into ``os.environ`` (the boto credential chain reads them).
``s3_server`` is a session-scoped pytest fixture (import it into a conftest
or test module) that yields a started server and always stops it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0  # moto imports a lot before it listens
STOP_TIMEOUT_S = 5.0  # SIGTERM grace before SIGKILL
POLL_S = 0.05
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class S3Server:
    """One moto server process; ``endpoint`` stays valid across stop/start."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)
        self.log_path = self._log.name

    def start(self) -> S3Server:
        """Start the server (a no-op if running) and wait until it answers HTTP."""
        os.environ.update(CREDENTIALS)
        if self.running:
            return self
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **CREDENTIALS},
            start_new_session=True,  # its own process group: stop() reaches any child too
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill the server and wait for it; a no-op if it is not running."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self):
        """A botocore S3 client for the server (for setup and inspection)."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            verify=False,  # plain HTTP: keep AWS_CA_BUNDLE out of it
        )

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (at least 3 characters) and return the name."""
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server for good and remove its log."""
        self.stop()
        self._log.close()
        try:
            os.unlink(self.log_path)
        except FileNotFoundError:
            pass

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode}: {self._log_tail()}")
            if _answers_http(self.port):
                return
            time.sleep(POLL_S)
        raise RuntimeError(f"moto server on port {self.port} not ready after {START_TIMEOUT_S} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the group we created in start()
        except ProcessLookupError:
            pass


def _answers_http(port: int) -> bool:
    """True once anything answers an HTTP request (moto returns 403/200 to GET /)."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")
            return sock.recv(16).startswith(b"HTTP/")
    except OSError:
        return False


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto server for the whole test session, stopped even when tests fail."""
    server = S3Server()
    try:
        yield server.start()
    finally:
        server.close()
