#!/usr/bin/env python3
"""An emulated N-node aiturbofs cluster on this host, shaped with tc, and checkpoint scenarios on it.

    sudo python benchmarks/testbed.py [--nodes 4] [--fabric-mbit 2000] [--storage-mbit 250]
                                      [--backend-mbit 1000] [--size-mib 64] [--shard-mib 16]
                                      [--scenario dp|rank0|sharded|read|kv|dcp|load[,...]|all] [--keep]
                                      [--peers rclone,s3fs-fuse,s3fs-direct|all] [--rclone-write-back 5s]

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
uploaded by its writer), ``dedup`` (grouped, on a controller started with
``--plan dedup``: dedup without the plan, each unique chunk uploaded by the
node of the first file holding it) and ``grouped`` (``user.aiturbo.group``
with ``group.size`` = nodes: dedup + plan).  The table ends with the factor
steps write-through -> +DRAM buffer -> +dedup -> +plan (ratios of close and
durable times between consecutive modes).  Reported: close() of the slowest
writer, time until all files are durable, bytes the S3 namespace received
(the kernel counter of its only interface) over the unique bytes, and the
plan's LP bound and makespan (``aiturbo status --json``: cluster.last_plan).

Scenario ``rank0``: one node writes the whole checkpoint (--size-mib times
the nodes), modes as for ``dp`` with ``group.size`` = 1: a plain writer
uploads over its own storage link, a grouped one lets the plan spread the
upload over every node's (reported: MiB uploaded per node, LP bound).

Scenario ``sharded``: every node writes a unique --size-mib shard, nothing to
deduplicate; ``plain`` vs ``grouped`` (``group.size`` = nodes) shows what the
plan alone buys.

Scenario ``read``: one --size-mib model file written and made durable; then
for N = 1, 2, 4, ... up to the nodes: every pool emptied (once no pool holds
a dirty byte, ``aiturbo drop-cache`` on each node), a fresh ``cp`` of the
file inside the mount into a group directory, durable, ``group.size`` = N,
pools emptied again, and N nodes read it at once.  Reported: time until all
finished (each checks its sha256), bytes the S3 namespace sent (the kernel
counter of its only interface), each node's ``persist.bytes_fetched``, and
time(N)/time(1).

Scenario ``kv`` (``_kv.py``): KV-cache files sharing a chunk-aligned prefix,
written on node 0 and read on the others; plain vs grouped.

Scenario ``dcp`` (``_dcp.py``): PyTorch DCP, one gloo rank per node
namespace (over the fabric), saves a DP-replicated model + Adam state
(--size-mib) plus a --shard-mib tensor per rank through each rank's own
mount, with DCP's own dedup on and off, in ``sync_close``, ``plain`` and
``grouped``; then loads it back into a fresh state from cold pools and
compares.  Reported: dcp.save of the slowest rank, time to durable, S3 bytes
over the bytes DCP wrote, load time.

Scenario ``load`` (``_load.py``): inference autoscaling.  A Hugging
Face-style model directory (json files, --size-mib of safetensors shards of
about --shard-mib) is put into the bucket by another client (boto3 inside
the S3 namespace, uncounted); then N = 1 and N = nodes nodes load it at
once, one process per node through its mount (safe_open per shard, every
tensor checked), in ``plain`` (-o autogroup=off), ``tagged`` (the directory
and files tagged with group.size = N) and ``autogroup`` (-o autogroup=on),
each on a cluster of its own mount options, plus a warm second load in the
grouped modes.  Reported: load time of the slowest node and of each, node
0's first-byte latency, bytes S3 sent over the model's bytes, and the goals.

``--peers`` (``_peers.py``) adds external systems as write modes of dp,
rank0 and sharded (and rclone and s3fs-fuse, mounted read-only, as modes of
load), run after the aiturbofs modes on the same links: rclone
mount with --vfs-cache-mode writes, s3fs-fuse, and a direct upload with the
s3fs library, each in every writing node's namespace; durable is when S3
holds every object at full size.  A PNG chart per scenario (``_charts.py``)
goes next to the results files.

``--scenario`` takes a comma list or ``all``; the write-through modes share
one cluster mounted with -o sync_close, the ``dedup`` modes one whose
controller runs ``--plan dedup``, ``load`` its own (one per set of mount
options), everything else one with neither.  Each
scenario prints its own table; all go into one results file:
benchmarks/results/testbed-<time>.{md,json}.  Must run as root.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import itertools
import json
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
import _charts
import _dcp  # noqa: E402
import _kv  # after the repo is on the path: it imports aiturbofs._limits
import _load
import _peers as peers

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
SETTLE_TIMEOUT_S = 60.0  # replicas are released by a 1 s housekeeping pass once a file is durable
READ_TIMEOUT_S = 600.0
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

    def start_cluster(self, *, sync_close: bool, plan: str = "lp", options: dict | None = None) -> None:
        """A fresh database, the controller (``--plan plan``) and N daemons; waits until every node sees every node.

        ``options``: more ``-o name=value`` items for every daemon (a scenario's mode, e.g. ``autogroup``).
        """
        a = self.args
        self.meta_url = self.new_database()
        listen = f"{self.ctl_ip}:{CONTROLLER_PORT}"
        ctl = self._spawn("controller", ["nsenter", f"--net={ns_path(self.ctl_ns)}", sys.executable, "-m", "aiturbofs.cli.main",
                                         "controller", "--listen", listen, "--meta", self.meta_url, "--secret-file", self.secret,
                                         "--backend-gbps", f"{a.backend_mbit / 1000:g}", "--plan", plan])
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
                "fabric_gbps": f"{a.fabric_mbit / 1000:g}", **(options or {}),
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

    def aiturbo(self, *args: str) -> str:
        """The stdout of the operator's command ``aiturbo ARGS`` (run from this repo)."""
        p = subprocess.run([sys.executable, "-m", "aiturbofs.cli.main", *args], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=h.REPO), timeout=60, check=False)
        if p.returncode != 0:
            raise nn.TestbedError(f"aiturbo {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()[-500:]}")
        return p.stdout

    def s3_tx_bytes(self) -> int:
        return nn.tx_bytes(self.s3_ns, "sto")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Remove everything this run made; idempotent, never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        steps = [peers.stop_all, self.stop_cluster, lambda: self._stop_proc("moto"),
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


# ============================================================== write scenarios: DP replicas, rank 0, shards

GROUP, GROUP_SIZE = "user.aiturbo.group", "user.aiturbo.group.size"
SCENARIOS = ("dp", "rank0", "sharded", "read", "kv", "dcp", "load")  # the order they run and print in
WRITE_MODES = {"dp": ("sync_close", "plain", "dedup", "grouped"), "rank0": ("sync_close", "plain", "dedup", "grouped"),
               "sharded": ("plain", "dedup", "grouped")}  # in factor order: each mode adds one thing to the one before
FACTOR_NAMES = {"sync_close": "write-through", "plain": "+DRAM buffer", "dedup": "+dedup", "grouped": "+plan"}
CLUSTERS = ((True, "lp"), (False, "dedup"), (False, "lp"))  # (-o sync_close, controller --plan), in start order


def cluster_of(mode: str) -> tuple[bool, str]:
    """The cluster a write mode runs on (one of ``CLUSTERS``)."""
    return mode == "sync_close", "dedup" if mode == "dedup" else "lp"


def write_file(path: str, parts: list[bytes], out: dict) -> None:
    t0 = time.monotonic()
    with open(path, "wb", buffering=0) as f:
        for data in parts:
            view = memoryview(data)
            f.writelines(view[off : off + MiB] for off in range(0, len(data), MiB))
    out[path] = time.monotonic() - t0  # open + writes + close()


def write_layout(tb: Testbed, scenario: str) -> tuple[list[tuple[int, list[bytes]]], int, int]:
    """Who writes what in one round: [(node, parts of its file)], the group's size, the unique bytes.

    Fresh bytes every round: chunks left in the pools or the bucket by an
    earlier round would be deduplicated against and flatter the later mode.
    """
    a = tb.args
    if scenario == "dp":  # the same model state on every node, then a shard of its own
        model = os.urandom(a.size_mib * MiB)
        shards = [os.urandom(a.shard_mib * MiB) for _ in range(tb.n)]
        return [(i, [model, shards[i]]) for i in range(tb.n)], tb.n, len(model) + sum(map(len, shards))
    if scenario == "rank0":  # one writer, the whole checkpoint: only the plan can spread its upload
        checkpoint = os.urandom(a.size_mib * MiB * tb.n)
        return [(0, [checkpoint])], 1, len(checkpoint)
    shards = [os.urandom(a.size_mib * MiB) for _ in range(tb.n)]  # sharded: nothing to dedup
    return [(i, [shards[i]]) for i in range(tb.n)], tb.n, sum(map(len, shards))


def run_write(tb: Testbed, scenario: str, mode: str, step: int) -> dict:
    layout, group_size, unique = write_layout(tb, scenario)
    d = f"{scenario}-{mode}-{step}"
    os.mkdir(os.path.join(tb.mounts[0], d))
    if mode in ("grouped", "dedup"):  # the same rounds; the controller's --plan tells them apart
        os.setxattr(os.path.join(tb.mounts[0], d), GROUP, f"{scenario}{step}".encode())
        os.setxattr(os.path.join(tb.mounts[0], d), GROUP_SIZE, str(group_size).encode())
    time.sleep(1.1)  # the other nodes' kernels see the new directory (attribute timeout)
    paths = [os.path.join(tb.mounts[i], d, f"rank{i}.bin") for i, _parts in layout]
    rx0, up0, cpu0 = tb.s3_rx_bytes(), tb.uploaded_bytes(), tb.moto_cpu_s()
    closes: dict = {}
    threads = [threading.Thread(target=write_file, args=(p, parts, closes)) for p, (_i, parts) in zip(paths, layout)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(closes) != len(layout):
        raise RuntimeError(f"{len(layout) - len(closes)} writer(s) failed in {scenario} {mode}")
    wrote_s = time.monotonic() - t0
    durable_s = h.wait_durable(paths, DURABLE_TIMEOUT_S) + wrote_s
    s3_rx = tb.s3_rx_bytes() - rx0
    moto_cpu_s = tb.moto_cpu_s() - cpu0
    uploaded = {n: b - up0.get(n, 0) for n, b in tb.uploaded_bytes().items()}
    plan = tb.status(layout[0][0])["cluster"]["last_plan"] if mode == "grouped" else None
    written = sum(len(p) for _i, parts in layout for p in parts)
    return {"scenario": scenario, "mode": mode, "step": step, "close_s": max(closes.values()), "durable_s": durable_s,
            "s3_rx_bytes": s3_rx, "uploaded_by_node": uploaded, "moto_cpu_s": moto_cpu_s, "unique_bytes": unique,
            "written_bytes": written, "lp_bound_s": plan and plan.get("lp_bound_s"),
            "makespan_s": plan and plan.get("makespan_s"), "plan": plan}


# ============================================================== read scenario: N readers of one model file

def drop_caches(tb: Testbed) -> None:
    """Once no pool holds a dirty byte (replicas released), ``aiturbo drop-cache`` on every node."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        busy = {f"n{i}": s["pool"]["dirty_bytes"] for i in tb.mounts if (s := tb.status(i))["pool"]["dirty_bytes"]
                or s["cluster"]["replica_files_held"]}
        if not busy:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"pools still hold dirty bytes after {SETTLE_TIMEOUT_S:.0f} s: {busy}")
        time.sleep(0.2)
    for mnt in tb.mounts.values():
        reply = json.loads(tb.aiturbo("drop-cache", mnt))
        if not reply.get("ok"):
            raise RuntimeError(f"aiturbo drop-cache {mnt}: {reply}")
    left = {f"n{i}": tb.status(i)["pool"]["clean_bytes"] for i in tb.mounts}
    if any(left.values()):
        raise RuntimeError(f"bytes left in the pools after drop-cache: {left}")


def reader_counts(nodes: int) -> list[int]:
    """1, 2, 4, ... up to ``nodes``, and ``nodes`` itself."""
    counts = [n for n in (1 << k for k in range(nodes.bit_length())) if n <= nodes]
    return counts if counts[-1] == nodes else [*counts, nodes]


def prepare_copy(tb: Testbed, source: str, n: int, step: int) -> str:
    """A durable ``cp`` of ``source`` in a fresh group directory with ``group.size`` = n; its name.

    ``group.size`` is set once the copy is durable: the copy has one writer,
    and a size of n would keep its write round waiting for n - 1 more.
    A fresh copy per N: a node joins a file's read round once per version.
    """
    d = os.path.join(tb.mounts[0], f"read-{n}-{step}")
    os.mkdir(d)
    os.setxattr(d, GROUP, f"load{n}-{step}".encode())
    name = os.path.join(os.path.basename(d), "model.bin")
    nn.sh("cp", os.path.join(tb.mounts[0], source), os.path.join(tb.mounts[0], name), timeout=DURABLE_TIMEOUT_S)
    h.wait_durable([os.path.join(tb.mounts[0], name)], DURABLE_TIMEOUT_S)
    for p in (d, os.path.join(tb.mounts[0], name)):
        os.setxattr(p, GROUP_SIZE, str(n).encode())
    return name


def run_read(tb: Testbed, source: str, want: str, n: int, step: int) -> dict:
    drop_caches(tb)
    name = prepare_copy(tb, source, n, step)
    drop_caches(tb)
    time.sleep(1.1)  # the other nodes' kernels see the new directory (attribute timeout)
    fetched0, tx0 = {f"n{i}": tb.status(i)["persist"]["bytes_fetched"] for i in tb.mounts}, tb.s3_tx_bytes()
    ends = h.read_together([os.path.join(tb.mounts[i], name) for i in range(n)], [want] * n, READ_TIMEOUT_S,
                           f"read N={n}")
    wall_s = max(ends)
    s3_tx = tb.s3_tx_bytes() - tx0
    fetched = {f"n{i}": tb.status(i)["persist"]["bytes_fetched"] - fetched0[f"n{i}"] for i in tb.mounts}
    planned = tb.status(0)["cluster"]["last_read_plan"]
    return {"scenario": "read", "mode": "grouped", "step": step, "readers": n, "file_bytes": tb.args.size_mib * MiB,
            "wall_s": wall_s, "s3_tx_bytes": s3_tx, "fetched_by_node": fetched,
            "planned_fetch_by_node": planned and planned.get("fetch_bytes")}


def scenario_read(tb: Testbed, step: int) -> list[dict]:
    data = os.urandom(tb.args.size_mib * MiB)
    want = hashlib.sha256(data).hexdigest()
    source = f"models-{step}/model.bin"
    os.mkdir(os.path.join(tb.mounts[0], os.path.dirname(source)))
    write_file(os.path.join(tb.mounts[0], source), [data], {})
    h.wait_durable([os.path.join(tb.mounts[0], source)], DURABLE_TIMEOUT_S)
    results = []
    for n in reader_counts(tb.n):
        r = run_read(tb, source, want, n, step)
        results.append(r)
        print(f"  read N={n}: {r['wall_s']:.2f} s, S3 tx {r['s3_tx_bytes'] / MiB:.1f} MiB, fetched "
              + " ".join(f"{k}:{v / MiB:.0f}" for k, v in sorted(r["fetched_by_node"].items())) + " MiB", flush=True)
    return results


# ============================================================== running the scenarios

def run_scenarios(tb: Testbed, scenarios: list[str], repeat: int) -> dict[str, list[dict]]:
    """Every selected scenario, one cluster per entry of ``CLUSTERS`` that some mode needs (see ``cluster_of``);
    ``load`` starts its own (``_load.scenario_load``)."""
    results: dict[str, list[dict]] = {s: [] for s in scenarios}
    writes = [s for s in scenarios if s in WRITE_MODES]
    for sync_close, plan in CLUSTERS:
        todo = {s: [m for m in WRITE_MODES[s] if cluster_of(m) == (sync_close, plan)] for s in writes}
        others = [s for s in ("read", "kv") if s in scenarios and (sync_close, plan) == (False, "lp")]
        dcp_modes = [m for m in _dcp.MODES if "dcp" in scenarios and cluster_of(m) == (sync_close, plan)]
        if not any(todo.values()) and not others and not dcp_modes:
            continue
        print(f"starting {tb.n} daemons{' with -o sync_close' if sync_close else ''}"
              f"{' (controller --plan dedup)' if plan == 'dedup' else ''} ...", flush=True)
        tb.start_cluster(sync_close=sync_close, plan=plan)
        for step in range(repeat):
            for scenario, modes in todo.items():
                for mode in modes:
                    r = run_write(tb, scenario, mode, step)
                    results[scenario].append(r)
                    print(f"  {scenario} {mode:10} close {r['close_s']:.2f} s, durable {r['durable_s']:.2f} s, "
                          f"S3 rx {r['s3_rx_bytes'] / MiB:.1f} MiB for {r['unique_bytes'] / MiB:.0f} MiB unique"
                          + (f", LP bound {r['lp_bound_s']:.2f} s" if r["lp_bound_s"] else ""), flush=True)
            if "read" in others:
                results["read"] += scenario_read(tb, step)
            if "kv" in others:
                results["kv"] += _kv.scenario_kv(tb, step)
            for mode in dcp_modes:
                results["dcp"] += _dcp.run_mode(tb, mode, step, master_ip=f"{FABRIC_NET}.1", drop_caches=drop_caches)
        tb.stop_cluster()
    endpoint = f"http://{tb.s3_ip}:{S3_PORT}"
    if "load" in scenarios:  # its clusters mount with each mode's options
        results["load"] += _load.scenario_load(tb, repeat, drop_caches=drop_caches, endpoint=endpoint, bucket=BUCKET)
    for s in writes:  # the clusters ran the modes out of factor order
        results[s].sort(key=lambda r: (r["step"], WRITE_MODES[s].index(r["mode"])))
    for step in range(repeat):  # external peers (--peers) on the same links, once no aiturbofs daemon runs
        for s in writes:
            results[s] += peers.run_modes(tb, s, tb.args.peers, step, write_layout, endpoint=endpoint,
                                          bucket=BUCKET, write_file=write_file)
        if "load" in scenarios:
            results["load"] += _load.run_peers(tb, tb.args.peers, step, endpoint=endpoint, bucket=BUCKET)
    return results


def factor_steps(med: dict[str, dict[str, float]]) -> str:
    """Close and durable time before / after each factor step, for the modes that ran (``med``: mode -> medians)."""
    modes = [m for m in FACTOR_NAMES if m in med]
    steps = [f"{FACTOR_NAMES[a]} -> {FACTOR_NAMES[b]}: close {med[a]['close_s'] / med[b]['close_s']:.2f}x, "
             f"durable {med[a]['durable_s'] / med[b]['durable_s']:.2f}x" for a, b in itertools.pairwise(modes)]
    return "factor steps (time before / time after): " + "; ".join(steps) + "\n" if steps else ""


def persist_s(r: dict) -> float:
    """Close of the slowest writer to durable: the time the plan's LP bound is a bound on
    (it starts from the data staged in DRAM; durable_s also counts the writes)."""
    return max(0.0, r["durable_s"] - r["close_s"])


def moto_note(results: list[dict]) -> str:
    """A warning when moto's CPU, not the shaped links, bounded the durable times of some run."""
    busy = [r["moto_cpu_s"] / r["durable_s"] for r in results]
    if max(busy) < nn.CPU_BOUND_FRACTION:
        return ""
    return (f"\nnote: moto was busy {max(busy):.0%} of a core until durable: the S3 server's CPU, not the "
            "shaped links, bounds the durable times (compare them with the LP bound accordingly)\n")


def write_table(results: list[dict]) -> str:
    """dp / rank0 / sharded: each mode's times and where its bytes went, the plan's bound against the measurement."""
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    peer_text, results = peers.comparison(results), peers.completed(results)

    rows = [[r["mode"], f(r["close_s"]), f(r["durable_s"]), f(r["s3_rx_bytes"] / MiB, "{:.0f}"),
             f(r["s3_rx_bytes"] / r["unique_bytes"]),
             " ".join(f"{n}:{b / MiB:.0f}" for n, b in sorted(r["uploaded_by_node"].items())),
             f"{r['moto_cpu_s']:.1f} ({r['moto_cpu_s'] / r['durable_s']:.0%})",
             f(r["lp_bound_s"], "{:.3f}"), f(r["makespan_s"], "{:.3f}"),
             f(persist_s(r)), f(persist_s(r) / r["lp_bound_s"] if r["lp_bound_s"] else None)]
            for r in results]
    table = h.markdown_table(["mode", "close s (slowest)", "durable s", "S3 rx MiB", "S3 rx / unique",
                              "MiB uploaded per node", "moto CPU s (of durable)", "LP bound s", "plan makespan s",
                              "persist s", "persist / LP bound"], rows)
    med = {m: {k: h.median([r[k] for r in results if r["mode"] == m]) for k in ("close_s", "durable_s")}
           for m in FACTOR_NAMES if any(r["mode"] == m for r in results)}
    g = med["grouped"]
    table += "\n\n" + (f"write-through/grouped close {med['sync_close']['close_s'] / g['close_s']:.2f}x; "
                       if "sync_close" in med else "")
    table += (f"plain/grouped close {med['plain']['close_s'] / g['close_s']:.2f}x, "
              f"durable {med['plain']['durable_s'] / g['durable_s']:.2f}x\n")
    return table + factor_steps(med) + peer_text + moto_note(results)


def read_table(results: list[dict]) -> str:
    def per_node(d: dict | None) -> str:
        return " ".join(f"{n}:{b / MiB:.0f}" for n, b in sorted(d.items())) if d else "-"

    one = h.median([r["wall_s"] for r in results if r["readers"] == 1])
    rows = [[str(r["readers"]), f"{r['wall_s']:.2f}", f"{r['wall_s'] / one:.2f}", f"{r['s3_tx_bytes'] / MiB:.1f}",
             f"{r['s3_tx_bytes'] / r['file_bytes']:.2f}", per_node(r["fetched_by_node"]),
             per_node(r["planned_fetch_by_node"])] for r in results]
    table = h.markdown_table(["N readers", "time s (all finished)", "time(N) / time(1)", "S3 tx MiB",
                              "S3 tx / file", "MiB fetched from storage per node", "MiB planned per node"], rows)
    worst = max(r["wall_s"] for r in results) / one
    return table + (f"\n\nworst time(N)/time(1) {worst:.2f} (issue target <= 1.3: "
                    f"{'met' if worst <= 1.3 else 'NOT met'})\n")


def rates_table(rates: list[dict]) -> str:
    return h.markdown_table(["link", "configured Mbit/s", "achieved Mbit/s", "busiest process CPU", "verdict"],
                            [[r["link"], f"{r['configured_mbit']:.0f}", f"{r['mbit']:.0f}", f"{r['cpu_share_max']:.0%}",
                              r["verdict"]] for r in rates])


# ============================================================== CLI

def scenario_list(text: str) -> list[str]:
    """``--scenario``: ``all`` or a comma list; the chosen scenarios in their run order."""
    chosen = set(SCENARIOS) if text.strip() == "all" else {s.strip() for s in text.split(",") if s.strip()}
    unknown = chosen - set(SCENARIOS)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown scenario {', '.join(sorted(unknown)) or text!r}: "
                                         f"choose from {', '.join(SCENARIOS)} or all")
    return [s for s in SCENARIOS if s in chosen]


def peer_list(text: str) -> list[str]:
    """``--peers``: ``all``, ``none`` or a comma list of the external systems (``_peers.MODES``)."""
    try:
        return peers.mode_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def report(a: argparse.Namespace, results: dict[str, list[dict]]) -> str:
    """One markdown section per scenario that ran."""
    links = f"fabric {a.fabric_mbit:g}, storage {a.storage_mbit:g}, backend {a.backend_mbit:g} Mbit/s (tbf)"
    headers = {
        "dp": f"DP replicas on {a.nodes} emulated nodes: {a.size_mib} MiB identical + {a.shard_mib} MiB shard each; {links}",
        "rank0": f"rank 0 writes the whole checkpoint ({a.size_mib * a.nodes} MiB) on {a.nodes} emulated nodes; {links}",
        "sharded": f"sharded: each of {a.nodes} emulated nodes writes a unique {a.size_mib} MiB shard; {links}",
        "read": (f"read: N of {a.nodes} emulated nodes read one {a.size_mib} MiB model file from cold pools "
                 f"(fresh copy per N, group.size = N); {links}"),
        "kv": _kv.header(a),
        "dcp": (f"dcp: PyTorch DCP save + load, {a.nodes} gloo ranks (one per emulated node), {a.size_mib} MiB "
                f"replicated model + Adam state and a {a.shard_mib} MiB tensor per rank; {links}"),
        "load": _load.header(a),
    }
    tables = {"dp": write_table, "rank0": write_table, "sharded": write_table, "read": read_table, "kv": _kv.table,
              "dcp": _dcp.table, "load": _load.table}
    return "\n".join(f"{headers[s]}\n\n{tables[s](runs)}" for s, runs in results.items() if runs)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 4)[4],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4, help="node daemons, one network namespace each (default 4)")
    ap.add_argument("--fabric-mbit", type=float, default=2000, help="per-node fabric rate each way, Mbit/s (default 2000)")
    ap.add_argument("--storage-mbit", type=float, default=250, help="per-node storage-link rate each way, Mbit/s (default 250)")
    ap.add_argument("--backend-mbit", type=float, default=1000,
                    help="aggregate cap of the link into the S3 namespace, Mbit/s (default 1000; moto itself tops out near 1500)")
    ap.add_argument("--size-mib", type=int, default=64,
                    help="model state every node writes identically; load: the model's size (default 64)")
    ap.add_argument("--shard-mib", type=int, default=16,
                    help="each node's unique shard, appended to the model state; load: a safetensors shard's size (default 16)")
    ap.add_argument("--scenario", type=scenario_list, default=["dp"],
                    help=f"comma list of {', '.join(SCENARIOS)}, or all (default dp)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each mode (medians in the ratios)")
    ap.add_argument("--dram", default="2G", help="each daemon's -o dram= (default 2G)")
    ap.add_argument("--check-s", type=float, default=2.0, help="seconds per link rate check; 0 skips the checks (default 2)")
    ap.add_argument("--peers", type=peer_list, default=[],
                    help=f"external systems run as extra write modes: comma list of {', '.join(peers.MODES)}, all or none "
                         "(default none; install them with scripts/setup.sh --bench)")
    ap.add_argument("--rclone-write-back", default=peers.RCLONE_WRITE_BACK_DEFAULT,
                    help="rclone mount --vfs-write-back: delay from close to upload (default 5s, rclone's own)")
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
        peers.preflight(a.peers)
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
        results = run_scenarios(tb, a.scenario, a.repeat)
        table = report(a, results) + ("\n" + rates_table(rates) + "\n" if rates else "")
        print(table)
        runs = [r for s in a.scenario for r in results[s]]
        md, js = h.save_results("testbed", table, {"args": vars(a), "rates": rates, "runs": runs})
        print(f"results: {md} {js}")
        if _charts.available():
            titles = {s: (f"{s}: {a.nodes} emulated nodes, --size-mib {a.size_mib} --shard-mib {a.shard_mib}; per node "
                          f"storage {a.storage_mbit:g} / fabric {a.fabric_mbit:g}, backend {a.backend_mbit:g} Mbit/s")
                      for s in results}
            print("charts: " + " ".join(_charts.save_all(md[: -len(".md")], results, titles)))
        else:
            print("charts: skipped (matplotlib not installed: pip install -e .[bench])")
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
