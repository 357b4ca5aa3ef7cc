"""The suite's mounts and clusters: the data paths they run on, the fixtures that start them, their cleanup.

The session's machinery (the servers, the async runner, the markers) is tests/plugin.py.
"""

import os

import pytest
from cluster import Cluster
from mounting import DATAPATH, STAGING_DIRS, TEST_LOGS, Mount, S3Mounts, mount_points, staging_of, wipe_staging

from aiturbofs.fuse import probe_passthrough

# The conformance modules run on both FUSE data paths: the kernel-protocol session (with passthrough
# where this host has it) and pyfuse3.  The rest (cluster, faults, outages, recovery, backends: the
# layers below the FUSE edge) run once, on the default data path (AITURBOFS_TEST_DATAPATH, else auto).
# A test of those modules that mounts nothing (it drives the pool or a Filesystem in-process) runs once.
BOTH_DATAPATHS = {"test_posix", "test_clients", "test_reads", "test_sparse", "test_security", "test_races",
                  "test_durability", "test_fuzz", "test_model", "test_staging",
                  "test_integrity", "test_torture"}
KERNEL_DATAPATH = "passthrough" if os.geteuid() == 0 and probe_passthrough().available else "kernel"


def pytest_generate_tests(metafunc):
    if metafunc.module.__name__ in BOTH_DATAPATHS and "make_mount" in metafunc.fixturenames:
        metafunc.parametrize("datapath", [KERNEL_DATAPATH, "pyfuse3"], indirect=True)


@pytest.fixture
def daemon_data_path(datapath):
    """For a test of what the daemon does with each READ or WRITE: with passthrough they never reach it."""
    if datapath == "passthrough":
        pytest.skip("checks the READ/WRITE requests the daemon serves; with passthrough the kernel serves them "
                    "itself (tests/fuse/test_passthrough.py covers that path)")
    return datapath


@pytest.fixture(autouse=True)
def datapath(request):
    """The FUSE data path of the test's mounts (see BOTH_DATAPATHS)."""
    chosen = getattr(request, "param", None) or os.environ.get("AITURBOFS_TEST_DATAPATH", "auto")
    DATAPATH[0] = chosen
    yield chosen
    DATAPATH[0] = os.environ.get("AITURBOFS_TEST_DATAPATH", "auto")


# A failed test's report ends with the tail of each daemon log it made: CI keeps only the output.
LOG_TAIL_LINES = 60
LOG_TAIL_LOGS_MAX = 3


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    TEST_LOGS.clear()  # before the test's fixtures start their mounts


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.when not in ("setup", "call"):
        return
    shown = str(report.longrepr)
    for path in TEST_LOGS[-LOG_TAIL_LOGS_MAX:]:
        if path in shown:
            continue  # the test's own message has that log (the cluster tests' ``logs()``)
        try:
            with open(path, errors="replace") as f:
                tail = f.readlines()[-LOG_TAIL_LINES:]
        except OSError:
            continue
        report.sections.append((f"daemon log {path} (last {len(tail)} lines)", "".join(tail)))


def _staging_tmpfs_mounts() -> set[str]:
    """Mount points of the staging tmpfs daemons mount for themselves (source ``aiturbofs-staging``)."""
    return mount_points("tmpfs", "aiturbofs-staging")


@pytest.fixture(autouse=True)
def _remove_staging_dirs(request):
    """Remove the staging dirs (on the DRAM tmpfs) of the test's mounts: a crash test leaves its own.

    Only the dirs of this session's mounts: another test session on the
    machine, or a daemon of the machine, has its own there, and they are
    never touched.  A staging tmpfs that appeared during the test, is left
    after it, and is named after a state dir in the test's temporary
    directory was left behind by a daemon of the test that no ``Mount``
    knew (a failed mount must not leave one): that fails the test.
    """
    before = _staging_tmpfs_mounts()
    yield
    while STAGING_DIRS:
        wipe_staging(STAGING_DIRS.pop())
    new = _staging_tmpfs_mounts() - before
    roots = [str(request.getfixturevalue("tmp_path"))] if new and "tmp_path" in request.fixturenames else []
    leaked = staging_of(new, roots)
    for path in leaked:
        wipe_staging(path)
    assert not leaked, f"a daemon left its staging tmpfs mounted: {sorted(leaked)}"


@pytest.fixture
def local_backend(tmp_path):
    d = tmp_path / "backend"
    d.mkdir()
    return d


@pytest.fixture
def make_mount(tmp_path):
    """Factory: make_mount(backend_url=None, **options) -> started Mount; all stopped at teardown."""
    mounts = []

    def factory(backend: str | None = None, *, name: str = "m", env: dict | None = None, **options) -> Mount:
        if backend is None:
            (tmp_path / "backend").mkdir(exist_ok=True)
            backend = f"file://{tmp_path / 'backend'}"
        m = Mount(backend, str(tmp_path / f"{name}-mnt"), str(tmp_path / f"{name}-state"), options, env=env)
        mounts.append(m)
        return m.start()

    yield factory
    errors = []
    for m in mounts:
        try:
            m.stop()
        except Exception as exc:  # noqa: BLE001 - stop the others, then report
            errors.append(exc)
            m.kill()
    if errors:
        raise errors[0]


@pytest.fixture
def mnt(make_mount):
    """One mount over a local backend dir with the default options."""
    return make_mount()


@pytest.fixture
def s3(s3_outage_server, make_mount):
    """The module's S3 server, running again (with its buckets) after the test.

    Depends on ``make_mount`` so that it is torn down first: the mounts'
    unmount then drains to a running server.
    """
    yield s3_outage_server
    s3_outage_server.thaw()
    s3_outage_server.start()


@pytest.fixture
def s3m(s3, make_mount) -> S3Mounts:
    """Mounts of a fresh bucket of the module's S3 server (``s3``)."""
    return S3Mounts(s3, make_mount)


@pytest.fixture
def make_cluster(pg_server, s3_server, tmp_path, request):
    """Factory: make_cluster(**Cluster kwargs) -> started Cluster; all torn down after the test.

    When the test failed, the tails of every daemon's log are printed (they
    show up under "Captured stdout teardown"); the full logs stay in tmp_path.
    """
    clusters: list[Cluster] = []
    failed_before = request.session.testsfailed

    def factory(**kwargs) -> Cluster:
        c = Cluster(str(tmp_path / f"c{len(clusters)}"), pg=pg_server, s3=s3_server, **kwargs)
        clusters.append(c)
        return c.start()

    yield factory
    for c in clusters:
        if request.session.testsfailed > failed_before:
            print(f"\n----- logs of the cluster in {c.root}\n{c.logs()}")
        c.close()
        if c.teardown_notes:
            print(f"teardown of {c.root}: {c.teardown_notes}")
