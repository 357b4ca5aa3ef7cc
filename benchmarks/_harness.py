"""Shared plumbing of the benchmark scripts: mounts, cleanup, tables, results.

Every mount or process made here is registered on an ``ExitStack`` by the
caller, so a failure, Ctrl-C or SIGTERM still unmounts, kills what was started
(by pid, never by name) and removes temp dirs.  The aiturbofs mount and the
moto server are the test suite's own helpers (``tests/mounting.py``,
``tests/s3server.py``), so benchmarks start them exactly as the tests do.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
MINIMAL_FS = os.path.join(BENCH_DIR, "minimal_fs.py")
MOUNT_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 600.0  # aiturbofs drains its persist queue at unmount
MiB = 1 << 20

sys.path.insert(0, os.path.join(REPO, "tests"))
from mounting import Mount, is_mounted  # noqa: E402  (the tests' own mount helper)

__all__ = [
    "Mount", "is_mounted", "MinimalMount", "TmpfsMount", "temp_dir", "sigterm_as_interrupt",
    "median", "markdown_table", "save_results", "wait_durable", "aiturbo_state", "REPO",
]


def sigterm_as_interrupt() -> None:
    """Make SIGTERM unwind like Ctrl-C, so every ``finally`` runs."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def temp_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix)


def remove_tree(path: str) -> None:
    """rm -rf that refuses to descend into anything still mounted."""
    with open("/proc/self/mountinfo") as f:
        mounted = [line.split()[4] for line in f]
    if any(m == path or m.startswith(path.rstrip("/") + "/") for m in mounted):
        print(f"warning: {path} still has a mount below it; left in place", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)


def _wait_mounted(path: str, proc: subprocess.Popen | None, what: str, log_path: str | None) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while not is_mounted(path):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not mount {path} in {MOUNT_TIMEOUT_S:.0f} s: {log_tail(log_path)}")
        time.sleep(0.05)


def log_tail(path: str | None, chars: int = 4000) -> str:
    """The last ``chars`` characters of a log file ("" if there is none)."""
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child started in a process group of its own (and the group), wait for it, close its pipes."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass


def reap(proc: subprocess.Popen, timeout_s: float = 5.0) -> int | None:
    """Give a child that died (or is dying) ``timeout_s`` to exit; its exit code, None if it still runs."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


class MinimalMount:
    """``minimal_fs.py`` as a child process (its own session: our cleanup decides the order)."""

    def __init__(self, mountpoint: str, args: list[str], log_path: str):
        self.mountpoint = os.path.abspath(mountpoint)
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> MinimalMount:
        os.makedirs(self.mountpoint, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, MINIMAL_FS, self.mountpoint, *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_mounted(self.mountpoint, self.proc, "minimal_fs", self.log_path)
            time.sleep(0.5)  # read_ahead_kb is raised 0.3 s after INIT
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # minimal_fs unmounts on SIGTERM
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], check=False, capture_output=True)


class TmpfsMount:
    """A private tmpfs on a temp dir (needs root)."""

    def __init__(self, mountpoint: str, size_bytes: int):
        self.mountpoint = os.path.abspath(mountpoint)
        self.size_bytes = size_bytes
        self.pid = None

    def start(self) -> TmpfsMount:
        os.makedirs(self.mountpoint, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes},mode=0755", "benchtmpfs", self.mountpoint],
                       check=True, capture_output=True)
        return self

    def stop(self) -> None:
        if is_mounted(self.mountpoint):
            r = subprocess.run(["umount", self.mountpoint], check=False, capture_output=True)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", self.mountpoint], check=False, capture_output=True)


def start_aiturbofs(backend: str, mountpoint: str, state_dir: str, options: dict, env: dict | None = None) -> Mount:
    """mount.aiturbo -f exactly as the tests run it; ``.proc.pid`` is the daemon."""
    return Mount(backend, mountpoint, state_dir, options, env=env).start(timeout_s=MOUNT_TIMEOUT_S)


def stop_aiturbofs(m: Mount) -> None:
    try:
        m.stop(timeout_s=STOP_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - a failed drain must not leave the mount
        print(f"warning: aiturbofs stop: {exc!r}", file=sys.stderr)
        m.kill()
    finally:
        m.wipe_staging()  # a benchmark's staged bytes must not outlive it in DRAM


def aiturbo_state(path: str) -> str:
    return os.getxattr(path, "user.aiturbo.state").decode()


def wait_durable(paths: list[str], timeout_s: float, poll_s: float = 0.02) -> float:
    """Poll ``user.aiturbo.state`` until every path is durable; returns seconds waited."""
    start = time.monotonic()
    pending = list(paths)
    while pending:
        pending = [p for p in pending if aiturbo_state(p) != "durable"]
        if not pending:
            break
        for p in pending:
            if aiturbo_state(p) == "broken":
                raise RuntimeError(f"{p} became broken")
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"not durable after {timeout_s:.0f} s: {pending}")
        time.sleep(poll_s)
    return time.monotonic() - start


def read_sha(path: str) -> str:
    """sha256 of a file read with 1 MiB reads (as a loader reads a model file)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_together(paths: list[str], want: list[str], timeout_s: float, what: str) -> list[float]:
    """Read every path in its own thread, all released at once; seconds from that start to each end.

    Raises RuntimeError, naming ``what`` and the path, if a read hangs past
    ``timeout_s``, fails, or returns other bytes than ``want`` (sha256 each).
    """
    barrier = threading.Barrier(len(paths) + 1)
    done: dict[int, object] = {}

    def read(i: int) -> None:
        barrier.wait()
        try:
            done[i] = (read_sha(paths[i]), time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - reported below
            done[i] = exc

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(paths))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join(max(0.0, t0 + timeout_s - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{what}: readers still running after {timeout_s:.0f} s")
    failed = {paths[i]: r for i, r in done.items() if isinstance(r, BaseException)}
    if failed:
        raise RuntimeError(f"{what}: reads failed: {failed!r}")
    wrong = [paths[i] for i in range(len(paths)) if done[i][0] != want[i]]
    if wrong:
        raise RuntimeError(f"{what}: read other bytes than were written: {wrong}")
    return [done[i][1] - t0 for i in range(len(paths))]


CLK_TCK = os.sysconf("SC_CLK_TCK")


def py_wronly(path: str, size: int, pid: int | None) -> dict:
    """1 MiB ``pwrite`` calls from this process into ``path`` opened O_WRONLY (as torch.save and safetensors
    open), close() timed on its own: MiB/s, close_s, and the CPU seconds of process ``pid`` (user_s, sys_s)
    from open() until close() returned."""
    buf = mmap.mmap(-1, MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf[:] = os.urandom(MiB)
    u0, s0 = cpu_times(pid) if pid else (0.0, 0.0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.monotonic()
    for off in range(0, size, MiB):
        if os.pwrite(fd, buf, off) != MiB:
            raise OSError(f"short write at {off}")
    t1 = time.monotonic()
    os.close(fd)
    t2 = time.monotonic()
    u1, s1 = cpu_times(pid) if pid else (0.0, 0.0)
    return {"mib_s": size / MiB / (t1 - t0), "close_s": t2 - t1, "user_s": u1 - u0, "sys_s": s1 - s0}


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far (exited threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of a process so far (exited threads included)."""
    return sum(cpu_times(pid))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine_info() -> dict:
    fio = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip() if shutil.which("fio") else None
    return {"kernel": os.uname().release, "cpus": os.cpu_count(), "python": sys.version.split()[0], "fio": fio,
            "load_avg": os.getloadavg()}


def save_results(name: str, table: str, data: dict) -> tuple[str, str]:
    """Write ``results/<name>-<timestamp>.{md,json}``; returns both paths."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    md = os.path.join(RESULTS_DIR, f"{name}-{stamp}.md")
    js = os.path.join(RESULTS_DIR, f"{name}-{stamp}.json")
    with open(md, "w") as f:
        f.write(table + "\n")
    with open(js, "w") as f:
        json.dump({"machine": machine_info(), **data}, f, indent=1)
    return md, js
