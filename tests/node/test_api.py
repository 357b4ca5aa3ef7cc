"""``aiturbofs.wait`` and ``aiturbofs.states`` on real mounts, as a training job calls them.

Persistence is held back by an S3 endpoint that is down (``FaultyS3Proxy``):
a file then stays staged for as long as the test wants, becomes durable once
the proxy is up again, or broken once ``persist_retry_window`` has passed.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import pytest
import trio
from faults import FaultyS3Proxy
from fileio import local_objects, put
from mounting import REPO, Mount, aiturbo, wait_state

import aiturbofs
from aiturbofs import _wait
from aiturbofs._limits import CONTROL_CLIENTS_MAX, WAIT_HELD_INOS, WAIT_SLICE_S
from aiturbofs.vfs._state_waits import StateWaits

MiB = 1 << 20
DURABLE_WAIT_S = 90.0
NOBODY = 65534


class HeldS3:
    """A fresh bucket behind a proxy the test takes down (persistence held) and brings up."""

    def __init__(self, server, make_mount):
        self.server = server
        self.make_mount = make_mount
        self.proxy = FaultyS3Proxy(server.port, seed=int.from_bytes(secrets.token_bytes(4), "big"))
        self.bucket = server.make_bucket(f"a-{secrets.token_hex(6)}")
        self.client = server.client()
        self.mounts: list = []

    def mount(self, **options):
        m = self.make_mount(f"s3://{self.bucket}/pre", s3_endpoint=self.proxy.endpoint, s3_connect_timeout="2",
                            **options)
        self.mounts.append(m)
        return m

    def hold(self) -> None:
        self.proxy.set(down=True)

    def release(self) -> None:
        self.proxy.set(down=False)

    def object(self, name: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"pre/{name}")["Body"].read()


@pytest.fixture
def held(s3_server, make_mount):
    h = HeldS3(s3_server, make_mount)
    try:
        yield h
    finally:
        h.release()
        try:
            for m in h.mounts:
                m.stop()  # drains through the proxy, which must still be there
        finally:
            h.proxy.close()


def meta_calls(m) -> dict[str, int]:
    """Transactions the daemon's metadata engine ran, by operation."""
    return json.loads(aiturbo("status", m.mountpoint, "--json").stdout)["meta"]["calls"]


def fuse_requests(m) -> int:
    """Requests the daemon's FUSE session has served (the kernel-protocol session counts them)."""
    return json.loads(aiturbo("status", m.mountpoint, "--json").stdout)["fuse"]["requests"]


# ------------------------------------------------------------------------------ file:// backend


def test_wait_returns_once_the_backend_holds_every_byte(make_mount, tmp_path):
    torch = pytest.importorskip("torch")
    m = make_mount()
    os.makedirs(m.path("ckpt", "step100", "shards"))
    files = {f"ckpt/step100/shards/{i}.bin": os.urandom(9 * MiB + i) for i in range(4)}
    for name, data in files.items():
        put(m.path(name), data)
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    torch.save(state, m.path("ckpt", "step100", "model.pt"))  # what the README shows
    seen = []
    aiturbofs.wait([m.path("ckpt", "step100")], progress=lambda done, total: seen.append((done, total)))
    backend = local_objects(tmp_path / "backend")  # right after it returned: nothing may still be on its way
    for name, data in files.items():
        assert backend.get(name) == data, name
    assert torch.load(tmp_path / "backend" / "ckpt" / "step100" / "model.pt")["w"].equal(state["w"])
    total = sum(map(len, files.values())) + os.path.getsize(m.path("ckpt", "step100", "model.pt"))
    assert seen and seen[-1] == (total, total) and all(t == total for _, t in seen), seen
    # (of what it waited for: ckpt itself may still be getting its mtime pushed, after step100 was written in it)
    now = aiturbofs.states(m.path("ckpt", "step100"))
    assert set(now) >= {m.path(name) for name in files} and set(now.values()) == {aiturbofs.DURABLE}, now


def test_wait_and_states_take_one_path_and_many_inodes_per_call(make_mount, tmp_path, monkeypatch):
    """Calls name at most WAIT_INOS_PER_CALL inodes: more files take more calls."""
    m = make_mount()
    monkeypatch.setattr(_wait, "WAIT_INOS_PER_CALL", 2)
    for i in range(5):
        put(m.path(f"f{i}.bin"), os.urandom(100_000 + i))
    os.link(m.path("f0.bin"), m.path("hard.bin"))  # one inode, two names
    aiturbofs.wait(m.path("f3.bin"))  # a single path, not a list
    aiturbofs.wait([m.path(name) for name in sorted(os.listdir(m.mountpoint))])
    backend = local_objects(tmp_path / "backend")
    assert all(f"f{i}.bin" in backend for i in range(5)), sorted(backend)
    now = aiturbofs.states([m.path("f0.bin"), m.path("hard.bin"), m.mountpoint])
    assert now[m.path("hard.bin")] == aiturbofs.DURABLE and len(now) == 6 and m.mountpoint not in now


def test_a_path_outside_aiturbofs_fails_before_any_waiting(tmp_path, mnt):
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"x")
    put(mnt.path("f.bin"), b"y")
    for paths in ([str(plain)], [mnt.path("f.bin"), str(plain)], [mnt.path("no-such-file")]):
        with pytest.raises(OSError) as caught:
            aiturbofs.wait(paths, timeout=30)
        assert not isinstance(caught.value, aiturbofs.NotDurable)
        assert caught.value.filename in (str(plain), mnt.path("no-such-file")), caught.value


def test_import_loads_neither_the_daemon_nor_trio():
    code = ("import sys, aiturbofs\n"
            "heavy = {'trio', 'pyfuse3', 'aiturbofs.node', 'aiturbofs.vfs', 'importlib.metadata'} & set(sys.modules)\n"
            "assert not heavy, heavy\n"
            "assert callable(aiturbofs.wait) and callable(aiturbofs.states)\n"
            "assert issubclass(aiturbofs.WaitTimeout, TimeoutError) and issubclass(aiturbofs.BrokenFiles, aiturbofs.NotDurable)\n"
            "print(aiturbofs.__version__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO),
                       timeout=60)
    assert r.returncode == 0, r.stderr
    from importlib.metadata import version

    assert r.stdout.strip() == version("aiturbofs")


def test_a_user_without_the_control_socket_waits_on_the_xattr(tmp_path):
    """The socket is root's: another user's process reads the state xattr instead, and gets there too."""
    base = tempfile.mkdtemp(prefix="aiturbofs-api-")  # a path other users may walk (tmp_path is root's)
    os.chmod(base, 0o755)
    (tmp_path / "backend").mkdir()
    m = Mount(f"file://{tmp_path / 'backend'}", os.path.join(base, "mnt"), str(tmp_path / "state")).start()
    try:
        data = os.urandom(3 * MiB)
        put(m.path("f.bin"), data)
        pid = os.fork()
        if pid == 0:  # everything it needs is imported: the interpreter's own files are root's
            code = 1
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                sources = {type(source).__name__ for source, _, _ in _wait._open_groups(_wait.targets_under([m.path("f.bin")]))}
                aiturbofs.wait(m.path("f.bin"), timeout=60)
                code = 0 if (sources, aiturbofs.states([m.path("f.bin")])) == ({"_Xattr"}, {m.path("f.bin"): "durable"}) else 2
            except BaseException:  # noqa: BLE001 - the exit code tells
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert (tmp_path / "backend" / "f.bin").read_bytes() == data
    finally:
        m.stop()
        os.rmdir(m.mountpoint)
        os.rmdir(base)


# ------------------------------------------------------------------------------ persistence held back


def test_states_does_not_wait_and_wait_returns_once_released(held):
    m = held.mount()
    held.hold()
    data = os.urandom(10 * MiB)
    put(m.path("f.bin"), data)
    t0 = time.monotonic()
    now = aiturbofs.states(m.path("f.bin"))
    assert time.monotonic() - t0 < 2.0, "states() blocked"
    assert now == {m.path("f.bin"): now[m.path("f.bin")]} and now[m.path("f.bin")] in ("staged", "persisting"), now
    box: dict = {}
    waiter = threading.Thread(target=lambda: box.update(result=_run(aiturbofs.wait, m.path("f.bin"))), daemon=True)
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive(), f"wait() returned while the backend was down: {box}"
    held.release()
    waiter.join(DURABLE_WAIT_S)
    assert not waiter.is_alive() and box["result"] is None, box
    assert held.object("f.bin") == data  # right after it returned
    assert aiturbofs.states([m.path("f.bin")]) == {m.path("f.bin"): "durable"}


def test_wait_sleeps_on_the_daemon_instead_of_reading_the_xattr(held):
    m = held.mount(datapath="kernel")  # the kernel-protocol session counts its requests
    held.hold()
    put(m.path("f.bin"), os.urandom(MiB))
    waiter = threading.Thread(target=aiturbofs.wait, args=(m.path("f.bin"),), kwargs={"timeout": 3 * WAIT_SLICE_S},
                              daemon=True)
    waiter.start()
    time.sleep(0.5)
    before = fuse_requests(m)
    time.sleep(2.0)  # reading the xattr, it would ask ten times
    assert fuse_requests(m) - before <= 2
    held.release()
    waiter.join(DURABLE_WAIT_S)
    assert not waiter.is_alive()


def test_a_wait_on_a_big_directory_lists_it_once_a_call_and_holds_few_files_a_call(held, monkeypatch):
    """A waiting call names at most WAIT_HELD_INOS files (the daemon reads each at the call's start), and
    the directory's symlinks and special files are listed once a call, not at every change of its state
    (the persister changes it at each file it publishes there: n files cost n^2 before)."""
    m = held.mount(datapath="kernel")
    held.hold()
    os.mkdir(m.path("d"))
    files = 3 * WAIT_HELD_INOS
    for i in range(files):
        put(m.path("d", f"f{i:04d}"), os.urandom(1000 + i))
    os.symlink("f0000", m.path("d", "link"))  # the directory has a state of its own: a target
    calls: list[tuple[int, float]] = []
    real_call = _wait._Daemon._call

    def counted(self, inos, timeout_s):
        calls.append((len(inos), timeout_s))
        return real_call(self, inos, timeout_s)

    monkeypatch.setattr(_wait._Daemon, "_call", counted)
    walked = meta_calls(m)
    _wait.targets_under([m.path("d")])  # what finding the files costs: the wait's walk lists d as well
    before = meta_calls(m)
    walk = before.get("readdir", 0) - walked.get("readdir", 0)
    box: dict = {}
    waiter = threading.Thread(target=lambda: box.update(result=_run(aiturbofs.wait, m.path("d"))), daemon=True)
    waiter.start()
    time.sleep(1.0)
    held.release()
    waiter.join(DURABLE_WAIT_S)
    assert not waiter.is_alive() and box["result"] is None, box
    done = meta_calls(m)
    assert aiturbofs.states(m.path("d")) == dict.fromkeys([m.path("d"), *(m.path("d", f"f{i:04d}") for i in range(files))],
                                                         aiturbofs.DURABLE)
    listed = {k: done.get(k, 0) - before.get(k, 0) for k in ("readdir", "nodes_with_state")}
    held_calls = [n for n, timeout_s in calls if timeout_s > 0]
    assert held_calls and max(held_calls) <= WAIT_HELD_INOS, calls
    # once a call (the state of the directory is read at most once a call), and no listing beyond that but
    # the wait's own walk (and an import's look at the directory, after import_ttl)
    assert listed["nodes_with_state"] <= len(calls) and listed["readdir"] <= 2 * walk + 2, (listed, walk, calls)


def test_timeout_names_what_is_not_durable_yet(held):
    m = held.mount()
    put(m.path("early.bin"), b"e" * 1000)
    aiturbofs.wait(m.path("early.bin"))
    held.hold()
    put(m.path("late.bin"), os.urandom(MiB))
    t0 = time.monotonic()
    with pytest.raises(aiturbofs.WaitTimeout) as caught:
        aiturbofs.wait(m.mountpoint, timeout=1.5)
    took = time.monotonic() - t0
    assert 1.5 <= took < 1.5 + WAIT_SLICE_S, took
    assert isinstance(caught.value, TimeoutError)
    assert caught.value.paths == [m.path("late.bin")]
    assert caught.value.states[m.path("late.bin")] in ("staged", "persisting")
    held.release()
    aiturbofs.wait(m.mountpoint, timeout=DURABLE_WAIT_S)  # and waiting again gets there


def test_broken_files_are_named_once_the_rest_is_durable(held):
    m = held.mount(persist_retry_window=1)
    good = os.urandom(1000)
    put(m.path("good.bin"), good)
    aiturbofs.wait(m.path("good.bin"))
    held.hold()
    put(m.path("bad.bin"), os.urandom(2 * MiB))
    with pytest.raises(aiturbofs.BrokenFiles) as caught:
        aiturbofs.wait([m.mountpoint], timeout=DURABLE_WAIT_S)
    assert caught.value.paths == [m.path("bad.bin")]
    assert caught.value.states == {m.path("bad.bin"): aiturbofs.BROKEN}
    assert "bad.bin" in str(caught.value)
    assert wait_state(m.path("bad.bin"), "broken") == "broken"
    assert aiturbofs.states(m.mountpoint) == {m.path("good.bin"): "durable", m.path("bad.bin"): "broken"}


def test_sleeping_waits_do_not_keep_other_requests_out(held):
    """More waits than the daemon serves requests at once (CONTROL_CLIENTS_MAX): status still answers."""
    m = held.mount()
    held.hold()
    put(m.path("f.bin"), os.urandom(MiB))
    waiters = [threading.Thread(target=_run, args=(aiturbofs.wait, m.path("f.bin"), 2 * WAIT_SLICE_S), daemon=True)
               for _ in range(CONTROL_CLIENTS_MAX + 4)]
    for waiter in waiters:
        waiter.start()
    time.sleep(1.0)  # every one asleep in the daemon
    t0 = time.monotonic()
    r = aiturbo("status", m.mountpoint, "--json", timeout=30)
    assert time.monotonic() - t0 < 2.5 and json.loads(r.stdout)["ok"]
    held.release()
    for waiter in waiters:
        waiter.join(DURABLE_WAIT_S)
        assert not waiter.is_alive()


def test_state_waits_see_every_change_and_forget_who_left():
    waits = StateWaits()

    async def main():
        with waits.watch(1) as changes:
            changes.add(2)
            waits.notify(2)  # before the wait: kept
            waits.notify(3)  # not watched
            assert await changes.wait() == {2}
            with trio.move_on_after(0.1) as idle:
                await changes.wait()
            assert idle.cancelled_caught
            async with trio.open_nursery() as nursery:
                nursery.start_soon(changes.wait)
                await trio.sleep(0.01)
                waits.notify(1)
            with waits.watch(1) as other:
                waits.notify(1)
                assert await other.wait() == {1} and await changes.wait() == {1}
        assert len(waits) == 0

    trio.run(main)


def _run(fn, *args):
    try:
        return fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return exc
