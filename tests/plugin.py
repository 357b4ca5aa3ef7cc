"""The test suite's pytest plugin: how async tests run, what a test needs of the machine, the shared servers.

Registered for every run by pyproject.toml (``-p plugin``, with ``tests`` on
``pythonpath``), so a test module never imports a fixture by name.

- Async tests (``async def test_...``) run under trio, through anyio's pytest
  plugin (``anyio_mode = "auto"``, and ``anyio_backend`` below says trio);
  so do async fixtures.  ``@pytest.mark.fail_after(seconds)`` bounds an
  async test as ``trio.fail_after`` would: a lost wakeup fails the test
  instead of hanging the suite.
- Markers (registered in pyproject.toml): ``fuse`` (mounts a FUSE
  filesystem), ``root``, ``cluster`` (several daemons and a controller),
  ``slow``.  A test that uses a mount fixture (``FUSE_FIXTURES``) is marked
  ``fuse`` here, and one that uses ``make_cluster`` also ``cluster``; a
  module whose tests mount in another way says so with ``pytestmark``.  On a
  machine without FUSE the ``fuse`` tests are skipped, saying why, and the
  rest run; ``root`` tests (``@pytest.mark.root("what needs it")``) are
  skipped when not run as root.
- The servers: ``s3_server`` (one moto S3 for the session),
  ``s3_outage_server`` (one per module, for tests that stop and freeze it)
  and ``pg_server`` (one PostgreSQL for the session).  Free loopback ports
  come from ``loopback.free_port``.

It never mounts anything itself: the mount fixtures are conftest.py's.
"""

from __future__ import annotations

import os

# Before aiturbofs is imported (this plugin is loaded before any conftest or test module): the pool in
# this process, and the daemons the tests start, check the staging invariant at every hand-out
# (aiturbofs._limits.CHECK_INVARIANTS).
os.environ.setdefault("AITURBOFS_CHECK_INVARIANTS", "1")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")

import functools  # noqa: E402
import inspect  # noqa: E402
import shutil  # noqa: E402
import stat  # noqa: E402
from collections.abc import Generator, Iterator  # noqa: E402

import pgserver  # noqa: E402
import pytest  # noqa: E402
import trio  # noqa: E402
from pgserver import PgServer  # noqa: E402
from s3server import OutageS3Server, S3Server  # noqa: E402

# Fixtures whose tests mount a FUSE filesystem (conftest.py), and those that start a cluster.
FUSE_FIXTURES = frozenset({"make_mount", "mnt", "make_cluster"})
CLUSTER_FIXTURES = frozenset({"make_cluster"})

FUSE_DEVICE = "/dev/fuse"
FUSE_DEVICE_NUMBER = (10, 229)  # the kernel's misc device FUSE_MINOR


def fuse_missing() -> str | None:
    """Why this machine cannot mount FUSE filesystems, or None when it can."""
    try:
        st = os.stat(FUSE_DEVICE)
    except OSError as exc:
        return f"no {FUSE_DEVICE} ({exc.strerror}): load the fuse module, or pass the device into the container"
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != FUSE_DEVICE_NUMBER:
        return f"{FUSE_DEVICE} is not the FUSE device"
    try:
        os.close(os.open(FUSE_DEVICE, os.O_RDWR | os.O_CLOEXEC))  # opening alone makes no connection
    except OSError as exc:
        return f"cannot open {FUSE_DEVICE}: {exc.strerror}"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


# ----------------------------------------------------------------------- markers


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & FUSE_FIXTURES:
            item.add_marker(pytest.mark.fuse)
        if used & CLUSTER_FIXTURES:
            item.add_marker(pytest.mark.cluster)
    no_fuse = fuse_missing()
    not_root = os.geteuid() != 0
    for item in items:
        if no_fuse and item.get_closest_marker("fuse"):
            item.add_marker(pytest.mark.skip(reason=f"needs FUSE: {no_fuse}"))
        root = item.get_closest_marker("root")
        if not_root and root:
            item.add_marker(pytest.mark.skip(reason=f"needs root: {root.args[0]}" if root.args else "needs root"))


# ------------------------------------------------------------------- async tests


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """anyio's plugin runs every async test and async fixture on this backend.

    It overrides anyio's own fixture (every backend installed) because
    pyproject.toml loads anyio's plugin before this one.
    """
    return "trio"


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    """Run an async test marked ``fail_after(seconds)`` inside ``trio.fail_after(seconds)``."""
    marker = pyfuncitem.get_closest_marker("fail_after")
    test = pyfuncitem.obj
    if marker is None or not inspect.iscoroutinefunction(test):
        return (yield)

    @functools.wraps(test)
    async def bounded(*args, **kwargs):
        with trio.fail_after(*marker.args):
            return await test(*args, **kwargs)

    pyfuncitem.obj = bounded
    try:
        return (yield)
    finally:
        pyfuncitem.obj = test


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
