"""The test suite's pytest plugin: the servers its tests share.

Registered for every run by pyproject.toml (``-p plugin``, with ``tests`` on
``pythonpath``), so a test module never imports a fixture by name.

- ``s3_server``: one moto S3 for the session.
- ``s3_outage_server``: one per module, for tests that stop and freeze it.
- ``pg_server``: one PostgreSQL for the session.

Free loopback ports come from ``loopback.free_port``.
"""

from __future__ import annotations

import os

# Before aiturbofs is imported (this plugin is loaded before any conftest or test module): the pool in
# this process, and the daemons the tests start, check the staging invariant at every hand-out
# (aiturbofs._limits.CHECK_INVARIANTS).
os.environ.setdefault("AITURBOFS_CHECK_INVARIANTS", "1")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")

from collections.abc import Iterator  # noqa: E402

import pgserver  # noqa: E402
import pytest  # noqa: E402
from pgserver import PgServer  # noqa: E402
from s3server import OutageS3Server, S3Server  # noqa: E402

# ----------------------------------------------------------------------- servers


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto server for the whole test session, stopped even when tests fail."""
    server = S3Server()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="module")
def s3_outage_server() -> Iterator[OutageS3Server]:
    """A moto server of the module's own, for tests that stop, freeze and restart it."""
    server = OutageS3Server()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A PostgreSQL server for the whole test session, stopped even when tests fail."""
    if not pgserver.installed():
        pytest.skip(pgserver.SKIP_REASON)
    server = PgServer()
    try:
        yield server.start()
    finally:
        server.stop()
