"""A full backend reaches writers as ENOSPC; a lazy unmount ends the daemon at once.

Both used to leave writers blocked in the kernel (D state) for as long as
the backend stayed full, with the daemon unaware of an unmount meanwhile.
The backend and the spill dir are small tmpfs mounts of the test's own.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from mounting import aiturbo, wait_state

MiB = 1 << 20
WAIT_S = 60.0


@pytest.fixture
def tmpfs(tmp_path):
    """Factory: tmpfs(name, size_mib) -> path of a fresh tmpfs; all unmounted at teardown."""
    made = []

    def make(name: str, size_mib: int) -> str:
        path = tmp_path / name
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)], check=True)
        made.append(path)
        return str(path)

    yield make
    for path in reversed(made):
        subprocess.run(["umount", "-l", str(path)], check=False)


def resize(path: str, size_mib: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_mib}m", path], check=True)


# A checkpoint's writer: file after file of random bytes (zeros would all be one
# chunk), each closed (a file persists once closed); prints the errno it ended with.
_WRITER = """
import os, sys
d, n, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    try:
        with open(os.path.join(d, f"shard-{i}.bin"), "wb") as f:
            f.write(os.urandom(mib << 20))
    except OSError as e:
        print(i, e.errno, flush=True)
        sys.exit(1)
print(n, 0, flush=True)
"""


def writer(directory: str, files: int, mib: int = 4) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, directory, str(files), str(mib)],
                            stdout=subprocess.PIPE, text=True)


def outcome(proc: subprocess.Popen, timeout_s: float = WAIT_S) -> tuple[int, int]:
    """(files written, errno it stopped with: 0 if none) of a writer."""
    out, _ = proc.communicate(timeout=timeout_s)
    done, err = out.split()
    return int(done), int(err)


@pytest.fixture
def full_backend(tmpfs, make_mount, request):
    """A mount whose file:// backend and spill dir hold 16 MiB each, its pool 32 MiB."""
    backend, spill = tmpfs("backend", 16), tmpfs("spill", 16)
    # (the mounts go before the tmpfs: make_mount was set up first, torn down last)
    m = make_mount(f"file://{backend}", dram="32M", spill=spill, full_backend_wait="2",
                   drain_timeout="5", **getattr(request, "param", {}))
    return m, backend


def test_a_full_backend_reaches_writers_as_enospc_and_loses_nothing_staged(full_backend):
    m, backend = full_backend
    t0 = time.monotonic()
    w = writer(m.mountpoint, 40)  # 160 MiB: far more than backend + spill + pool
    try:
        done, err = outcome(w)
    finally:
        if w.poll() is None:
            w.kill()
            m.kill()
        w.wait()
    took = time.monotonic() - t0
    assert err == errno.ENOSPC and 0 < done < 40, (done, err)
    assert took < WAIT_S, f"the writer waited {took:.0f} s"
    log = m.log()
    assert "the backend is full" in log and "writers that need memory now get ENOSPC" in log, log[-3000:]
    status = json.loads(aiturbo("status", "--json", m.mountpoint).stdout)
    assert status["persist"]["backend_full_s"] >= 2
    # What was accepted (closed) is staged, not dropped: room in the backend, and it persists.
    resize(backend, 512)
    for i in range(done):
        assert wait_state(m.path(f"shard-{i}.bin"), "durable", WAIT_S) == "durable"
        assert os.path.getsize(os.path.join(backend, f"shard-{i}.bin")) == 4 * MiB
    # ... and writers wait for memory again instead of failing
    w = writer(os.path.join(m.mountpoint), 1, 48)
    assert outcome(w) == (1, 0)
    assert "the backend takes data again" in m.log()
    assert "BUG" not in m.log()


def test_a_lazy_unmount_ends_the_daemon_while_a_writer_waits(tmpfs, make_mount):
    """A writer blocked in a write the pool cannot take (the backend is full,
    and ENOSPC is an hour off) keeps the lazily unmounted superblock alive:
    the daemon must still notice the unmount, end the session and drain."""
    backend, spill = tmpfs("backend", 8), tmpfs("spill", 8)
    m = make_mount(f"file://{backend}", dram="32M", spill=spill, full_backend_wait="3600", drain_timeout="3")
    w = writer(m.mountpoint, 40)
    try:
        deadline = time.monotonic() + WAIT_S
        while (pool := json.loads(aiturbo("status", "--json", m.mountpoint).stdout)["pool"])["waiting_writers"] == 0:
            assert time.monotonic() < deadline, f"the writer never waited for memory: {pool}"
            assert w.poll() is None, w.stdout.read()
            time.sleep(0.2)
        t0 = time.monotonic()
        subprocess.run(["umount", "-l", m.mountpoint], check=True)
        code = m.proc.wait(60)
        took = time.monotonic() - t0
        assert took < 30, f"the daemon took {took:.0f} s to notice the unmount"
        assert code == 1  # the drain timed out: the backend is full (the staged data stays in the spill dir)
        log = m.log()
        assert "is no longer mounted (lazy unmount?): ending the session and draining" in log, log[-3000:]
        assert "FUSE requests still running" in log and "drain timed out" in log, log[-3000:]
        w.wait(30)
        assert w.returncode != 0  # its session is gone
    finally:
        if w.poll() is None:
            w.kill()  # blocked in the kernel until the daemon answers: end the daemon first
            m.kill()
        w.wait()


def test_writers_waiting_for_memory_leave_room_for_other_requests(tmpfs, s3m):
    """D9: pyfuse3 handled 99 requests at once; 99 writers waiting for memory
    (S3 not answering, the spill dir full) stalled every other request of
    every process: a stat, a listing, the close that would free memory."""
    spill = tmpfs("spill", 1)
    m = s3m.mount(dram="16M", spill=spill, drain_timeout="60")
    os.listdir(m.mountpoint)
    s3m.server.freeze()  # nothing becomes durable: the pool stays full
    writers, errors = [], []

    def write(i: int) -> None:
        try:
            with open(m.path(f"w{i:03d}.bin"), "wb") as f:
                f.write(os.urandom(MiB))
        except OSError as e:
            errors.append(e)

    try:
        for i in range(110):
            t = threading.Thread(target=write, args=(i,), daemon=True)
            t.start()
            writers.append(t)
        deadline = time.monotonic() + WAIT_S
        # 95 of them: more than pyfuse3's own limit leaves room for, fewer than it allows
        while json.loads(aiturbo("status", "--json", m.mountpoint).stdout)["pool"]["waiting_writers"] < 95:
            assert time.monotonic() < deadline, "the writers never waited for memory"
            time.sleep(0.2)
        answered = threading.Event()
        threading.Thread(target=lambda: (os.stat(m.path("")), os.listdir(m.mountpoint), answered.set()),
                         daemon=True).start()
        assert answered.wait(10), "a stat and a listing waited behind the writers"
    finally:
        s3m.server.thaw()
    deadline = time.monotonic() + WAIT_S * 2
    for t in writers:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not errors and not any(t.is_alive() for t in writers), errors
    for i in range(110):
        assert wait_state(m.path(f"w{i:03d}.bin"), "durable", WAIT_S) == "durable"
