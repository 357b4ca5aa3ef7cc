"""Readiness under systemd (``Type=notify``): READY=1 once the mount is up, STOPPING=1 when the drain begins.

Each test binds the datagram socket systemd would (``$NOTIFY_SOCKET``) and
reads what the daemon sends there.
"""

import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest
from mounting import REPO, Mount, is_mounted

from aiturbofs.node import _sdnotify

SETTLE_S = 60.0  # a daemon's start or stop on this machine, generously


class NotifySocket:
    """A bound ``AF_UNIX`` datagram socket, named as ``$NOTIFY_SOCKET`` names it (abstract: ``@name``)."""

    def __init__(self, path: str | None = None):
        self.name = path or f"@aiturbofs-test-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:] if self.name.startswith("@") else self.name)

    def receive(self, timeout_s: float = SETTLE_S) -> bytes:
        self.sock.settimeout(timeout_s)
        return self.sock.recv(4096)

    def nothing_more(self, within_s: float = 0.5) -> bool:
        try:
            self.receive(within_s)
        except TimeoutError:
            return True
        return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- the function


def test_notify_does_nothing_without_a_service_manager(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert _sdnotify.notify(_sdnotify.READY) is False


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_notify_sends_one_datagram(kind, monkeypatch, tmp_path):
    with NotifySocket(str(tmp_path / "n.sock") if kind == "path" else None) as listener:
        monkeypatch.setenv("NOTIFY_SOCKET", listener.name)
        assert _sdnotify.notify(_sdnotify.READY) is True
        assert listener.receive(5) == b"READY=1"


def test_a_failed_notify_is_logged_not_raised(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    with caplog.at_level(logging.WARNING):
        assert _sdnotify.notify(_sdnotify.STOPPING) is False
    assert "STOPPING=1" in caplog.text and "nobody-listens.sock" in caplog.text


# ---------------------------------------------------------------- the daemon


def _mount(tmp_path, env: dict) -> Mount:
    (tmp_path / "backend").mkdir(exist_ok=True)
    return Mount(f"file://{tmp_path / 'backend'}", str(tmp_path / "mnt"), str(tmp_path / "state"), env=env)


@pytest.mark.parametrize("stop", ["sigterm", "umount"])
def test_ready_once_mounted_and_stopping_when_the_drain_begins(stop, tmp_path):
    with NotifySocket() as listener:
        m = _mount(tmp_path, {"NOTIFY_SOCKET": listener.name})
        try:
            m.start(wait=False)
            assert listener.receive() == b"READY=1", m.log()  # the first thing said
            assert is_mounted(m.mountpoint), "READY=1 came before the mount was up"
            with open(m.path("f.bin"), "wb") as f:
                f.write(os.urandom(1 << 20))
            if stop == "sigterm":
                m.proc.send_signal(signal.SIGTERM)
            else:
                subprocess.run(["fusermount3", "-u", m.mountpoint], check=True, capture_output=True)
            assert listener.receive() == b"STOPPING=1", m.log()
            assert m.proc.wait(timeout=SETTLE_S) == 0, m.log()
            assert listener.nothing_more(), "told systemd more than once"
            assert (tmp_path / "backend" / "f.bin").stat().st_size == 1 << 20  # drained after STOPPING=1
        finally:
            m.kill()


def test_a_daemonized_mount_leaves_readiness_to_its_parent(tmp_path):
    """Without -f the parent's exit says the mount is up; the forked daemon is not the unit's main process."""
    with NotifySocket() as listener:
        m = _mount(tmp_path, {})
        env = dict(os.environ, PYTHONPATH=REPO, NOTIFY_SOCKET=listener.name)
        os.makedirs(m.mountpoint)
        r = subprocess.run([sys.executable, "-m", "aiturbofs.cli.mount", m.backend, m.mountpoint, "-o",
                            m.option_string()], capture_output=True, text=True, env=env, timeout=SETTLE_S)
        try:
            assert r.returncode == 0, r.stderr
            assert is_mounted(m.mountpoint)
            assert listener.nothing_more(1.0)
        finally:
            subprocess.run(["fusermount3", "-u", m.mountpoint], check=False, capture_output=True)
        deadline = time.monotonic() + SETTLE_S
        while subprocess.run(["pgrep", "-f", f"{m.mountpoint} "], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the daemon did not exit after umount"
            time.sleep(0.1)
        assert listener.nothing_more(0.1)


def test_controller_is_ready_once_it_listens(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(secrets.token_hex(32).encode())
    secret.chmod(0o600)
    with NotifySocket() as listener, open(tmp_path / "controller.log", "w") as log:
        env = dict(os.environ, PYTHONPATH=REPO, NOTIFY_SOCKET=listener.name)
        proc = subprocess.Popen([sys.executable, "-m", "aiturbofs.cli.main", "controller", "--listen", "127.0.0.1:0",
                                 "--meta", f"sqlite:///{tmp_path}/c.db", "--secret-file", str(secret),
                                 "--metrics", "off"], stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        try:
            assert listener.receive() == b"READY=1"
            line = proc.stdout.readline()  # printed before READY=1
            address = re.search(r"controller listening on (\S+):(\d+)", line)
            assert address, line
            socket.create_connection((address[1], int(address[2])), timeout=5).close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=SETTLE_S) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
