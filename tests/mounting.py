"""Start and stop real aiturbofs mounts for tests.

``Mount`` runs ``mount.aiturbo -f`` as a child process on a temp dir and
waits until the kernel mount is up.  ``stop()`` unmounts (the daemon then
drains its persist queue and exits) and, whatever happens, kills the process
and lazily unmounts, so a failing test never leaves a mount behind.

``aiturbo`` runs the CLI of this checkout (``aiturbo_proc`` in the
background); ``state``, ``wait_state`` and ``status`` are what a mount says of
a file and of itself; ``assert_no_bug`` checks a daemon's log.
"""

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time

from s3server import OutageS3Server

from aiturbofs.node._paths import default_staging_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGING_DIRS: set[str] = set()  # of every Mount made: conftest removes them after each test


def is_mounted(path: str) -> bool:
    return path in mount_points()


# The data path mounts use unless a test asks for one: set per test by conftest's ``datapath`` fixture.
DATAPATH = [os.environ.get("AITURBOFS_TEST_DATAPATH", "auto")]
# The logs of the daemons the running test started (conftest shows their tails when it fails).
TEST_LOGS: list[str] = []


class Mount:
    def __init__(self, backend: str, mountpoint: str, state_dir: str, options: dict | None = None, env: dict | None = None):
        self.backend = backend
        self.mountpoint = os.path.abspath(mountpoint)
        self.state_dir = state_dir
        # the FUSE data path: the test's own choice, else the session's (the ``datapath`` fixture), else auto
        self.options = {"state_dir": state_dir, "import_ttl": "0.5", "datapath": DATAPATH[0], **(options or {})}
        self.env = env
        self.proc: subprocess.Popen | None = None
        # the daemon's default: a dir on the DRAM tmpfs named after the state dir
        self.staging_dir = self.options.get("staging") or default_staging_dir(state_dir)
        STAGING_DIRS.add(self.staging_dir)
        self.log_path = os.path.join(os.path.dirname(state_dir.rstrip("/")), os.path.basename(state_dir.rstrip("/")) + ".log")
        if self.log_path not in TEST_LOGS:
            TEST_LOGS.append(self.log_path)

    def option_string(self) -> str:
        return ",".join(k if v is True else f"{k}={v}" for k, v in self.options.items() if v is not False)

    def start(self, timeout_s: float = 30.0, *, wait: bool = True) -> "Mount":
        """Start the daemon; with ``wait``, return once the kernel mount is up."""
        os.makedirs(self.mountpoint, exist_ok=True)
        cmd = [sys.executable, "-m", "aiturbofs.cli.mount", self.backend, self.mountpoint, "-f", "-o", self.option_string()]
        env = {**os.environ, "PYTHONPATH": REPO, **(self.env or {})}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if not wait:
            return self
        deadline = time.monotonic() + timeout_s
        while not is_mounted(self.mountpoint):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mount.aiturbo exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mount did not come up in {timeout_s} s:\n{self.log()}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-20000:]
        except FileNotFoundError:
            return ""

    def path(self, *parts: str) -> str:
        return os.path.join(self.mountpoint, *parts)

    def stop(self, timeout_s: float = 120.0) -> int:
        """Unmount and wait for the daemon to drain and exit; returns its exit code."""
        if self.proc is None:
            return 0
        try:
            if is_mounted(self.mountpoint):
                subprocess.run(["fusermount3", "-u", self.mountpoint], check=False, capture_output=True)
                if is_mounted(self.mountpoint):
                    self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """kill -9 the daemon (a crash) and clear the dead mount."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], check=False, capture_output=True)
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None

    def wipe_staging(self) -> None:
        """What a power cut does: the staging dir on the DRAM tmpfs is gone, and (the worst case) so are the
        backing files on disk of files the kernel wrote, which are never fsynced (the spill store's are)."""
        wipe_staging(self.staging_dir)
        spill = self.options.get("spill") or os.path.join(self.state_dir, "spill")
        shutil.rmtree(os.path.join(spill, "files"), ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class S3Mounts:
    """One fresh bucket per test; mounts of ``s3://bucket/pre`` (the fixture ``s3m``)."""

    def __init__(self, server: OutageS3Server, make_mount):
        self.server = server
        self.make_mount = make_mount
        self.bucket = server.make_bucket(f"t-{secrets.token_hex(6)}")
        self.url = f"s3://{self.bucket}/pre"

    def mount(self, name: str = "m", **options):
        return self.make_mount(self.url, name=name, s3_endpoint=self.server.endpoint, **options)

    def objects(self) -> dict[str, bytes]:
        return self.server.objects(self.bucket, "pre/")


def wipe_staging(path: str) -> None:
    """Remove a staging dir, unmounting the tmpfs the daemon mounted there (lazily: a killed daemon left it)."""
    if is_mounted(os.path.abspath(path)):
        subprocess.run(["umount", "-l", path], check=False, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def mount_points(fstype: str | None = None, source: str | None = None) -> set[str]:
    """The mount points this process sees; with ``fstype`` and ``source``, only the mounts of that type and source."""
    points = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            rest = fields[fields.index("-") + 1:]  # the file system type, the source, the super block options
            if fstype is None or (rest[0] == fstype and rest[1] == source):
                points.add(fields[4])
    return points


def staging_of(candidates: set[str], roots: list[str], depth: int = 3) -> set[str]:
    """Which of ``candidates`` (staging dirs) are named after a state dir at most ``depth`` levels under ``roots``.

    A daemon's default staging dir is named after its state dir
    (``default_staging_dir``): one whose state dir is none of this test's
    belongs to another test session, or to a daemon of the machine.  The
    walk follows no symlink and enters no mount point (a stuck FUSE mount
    must not hang it).
    """
    if not candidates:
        return set()
    skip = mount_points()
    found = set()
    stack = [(os.path.abspath(root), 0) for root in roots]
    while stack:
        path, level = stack.pop()
        if default_staging_dir(path) in candidates:
            found.add(default_staging_dir(path))
        if level >= depth:
            continue
        try:
            with os.scandir(path) as entries:
                stack += [(e.path, level + 1) for e in entries if e.path not in skip and e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
    return found


def aiturbo(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the ``aiturbo`` CLI of this checkout."""
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "aiturbofs.cli.main", *args], capture_output=True, text=True,
                          check=check, env=env, timeout=timeout)


def aiturbo_proc(*args: str) -> subprocess.Popen:
    """``aiturbo ARGS`` running in the background (``aiturbo`` waits for it)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, "-m", "aiturbofs.cli.main", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def status(m: Mount) -> dict:
    """``aiturbo status --json`` of the mount ``m``."""
    return json.loads(aiturbo("status", m.mountpoint, "--json").stdout)


def assert_no_bug(log: str) -> None:
    """No "BUG in <handler>" / "BUG while persisting": the daemon's own errors."""
    match = re.search(r"\bBUG\b.*", log)
    assert match is None, f"{match.group(0)}\n...\n{log[-3000:]}"


def state(path: str) -> str:
    return os.getxattr(path, "user.aiturbo.state").decode()


def wait_state(path: str, want: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        s = state(path)
        if s == want or time.monotonic() > deadline:
            return s
        time.sleep(0.05)
