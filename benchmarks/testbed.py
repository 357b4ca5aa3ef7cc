#!/usr/bin/env python3
"""An emulated N-node aiturbofs cluster on this host, shaped with tc, and the DP-replica scenario on it.

    sudo python benchmarks/testbed.py [--nodes 4] [--fabric-mbit 2000] [--storage-mbit 250]
                                      [--backend-mbit 1000] [--size-mib 64] [--shard-mib 16] [--scenario dp] [--keep]

Topology (one run id per run: every namespace is ``atb-<run>-*``; all of it is
removed at exit, also on failure, Ctrl-C and SIGTERM, and leftovers of
crashed earlier runs are removed at start):

    atb-<run>-n0..nN-1   one per node: links fab (10.201.0.i+1), sto (10.202.0.i+1), ctl (10.203.0.i+1)
    atb-<run>-fab        fabric switch: a bridge over every node's fabric link
    atb-<run>-sto        storage switch: a bridge over every node's storage link + the uplink to S3
    atb-<run>-s3         moto S3 server on 10.202.0.254 (its only link: the uplink)
    atb-<run>-ctl        PostgreSQL + ``aiturbo controller`` on 10.203.0.254, an unshaped control
                         network, so metadata traffic neither competes with the shaped data
                         links nor shows in the S3 byte count

Shaping (tbf on egress, so each link is capped in both directions): each
node's fabric link at --fabric-mbit, its storage link at --storage-mbit, and
the storage switch's uplink to S3 at --backend-mbit (the aggregate backend
cap).  Before the scenario a socket transfer over each shaped link reports
the achieved rate against the configured one, and warns when a transfer
process, i.e. the CPU, not the link, is the bottleneck.

Node daemons run as ``nsenter --net=/run/netns/atb-<run>-nI mount.aiturbo``
(only the network is switched, the mount stays visible to this script),
with ``fabric_gbps``/``snic_gbps`` set to the shaped rates and the
controller's ``--backend-gbps`` to the backend cap, so the planner's LP
bound describes the emulated links.

Scenario ``dp`` (DP replicas): every node writes, at once, one file made of
the same --size-mib of model state followed by a --shard-mib shard of its
own.  Modes: ``sync_close`` (daemons mounted with -o sync_close: write-
through), ``plain`` (an untagged directory: DRAM write-back, every byte
uploaded by its writer) and ``grouped`` (``user.aiturbo.group`` with
``group.size`` = nodes: dedup + plan).  Reported: close() of the slowest
writer, time until all files are durable, bytes the S3 namespace received
(the kernel counter of its only interface) over the unique bytes, and the
plan's LP bound and makespan (``aiturbo status --json``: cluster.last_plan).
Results: benchmarks/results/testbed-<time>.{md,json}.  Must run as root.
"""

from __future__ import annotations

import argparse
import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as h
import _netns as nn

sys.path.insert(0, h.REPO)
from aiturbofs.node import control_socket
from aiturbofs.node._control import call as control_call

MiB = 1 << 20
FABRIC_NET, STORAGE_NET, CONTROL_NET = "10.201.0", "10.202.0", "10.203.0"
SERVICE_HOST = 254  # .254: moto on the storage net, PostgreSQL + controller on the control net
S3_PORT, PG_PORT, CONTROLLER_PORT, FABRIC_PORT = 9000, 5432, 7000, 7100
PG_BIN = "/usr/lib/postgresql/15/bin"
PG_USER = "aiturbo"
BUCKET = "testbed"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
SERVICE_START_TIMEOUT_S = 60.0
NODE_START_TIMEOUT_S = 90.0  # N daemons importing trio, s3fs, psycopg at once on two cores
JOIN_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 300.0
DURABLE_TIMEOUT_S = 900.0
MAX_NODES = 200


def ns_path(ns: str) -> str:
    return f"/run/netns/{ns}"


class Testbed:
    """The namespaces, links, services and node daemons of one run; ``close()`` removes all of it."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.n = args.nodes
        self.run_id = args.run_id or secrets.token_hex(3)
        self.prefix = f"{nn.NS_PREFIX}{self.run_id}-"
        self.root = f"/tmp/atb-{self.run_id}"
        self.node_ns = [f"{self.prefix}n{i}" for i in range(self.n)]
        self.fab_ns, self.sto_ns, self.s3_ns, self.ctl_ns = (self.prefix + s for s in ("fab", "sto", "s3", "ctl"))
        self.s3_ip = f"{STORAGE_NET}.{SERVICE_HOST}"
        self.ctl_ip = f"{CONTROL_NET}.{SERVICE_HOST}"
        self.procs: dict[str, subprocess.Popen] = {}  # name -> service or daemon process (own session)
        self.mounts: dict[int, str] = {}  # node -> mountpoint
        self.pg_dir = os.path.join(self.root, "pg")
        self.secret = os.path.join(self.root, "secret")
        self.db_count = 0
        self.meta_url: str | None = None
        self._closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ network
    def build(self) -> None:
        nn.register_run(self.run_id, self.root)
        os.makedirs(self.root, exist_ok=True)
        a = self.args
        for ns in [*self.node_ns, self.fab_ns, self.sto_ns, self.s3_ns, self.ctl_ns]:
            nn.add_ns(ns)
        for i, ns in enumerate(self.node_ns):
            nn.veth(ns, "fab", self.fab_ns, f"n{i}")
            nn.veth(ns, "sto", self.sto_ns, f"n{i}")
            nn.veth(ns, "ctl", self.ctl_ns, f"n{i}")
            nn.address(ns, "fab", f"{FABRIC_NET}.{i + 1}/24")
            nn.address(ns, "sto", f"{STORAGE_NET}.{i + 1}/24")
            nn.address(ns, "ctl", f"{CONTROL_NET}.{i + 1}/24")
            nn.shape(ns, "fab", a.fabric_mbit)  # node -> fabric
            nn.shape(self.fab_ns, f"n{i}", a.fabric_mbit)  # fabric -> node
            nn.shape(ns, "sto", a.storage_mbit)  # node -> storage (uploads)
            nn.shape(self.sto_ns, f"n{i}", a.storage_mbit)  # storage -> node (downloads)
        nn.veth(self.sto_ns, "s3", self.s3_ns, "sto")
        nn.address(self.s3_ns, "sto", f"{self.s3_ip}/24")
        nn.shape(self.sto_ns, "s3", a.backend_mbit)  # everything into S3
        nn.shape(self.s3_ns, "sto", a.backend_mbit)  # everything out of S3
        nn.bridge(self.fab_ns, "sw", [f"n{i}" for i in range(self.n)])
        nn.bridge(self.sto_ns, "sw", [f"n{i}" for i in range(self.n)] + ["s3"])
        nn.bridge(self.ctl_ns, "sw", [f"n{i}" for i in range(self.n)])
        nn.address(self.ctl_ns, "sw", f"{self.ctl_ip}/24")

    def check_rates(self, seconds: float) -> list[dict]:
        """A transfer over every shaped link (one at a time), then all nodes into S3 at once."""
        a, out = self.args, []

        def record(link: str, configured: float, r: dict) -> None:
            r.update(link=link, configured_mbit=configured, verdict=nn.judge(r["mbit"], configured, r["cpu_share_max"]))
            out.append(r)
            print(f"  {link:24} {r['mbit']:8.0f} of {configured:6.0f} Mbit/s  cpu {r['cpu_share_max']:4.0%}  {r['verdict']}",
                  flush=True)

        print(f"link rate check ({seconds:g} s per transfer):", flush=True)
        for i in range(self.n):
            j = (i + 1) % self.n
            r = nn.rate_check([(self.node_ns[i], f"{FABRIC_NET}.{j + 1}")], [self.node_ns[j]], seconds)
            record(f"fabric n{i}->n{j}", a.fabric_mbit, r)
        for i in range(self.n):
            r = nn.rate_check([(self.node_ns[i], self.s3_ip)], self.s3_ns, seconds)
            record(f"storage n{i}->s3", min(a.storage_mbit, a.backend_mbit), r)
        r = nn.rate_check([(ns, self.s3_ip) for ns in self.node_ns], self.s3_ns, seconds)
        record(f"backend all {self.n}->s3", min(a.backend_mbit, self.n * a.storage_mbit), r)
        return out

    # ------------------------------------------------------------------ services
    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        with open(os.path.join(self.root, f"{name}.log"), "ab") as log:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, PYTHONPATH=h.REPO, **CREDENTIALS, **(env or {})),
                                 start_new_session=True)  # Ctrl-C reaches us only: teardown decides the order
        self.procs[name] = p
        return p

    def log_tail(self, name: str, chars: int = 3000) -> str:
        try:
            with open(os.path.join(self.root, f"{name}.log"), errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def _wait(self, what: str, ready, proc: subprocess.Popen | None, timeout_s: float = SERVICE_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc is not None and proc.poll() is not None:
                raise nn.TestbedError(f"{what} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise nn.TestbedError(f"{what} not ready after {timeout_s:.0f} s")
            time.sleep(0.2)

    def start_services(self) -> None:
        """moto in the S3 namespace, PostgreSQL in the control namespace (a bucket, a secret)."""
        moto = self._spawn("moto", ["ip", "netns", "exec", self.s3_ns, sys.executable, "-m", "moto.server",
                                    "-H", self.s3_ip, "-p", str(S3_PORT)])
        url = f"http://{self.s3_ip}:{S3_PORT}"

        def answers() -> bool:
            r = subprocess.run(["ip", "netns", "exec", self.s3_ns, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", url + "/"],
                               capture_output=True, text=True, check=False)
            return r.stdout.strip() not in ("", "000")

        os.makedirs(self.pg_dir)
        shutil.chown(self.pg_dir, "postgres", "postgres")
        self._pg("initdb", "-D", self.pg_dir, "-A", "trust", "-U", PG_USER, "-E", "UTF8", "--no-sync")
        with open(os.path.join(self.pg_dir, "pg_hba.conf"), "a") as f:  # nodes connect over the control net
            f.write(f"host all all {CONTROL_NET}.0/24 trust\n")
        self._pg("pg_ctl", "-D", self.pg_dir, "-l", os.path.join(self.pg_dir, "log"), "-w", "-t", "60", "-o",
                 f"-c listen_addresses={self.ctl_ip} -p {PG_PORT} -k {self.pg_dir} -c fsync=off", "start")
        self._wait("moto S3 server", answers, moto)
        nn.sh("ip", "netns", "exec", self.s3_ns, "curl", "-sf", "-X", "PUT", f"{url}/{BUCKET}")
        fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())

    def _pg(self, tool: str, *args: str) -> str:
        return nn.sh("ip", "netns", "exec", self.ctl_ns, "runuser", "-u", "postgres", "--",
                     os.path.join(PG_BIN, tool), *args, timeout=120)

    def new_database(self) -> str:
        self.db_count += 1
        name = f"db{self.db_count}"
        self._pg("createdb", "-h", self.ctl_ip, "-p", str(PG_PORT), "-U", PG_USER, name)
        return f"postgresql://{PG_USER}@{self.ctl_ip}:{PG_PORT}/{name}"

    def start_cluster(self, *, sync_close: bool) -> None:
        """A fresh database, the controller and N daemons; waits until every node sees every node."""
        a = self.args
        self.meta_url = self.new_database()
        listen = f"{self.ctl_ip}:{CONTROLLER_PORT}"
        ctl = self._spawn("controller", ["nsenter", f"--net={ns_path(self.ctl_ns)}", sys.executable, "-m", "aiturbofs.cli.main",
                                         "controller", "--listen", listen, "--meta", self.meta_url, "--secret-file", self.secret,
                                         "--backend-gbps", f"{a.backend_mbit / 1000:g}"])
        self._wait("aiturbo controller", lambda: f"controller listening on {listen}" in self.log_tail("controller", 100000), ctl)
        for i, ns in enumerate(self.node_ns):
            mnt = os.path.join(self.root, f"n{i}-mnt")
            state = os.path.join(self.root, f"n{i}-state")
            os.makedirs(mnt, exist_ok=True)
            opts = {
                "state_dir": state, "import_ttl": "0.5", "s3_endpoint": f"http://{self.s3_ip}:{S3_PORT}",
                "fabric": f"{FABRIC_NET}.{i + 1}:{FABRIC_PORT}", "transport": "tcp", "controller": listen,
                "meta": self.meta_url, "secret_file": self.secret, "node": f"n{i}", "dram": a.dram,
                "drain_timeout": str(DRAIN_TIMEOUT_S), "snic_gbps": f"{a.storage_mbit / 1000:g}",
                "fabric_gbps": f"{a.fabric_mbit / 1000:g}",
            }
            option_string = ",".join(f"{k}={v}" for k, v in opts.items()) + (",sync_close" if sync_close else "")
            self._spawn(f"n{i}", ["nsenter", f"--net={ns_path(ns)}", sys.executable, "-m", "aiturbofs.cli.mount",
                                  f"s3://{BUCKET}", mnt, "-f", "-o", option_string])
            self.mounts[i] = mnt
        for i, mnt in self.mounts.items():
            try:
                self._wait(f"node n{i}", lambda m=mnt: h.is_mounted(m), self.procs[f"n{i}"], NODE_START_TIMEOUT_S)
            except nn.TestbedError as exc:
                raise nn.TestbedError(f"{exc}:\n{self.log_tail(f'n{i}')}") from None
        self._wait_joined()

    def status(self, i: int) -> dict:
        """What ``aiturbo status MNT --json`` prints (read from the daemon's control socket)."""
        return control_call(control_socket(self.mounts[i]), {"cmd": "status"})

    def _wait_joined(self) -> None:
        names = {f"n{i}" for i in range(self.n)}

        def joined() -> bool:
            for i in range(self.n):
                try:
                    c = self.status(i)["cluster"]
                except Exception:  # noqa: BLE001 - not answering yet
                    return False
                if not c["controller_connected"] or not names <= set(c["members"]):
                    return False
            return True

        self._wait("nodes joining the controller", joined, None, JOIN_TIMEOUT_S)

    def stop_cluster(self) -> None:
        """Unmount every node (each drains its persist queue), then stop the controller."""
        def stop(item) -> None:
            i, mnt = item
            p = self.procs.pop(f"n{i}", None)
            mounted = h.is_mounted(mnt)
            if mounted:
                subprocess.run(["fusermount3", "-u", mnt], capture_output=True, check=False)
            elif p is not None and p.poll() is None:
                p.terminate()  # interrupted before it mounted: nothing to drain
            if p is not None:
                try:
                    p.wait(DRAIN_TIMEOUT_S + 15 if mounted else 10)
                except subprocess.TimeoutExpired:
                    print(f"warning: n{i} did not drain in time; killed", file=sys.stderr)
                    p.kill()
                    p.wait()
            if h.is_mounted(mnt):
                subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True, check=False)

        items, self.mounts = list(self.mounts.items()), {}
        if items:
            with ThreadPoolExecutor(len(items)) as pool:
                list(pool.map(stop, items))
        self._stop_proc("controller")

    def _stop_proc(self, name: str) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        except ProcessLookupError:
            pass

    def uploaded_bytes(self) -> dict[str, int]:
        """persist.bytes_uploaded per node (what each daemon says it sent to the backend)."""
        return {f"n{i}": self.status(i)["persist"]["bytes_uploaded"] for i in self.mounts}

    def moto_cpu_s(self) -> float:
        """CPU seconds moto has used (``ip netns exec`` execs it: the pid is moto's)."""
        try:
            with open(f"/proc/{self.procs['moto'].pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, KeyError):
            return float("nan")

    def s3_rx_bytes(self) -> int:
        return nn.rx_bytes(self.s3_ns, "sto")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Remove everything this run made; idempotent, never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        steps = [self.stop_cluster, lambda: self._stop_proc("moto"),
                 lambda: self._pg("pg_ctl", "-D", self.pg_dir, "-m", "immediate", "-w", "stop") if os.path.isdir(self.pg_dir) else None,
                 lambda: nn.remove_run(self.run_id, self.root)]
        for step in steps:
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - go on: the namespaces must go whatever happened
                print(f"warning: teardown step failed: {exc!r}", file=sys.stderr)
        for p in self.procs.values():  # anything left (in our namespaces or not): ours, by pid
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        left = [ns for ns in nn.list_ns() if ns.startswith(self.prefix)]
        with open("/proc/self/mountinfo") as f:
            left += [line.split()[4] for line in f if line.split()[4].startswith(self.root)]
        if left:
            print(f"warning: teardown left {left}", file=sys.stderr)
        else:
            print(f"testbed {self.run_id}: torn down", flush=True)


# ============================================================== scenario: DP replicas

def write_file(path: str, parts: list[bytes], out: dict) -> None:
    t0 = time.monotonic()
    with open(path, "wb", buffering=0) as f:
        for data in parts:
            view = memoryview(data)
            f.writelines(view[off : off + MiB] for off in range(0, len(data), MiB))
    out[path] = time.monotonic() - t0  # open + writes + close()


def run_dp(tb: Testbed, mode: str, step: int) -> dict:
    # Fresh bytes every run: chunks left in the pools or the bucket by an
    # earlier run would be deduplicated against and flatter the later mode.
    model = os.urandom(tb.args.size_mib * MiB)
    shards = [os.urandom(tb.args.shard_mib * MiB) for _ in range(tb.n)]
    d = f"dp-{mode}-{step}"
    os.mkdir(os.path.join(tb.mounts[0], d))
    if mode == "grouped":
        os.setxattr(os.path.join(tb.mounts[0], d), "user.aiturbo.group", f"dp{step}".encode())
        os.setxattr(os.path.join(tb.mounts[0], d), "user.aiturbo.group.size", str(tb.n).encode())
    time.sleep(1.1)  # the other nodes' kernels see the new directory (attribute timeout)
    paths = [os.path.join(tb.mounts[i], d, f"rank{i}.bin") for i in range(tb.n)]
    rx0, up0, cpu0 = tb.s3_rx_bytes(), tb.uploaded_bytes(), tb.moto_cpu_s()
    closes: dict = {}
    threads = [threading.Thread(target=write_file, args=(p, [model, shards[i]], closes)) for i, p in enumerate(paths)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(closes) != tb.n:
        raise RuntimeError(f"{tb.n - len(closes)} writer(s) failed in {mode}")
    wrote_s = time.monotonic() - t0
    durable_s = h.wait_durable(paths, DURABLE_TIMEOUT_S) + wrote_s
    s3_rx = tb.s3_rx_bytes() - rx0
    moto_cpu_s = tb.moto_cpu_s() - cpu0
    uploaded = {n: b - up0.get(n, 0) for n, b in tb.uploaded_bytes().items()}
    plan = tb.status(0)["cluster"]["last_plan"] if mode == "grouped" else None
    unique = len(model) + sum(len(s) for s in shards)
    return {"mode": mode, "step": step, "close_s": max(closes.values()), "durable_s": durable_s,
            "s3_rx_bytes": s3_rx, "uploaded_by_node": uploaded, "moto_cpu_s": moto_cpu_s, "unique_bytes": unique, "written_bytes": tb.n * len(model) + unique - len(model),
            "lp_bound_s": plan and plan.get("lp_bound_s"), "makespan_s": plan and plan.get("makespan_s"), "plan": plan}


def scenario_dp(tb: Testbed, repeat: int) -> list[dict]:
    results = []
    for sync_close, modes in ((True, ["sync_close"]), (False, ["plain", "grouped"])):
        print(f"starting {tb.n} daemons{' with -o sync_close' if sync_close else ''} ...", flush=True)
        tb.start_cluster(sync_close=sync_close)
        for step in range(repeat):
            for mode in modes:
                r = run_dp(tb, mode, step)
                results.append(r)
                print(f"  dp {mode:10} close {r['close_s']:.2f} s, durable {r['durable_s']:.2f} s, "
                      f"S3 rx {r['s3_rx_bytes'] / MiB:.1f} MiB for {r['unique_bytes'] / MiB:.0f} MiB unique"
                      + (f", LP bound {r['lp_bound_s']:.2f} s" if r["lp_bound_s"] else ""), flush=True)
        tb.stop_cluster()
    return results


def dp_table(results: list[dict]) -> str:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    rows = [[r["mode"], f(r["close_s"]), f(r["durable_s"]), f(r["s3_rx_bytes"] / MiB, "{:.0f}"),
             f(r["s3_rx_bytes"] / r["unique_bytes"]),
             " ".join(f"{n}:{b / MiB:.0f}" for n, b in sorted(r["uploaded_by_node"].items())),
             f"{r['moto_cpu_s']:.1f} ({r['moto_cpu_s'] / r['durable_s']:.0%})", f(r["lp_bound_s"], "{:.3f}"), f(r["makespan_s"], "{:.3f}")]
            for r in results]
    table = h.markdown_table(["mode", "close s (slowest)", "durable s", "S3 rx MiB", "S3 rx / unique",
                              "MiB uploaded per node", "moto CPU s (of durable)", "LP bound s",
                              "plan makespan s"], rows)
    med = {m: {k: h.median([r[k] for r in results if r["mode"] == m]) for k in ("close_s", "durable_s")}
           for m in ("sync_close", "plain", "grouped")}
    g = med["grouped"]
    table += (f"\n\nwrite-through/grouped close time {med['sync_close']['close_s'] / g['close_s']:.2f}x; "
              f"plain/grouped close {med['plain']['close_s'] / g['close_s']:.2f}x, "
              f"durable {med['plain']['durable_s'] / g['durable_s']:.2f}x\n")
    busy = [r["moto_cpu_s"] / r["durable_s"] for r in results]
    if max(busy) >= nn.CPU_BOUND_FRACTION:
        table += (f"\nnote: moto was busy {max(busy):.0%} of a core until durable: the S3 server's CPU, not the "
                  "shaped links, bounds the durable times (compare them with the LP bound accordingly)\n")
    return table


def rates_table(rates: list[dict]) -> str:
    return h.markdown_table(["link", "configured Mbit/s", "achieved Mbit/s", "busiest process CPU", "verdict"],
                            [[r["link"], f"{r['configured_mbit']:.0f}", f"{r['mbit']:.0f}", f"{r['cpu_share_max']:.0%}",
                              r["verdict"]] for r in rates])


# ============================================================== CLI

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 4)[4],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4, help="node daemons, one network namespace each (default 4)")
    ap.add_argument("--fabric-mbit", type=float, default=2000, help="per-node fabric rate each way, Mbit/s (default 2000)")
    ap.add_argument("--storage-mbit", type=float, default=250, help="per-node storage-link rate each way, Mbit/s (default 250)")
    ap.add_argument("--backend-mbit", type=float, default=1000,
                    help="aggregate cap of the link into the S3 namespace, Mbit/s (default 1000; moto itself tops out near 1500)")
    ap.add_argument("--size-mib", type=int, default=64, help="model state every node writes identically (default 64)")
    ap.add_argument("--shard-mib", type=int, default=16, help="each node's unique shard, appended to the model state (default 16)")
    ap.add_argument("--scenario", choices=["dp"], default="dp", help="dp: DP replicas (the only one so far)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each mode (medians in the ratios)")
    ap.add_argument("--dram", default="2G", help="each daemon's -o dram= (default 2G)")
    ap.add_argument("--check-s", type=float, default=2.0, help="seconds per link rate check; 0 skips the checks (default 2)")
    ap.add_argument("--keep", action="store_true", help="after the run keep the testbed up until Ctrl-C, then tear it down")
    ap.add_argument("--run-id", help=argparse.SUPPRESS)  # tests choose it to check the teardown
    a = ap.parse_args(argv)
    if not 1 <= a.nodes <= MAX_NODES:
        ap.error(f"--nodes must be 1..{MAX_NODES}")
    if min(a.fabric_mbit, a.storage_mbit, a.backend_mbit) <= 0:
        ap.error("rates must be positive")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    tb = Testbed(a)
    try:
        nn.preflight(f"{tb.prefix}probe")
    except nn.TestbedError as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 2
    h.sigterm_as_interrupt()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (e.g. `cmd &`)
    signal.signal(signal.SIGHUP, signal.getsignal(signal.SIGTERM))
    atexit.register(tb.close)
    stale = nn.remove_stale_runs()
    if stale:
        print(f"removed leftovers of crashed runs: {', '.join(stale)}")
    print(f"run id: {tb.run_id} (namespaces {tb.prefix}*, files under {tb.root})", flush=True)
    try:
        tb.build()
        tb.start_services()
        rates = tb.check_rates(a.check_s) if a.check_s > 0 else []
        results = scenario_dp(tb, a.repeat)
        header = (f"DP replicas on {a.nodes} emulated nodes: {a.size_mib} MiB identical + {a.shard_mib} MiB shard each; "
                  f"fabric {a.fabric_mbit:g}, storage {a.storage_mbit:g}, backend {a.backend_mbit:g} Mbit/s (tbf)\n\n")
        table = header + dp_table(results) + ("\n" + rates_table(rates) + "\n" if rates else "")
        print(table)
        md, js = h.save_results("testbed", table, {"args": vars(a), "rates": rates, "runs": results})
        print(f"results: {md} {js}")
        if a.keep:
            print(f"--keep: testbed up; enter a node with `nsenter --net=/run/netns/{tb.node_ns[0]} bash`. Ctrl-C tears down.")
            tb.start_cluster(sync_close=False)
            print(f"mounts: {' '.join(tb.mounts.values())}", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("interrupted: tearing down", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - reported with the logs; teardown follows
        print(f"testbed failed: {exc!r}", file=sys.stderr)
        for name in ("controller", *(f"n{i}" for i in range(tb.n))):
            tail = tb.log_tail(name, 1500)
            if tail:
                print(f"===== {name}\n{tail}", file=sys.stderr)
        return 1
    finally:
        tb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
