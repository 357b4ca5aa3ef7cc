"""A moto S3 server on loopback, for tests.

``S3Server`` runs moto's standalone server (the ``moto_server`` entry point,
started with this interpreter as ``python -m moto.server``) in its own
process group on a fixed port, so tests can ``stop()`` it to simulate an
outage and ``start()`` it again on the SAME port.  moto keeps everything in
memory: a restarted server has no buckets and no objects.

The test process talks to it with the dummy credentials ``testing`` that
``start()`` puts into ``os.environ`` (the boto credential chain reads them).
The tests get servers from the fixtures ``s3_server`` and ``s3_outage_server``
(tests/plugin.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from loopback import HOST, free_port

START_TIMEOUT_S = 30.0  # moto imports a lot before it listens
STOP_TIMEOUT_S = 5.0  # SIGTERM grace before SIGKILL
POLL_S = 0.05
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


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
            self._argv(),
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

    def _argv(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)]

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


# moto, with buckets created in-process before it listens: a persist retry that lands between
# "listening" and "bucket re-created" would get NoSuchBucket, a permanent error, and mark the
# file broken.
_PRELOADED_MOTO = """
import sys
from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
for name in sys.argv[3:]:
    s3_backends[DEFAULT_ACCOUNT_ID]["global"].create_bucket(name, "us-east-1")
from moto.server import main
main(["-H", sys.argv[1], "-p", sys.argv[2]])
"""


class OutageS3Server(S3Server):
    """An ``S3Server`` whose ``start()`` brings back every bucket made so far (empty).

    For tests of backend outages: ``stop()`` then ``start()`` is a refusing
    server, ``freeze()`` then ``thaw()`` an unresponsive one that keeps its data.
    """

    def __init__(self) -> None:
        super().__init__()
        self.buckets: list[str] = []

    def _argv(self) -> list[str]:
        # its start() brings back the buckets made so far
        return [sys.executable, "-c", _PRELOADED_MOTO, HOST, str(self.port), *self.buckets]

    def freeze(self) -> None:
        """SIGSTOP: an outage that keeps the data (requests hang, then time out)."""
        self._signal_group(self._proc, signal.SIGSTOP)

    def thaw(self) -> None:
        if self._proc is not None:
            self._signal_group(self._proc, signal.SIGCONT)

    def make_bucket(self, name: str) -> str:
        self.buckets.append(name)
        return super().make_bucket(name)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix`` (key relative to it) -> its bytes; the
        zero-byte ``dir/`` markers of directories (docs/design.md) left out."""
        c = self.client()
        out = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", ()):
                if o["Key"].endswith("/"):
                    continue
                out[o["Key"][len(prefix):]] = c.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        return out
