"""Network-namespace plumbing of the emulated testbed: namespaces, veths, bridges, tc, rate checks.

Everything here acts only on namespaces whose names start with
``NS_PREFIX`` (``atb-``) followed by a run id, and on the links inside them:
links are created directly inside those namespaces (``ip -n NS link add ...
peer ... netns OTHER``), so no interface ever appears in the host's own
network namespace and the host's network config is never touched.

A run registers itself in ``REGISTRY_DIR`` (its pid and temp root) BEFORE it
creates anything; ``remove_stale_runs()`` removes what runs whose owner
process is gone left behind (namespaces, the processes inside them, FUSE
mounts under their root), and never touches a live parallel run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

NS_PREFIX = "atb-"
REGISTRY_DIR = "/run/aiturbo-testbed"
CMD_TIMEOUT_S = 30.0
RATE_PORT = 5201
RATE_READY_TIMEOUT_S = 10.0
CPU_BOUND_FRACTION = 0.85  # a transfer process busy this share of its wall time is CPU-bound
RATE_OK_FRACTION = 0.85  # achieved / configured below this is worth a warning


class TestbedError(RuntimeError):
    """The host cannot build the testbed (missing tool, no permission) or a step failed."""


def sh(*cmd: str, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> str:
    """Run a command; its stdout.  Raises TestbedError with stderr on failure."""
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise TestbedError(f"{cmd[0]} not found: install iproute2 / util-linux") from exc
    if check and p.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def preflight(probe_ns: str) -> None:
    """Root, ``ip``/``nsenter``/``tc`` present, and ``ip netns add`` + tc permitted; TestbedError otherwise."""
    if os.geteuid() != 0:
        raise TestbedError("must run as root (network namespaces, tc, FUSE mounts)")
    missing = [t for t in ("ip", "nsenter", "tc", "fusermount3") if shutil.which(t) is None]
    if missing:
        raise TestbedError(f"missing tools: {', '.join(missing)} (apt-get install iproute2 util-linux fuse3)")
    sh("ip", "netns", "add", probe_ns)
    try:
        sh("ip", "-n", probe_ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        sh("ip", "netns", "exec", probe_ns, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
           "rate", "100mbit", "burst", "128kb", "latency", "50ms")
        sh("nsenter", f"--net=/run/netns/{probe_ns}", "true")
    finally:
        sh("ip", "netns", "del", probe_ns, check=False)


# ============================================================== namespaces and links

def list_ns() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def add_ns(name: str) -> None:
    sh("ip", "netns", "add", name)
    sh("ip", "-n", name, "link", "set", "lo", "up")


def ns_pids(name: str) -> list[int]:
    return [int(p) for p in sh("ip", "netns", "pids", name, check=False).split()]


def kill_ns_processes(name: str, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, every process in namespace ``name`` (only our own namespaces get here)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = ns_pids(name)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while ns_pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)


def del_ns(name: str) -> None:
    kill_ns_processes(name)
    sh("ip", "netns", "del", name, check=False)


def veth(ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
    """A veth pair with one end in each namespace (created inside ``ns_a``: never in the host's)."""
    sh("ip", "-n", ns_a, "link", "add", if_a, "type", "veth", "peer", "name", if_b, "netns", ns_b)
    sh("ip", "-n", ns_a, "link", "set", if_a, "up")
    sh("ip", "-n", ns_b, "link", "set", if_b, "up")


def bridge(ns: str, name: str, ports: list[str]) -> None:
    sh("ip", "-n", ns, "link", "add", name, "type", "bridge")
    sh("ip", "-n", ns, "link", "set", name, "up")
    for port in ports:
        sh("ip", "-n", ns, "link", "set", port, "master", name)


def address(ns: str, ifname: str, cidr: str) -> None:
    sh("ip", "-n", ns, "addr", "add", cidr, "dev", ifname)


def shape(ns: str, ifname: str, mbit: float) -> None:
    """tbf on the egress of ``ifname``: ``mbit`` Mbit/s.

    The bucket holds ~4 ms of traffic (at least 128 KiB, above one 64 KiB
    GSO packet) and the queue 50 ms, enough for TCP to fill the link.
    """
    burst = max(128 * 1024, int(mbit * 1e6 / 8 * 0.004))
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ifname, "root", "tbf",
       "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "50ms")


def _link_bytes(ns: str, ifname: str, direction: str) -> int:
    info = json.loads(sh("ip", "-n", ns, "-s", "-j", "link", "show", ifname))
    return int(info[0]["stats64"][direction]["bytes"])


def rx_bytes(ns: str, ifname: str) -> int:
    """Bytes received on ``ifname`` in ``ns`` (kernel interface counter)."""
    return _link_bytes(ns, ifname, "rx")


def tx_bytes(ns: str, ifname: str) -> int:
    """Bytes sent on ``ifname`` in ``ns`` (kernel interface counter)."""
    return _link_bytes(ns, ifname, "tx")


# ============================================================== stale runs

def register_run(run_id: str, root: str) -> str:
    os.makedirs(REGISTRY_DIR, exist_ok=True)
    path = os.path.join(REGISTRY_DIR, f"{run_id}.json")
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), "root": root, "started": time.time()}, f)
    return path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"testbed" in f.read()
    except OSError:
        return False


def unmount_under(root: str) -> None:
    """Lazily unmount every mount at or below ``root`` (leftovers of a dead run)."""
    root = root.rstrip("/")
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for p in sorted((p for p in points if p == root or p.startswith(root + "/")), reverse=True):
        subprocess.run(["fusermount3", "-u", "-z", p], capture_output=True, check=False)
        subprocess.run(["umount", "-l", p], capture_output=True, check=False)


def remove_run(run_id: str, root: str | None) -> None:
    """Remove everything of run ``run_id``: its mounts, namespaces (and their processes), temp root."""
    if root:
        unmount_under(root)
    for ns in list_ns():
        if ns.startswith(f"{NS_PREFIX}{run_id}-"):
            del_ns(ns)
    if root and os.path.isdir(root):
        shutil.rmtree(root, ignore_errors=True)
    try:
        os.unlink(os.path.join(REGISTRY_DIR, f"{run_id}.json"))
    except FileNotFoundError:
        pass


def remove_stale_runs() -> list[str]:
    """Remove leftovers of earlier runs whose owner died; the run ids removed."""
    runs: dict[str, str | None] = {}
    if os.path.isdir(REGISTRY_DIR):
        for name in os.listdir(REGISTRY_DIR):
            if not name.endswith(".json"):
                continue
            run_id = name[:-5]
            try:
                with open(os.path.join(REGISTRY_DIR, name)) as f:
                    entry = json.load(f)
            except (OSError, ValueError):
                entry = {"pid": -1, "root": None}
            if not _alive(entry.get("pid", -1)):
                runs[run_id] = entry.get("root")
            else:
                runs.setdefault("__live__" + run_id, None)
    live = {k[len("__live__"):] for k in runs if k.startswith("__live__")}
    for ns in list_ns():  # a namespace of ours with no registry entry: its run died before cleanup
        if ns.startswith(NS_PREFIX):
            run_id = ns[len(NS_PREFIX):].split("-")[0]
            if run_id not in live and run_id not in runs:
                runs[run_id] = None
    removed = []
    for run_id, root in runs.items():
        if run_id.startswith("__live__"):
            continue
        remove_run(run_id, root)
        removed.append(run_id)
    return removed


# ============================================================== rate checks

_RECEIVER = r"""
import os, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(int(sys.argv[3]))
print("ready", flush=True)
import threading
total = [0]; first = [None]; last = [0.0]
def serve(c):
    buf = bytearray(1 << 20); n = 0
    while True:
        k = c.recv_into(buf)
        if not k: break
        now = time.monotonic()
        if first[0] is None: first[0] = now
        total[0] += k; last[0] = now
ts = []
for _ in range(int(sys.argv[3])):
    c, _a = s.accept(); t = threading.Thread(target=serve, args=(c,)); t.start(); ts.append(t)
for t in ts: t.join()
cpu = sum(os.times()[:2])
print(total[0], (last[0] - first[0]) if first[0] else 0.0, cpu, flush=True)
"""

_SENDER = r"""
import os, socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = b"\0" * (1 << 20); end = time.monotonic() + float(sys.argv[3]); n = 0
t0 = time.monotonic()
while time.monotonic() < end:
    n += c.send(buf)
c.close()
print(n, time.monotonic() - t0, sum(os.times()[:2]), flush=True)
"""


def rate_check(flows: list[tuple[str, str]], rx_ns: list[str] | str, seconds: float) -> dict:
    """Send for ``seconds`` over each flow ``(sender ns, receiver ip)`` at once; achieved Mbit/s.

    ``rx_ns`` is the receiver namespace of each flow (or one for all, one
    listener serving every flow).  Returns ``mbit`` (received bytes over the
    receive window) and the CPU share of the busiest sender/receiver process.
    """
    per_flow_rx = isinstance(rx_ns, list)
    receivers = []
    try:
        groups = [(ns, ip, 1) for (_s, ip), ns in zip(flows, rx_ns)] if per_flow_rx else [(rx_ns, flows[0][1], len(flows))]
        for ns, ip, count in groups:
            p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _RECEIVER, ip, str(RATE_PORT), str(count)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            receivers.append(p)
            if p.stdout.readline().strip() != "ready":
                raise TestbedError(f"rate receiver in {ns} did not start: {p.stderr.read()[-500:]}")
        senders = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _SENDER, ip, str(RATE_PORT), str(seconds)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
                   for ns, ip in flows]
        sent = [p.communicate(timeout=seconds + 30) for p in senders]
        got = [p.communicate(timeout=30) for p in receivers]
    finally:
        for p in receivers:
            if p.poll() is None:
                p.kill()
                p.wait()
    cpu_shares = []
    for out, err in sent:
        if not out.strip():
            raise TestbedError(f"rate sender failed: {err[-500:]}")
        n, wall, cpu = map(float, out.split())
        cpu_shares.append(cpu / max(wall, 1e-9))
    total_bytes, window = 0, 0.0
    for out, _err in got:
        n, wall, cpu = map(float, out.split())
        total_bytes += n
        window = max(window, wall)
        cpu_shares.append(cpu / max(wall, 1e-9))
    return {"mbit": total_bytes * 8 / max(window, 1e-9) / 1e6, "bytes": total_bytes, "seconds": window,
            "cpu_share_max": max(cpu_shares)}


def judge(achieved_mbit: float, configured_mbit: float, cpu_share_max: float) -> str:
    """``ok``, or why the achieved rate does not show the configured link."""
    if achieved_mbit >= RATE_OK_FRACTION * configured_mbit:
        return "ok"
    if cpu_share_max >= CPU_BOUND_FRACTION:
        return f"WARN: CPU-bound (a transfer process used {cpu_share_max:.0%} of a core): the CPU, not the link, limits"
    load = os.getloadavg()[0]
    return f"WARN: {achieved_mbit / configured_mbit:.0%} of configured (load {load:.1f} on {os.cpu_count()} cores)"
