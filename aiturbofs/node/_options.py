"""Mount options: one table, parsed and validated with clear messages.

``-o`` takes comma-separated ``name`` or ``name=value`` items, as mount(8)
passes them.  Generic mount(8)/fstab words (``defaults``, ``noauto``,
``_netdev``, ``x-*`` ...) are accepted and ignored; anything unknown is an
error that names the option, so a typo never silently changes behaviour.
"""

import os
import re
import socket
from dataclasses import dataclass, field

from .._errors import ConfigError
from .._limits import (
    CLUSTER_FABRIC_GBPS_DEFAULT,
    CLUSTER_REPLICAS_DEFAULT,
    CLUSTER_SNIC_GBPS_DEFAULT,
    DRAIN_TIMEOUT_S_DEFAULT,
    FULL_BACKEND_WAIT_S,
    IMPORT_TTL_S,
    METRICS_NODE_ADDRESS_DEFAULT,
    PERSIST_RETRY_WINDOW_S,
    PERSIST_YIELD_S,
    POOL_BYTES_MIN,
    POOL_DEFAULT_RAM_FRACTION,
    GiB,
    KiB,
    MiB,
)

IGNORED = {
    "defaults", "rw", "auto", "noauto", "user", "users", "nouser", "nofail", "_netdev",
    "dev", "nodev", "suid", "nosuid", "exec", "noexec", "async", "atime", "noatime",
    "relatime", "norelatime", "diratime", "nodiratime", "loud", "silent",
}

# name -> (kind, help); kind in: size, float (seconds), int, rate (Gbit/s), addr (HOST:PORT), str, path, flag, choice:a|b
OPTIONS = {
    "dram": ("size", "DRAM staging pool budget, e.g. 64G (default: a quarter of RAM)"),
    "spill": ("path", "local disk dir: staged chunks are copied there in the background (crash-safe) and dropped from DRAM under pressure"),
    "staging": ("path", "dir of the backing files that hold staged and cached bytes, kept in DRAM and across a "
                        "daemon crash (default /dev/shm/aiturbofs/<id of the state dir>, a tmpfs of its own with huge "
                        "pages when run as root)"),
    "state_dir": ("path", "local state (SQLite metadata, default spill, log); default /var/lib/aiturbo/<mount id>"),
    "fsync": ("choice:staged|durable", "what fsync waits for: staged (DRAM, default) or durable (backend)"),
    "sync_close": ("flag", "close() waits until the file is durable (write-through)"),
    "drain_timeout": ("float", f"seconds to drain the persist queue at unmount/SIGTERM (default {DRAIN_TIMEOUT_S_DEFAULT:.0f})"),
    "import_ttl": ("float", f"seconds before a directory is re-listed in the backend (default {IMPORT_TTL_S:g})"),
    "persist_retry_window": ("float", f"seconds of transient backend errors before a file is broken (default {PERSIST_RETRY_WINDOW_S:.0f})"),
    "persist_yield": ("float", "seconds a closed file's upload may wait for the application's writes to pause, so that "
                               "the writers' requests are served first (default "
                               f"{PERSIST_YIELD_S:g}; 0: upload at once); fsync, sync_close and aiturbo wait never wait"),
    "full_backend_wait": ("float", "seconds the backend may answer 'full' (ENOSPC, quota) before writers that wait for "
                                   f"memory get ENOSPC (default {FULL_BACKEND_WAIT_S:.0f}); staged data keeps retrying"),
    "s3_endpoint": ("str", "S3 endpoint URL, e.g. http://127.0.0.1:9000"),
    "s3_region": ("str", "S3 region"),
    "s3_anon": ("flag", "anonymous S3 access"),
    "s3_connect_timeout": ("float", "seconds to wait for an S3 connection"),
    "s3_parts_max": ("int", "most parts of one multipart upload (default 10000, S3's limit; lower it for "
                            "S3-compatible stores that allow fewer): files of more chunks send larger parts"),
    "s3_node_probe": ("choice:yes|no", "yes (default): imports HEAD new objects of up to 4095 bytes to find symlinks "
                             "and special files (s3fs-fuse metadata); no: such objects import as files"),
    "allow_other": ("flag", "let other users access the mount, the kernel checking modes (default: on when "
                            "mounted by root, as on a shared training node; allow_other=no to keep it private)"),
    "ro": ("flag", "mount read-only"),
    "datapath": ("choice:auto|passthrough|kernel|pyfuse3", "how bytes reach the backing files: passthrough (the kernel "
                 "writes and reads them itself, FUSE passthrough, Linux 6.9+ and root), kernel (this daemon speaks the "
                 "FUSE protocol and copies every byte), pyfuse3 (libfuse, the portable path), or auto (default: "
                 "passthrough where the kernel and privileges allow it, else pyfuse3)"),
    "kernel_writes": ("choice:disk|dram", "where a file the kernel writes itself (passthrough) keeps its bytes: disk "
                      "(default: a backing file in <spill>/files, held by the page cache, so one file may outgrow DRAM "
                      "while the disk has room) or dram (the staging tmpfs: a file larger than it gets ENOSPC)"),
    "debug": ("flag", "verbose logging"),
    "log": ("path", "log file when daemonized (default <state_dir>/aiturbo.log)"),
    "debug_faults": ("flag", "allow `aiturbo debug-fault` to inject handler errors (tests only)"),
    # --- cluster mode (all nodes: the same meta=, secret_file contents and backend)
    "fabric": ("addr", "cluster mode: serve the peer fabric at HOST:PORT (port 0 picks one); needs secret_file"),
    "transport": ("choice:auto|tcp|rdma", "fabric transport: rdma (pyverbs; docs/rdma.md), tcp, or auto (RDMA where a device exists, default)"),
    "controller": ("addr", "cluster mode: the job controller (`aiturbo controller`) at HOST:PORT; without it grouped files are placed without a round plan"),
    "meta": ("str", "shared metadata URL: postgresql://user@host:port/db, or sqlite:///path for daemons on one host (default: SQLite in state_dir)"),
    "secret_file": ("path", "cluster secret (at least 16 bytes; must not be readable by group or others)"),
    "node": ("str", "this node's name in the cluster (default: the host name)"),
    "replicas": ("int", f"close() returns once every chunk is in this many nodes' DRAM (default {CLUSTER_REPLICAS_DEFAULT} in a cluster, 1 alone)"),
    "fabric_gbps": ("rate", f"this node's compute-fabric rate each way, for the round planner (default {CLUSTER_FABRIC_GBPS_DEFAULT:g})"),
    "snic_gbps": ("rate", f"this node's storage-NIC rate, for the round planner (default {CLUSTER_SNIC_GBPS_DEFAULT:g})"),
    "autogroup": ("choice:on|off", "cluster mode: untagged files of at least a chunk (8 MiB) that several nodes open for "
                                   "reading within a second form a read round on their own, each chunk fetched "
                                   "from storage once (default on; off: only user.aiturbo.group tags group reads)"),
    "metrics": ("addr", f"serve Prometheus metrics at HOST:PORT/metrics, or off (default {METRICS_NODE_ADDRESS_DEFAULT}; taken: an ephemeral loopback port, shown by aiturbo status)"),
}

# addr options that also take the word "off"
ADDR_OFF_OPTIONS = {"metrics"}

_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?")
_SIZE_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}


def parse_size(text: str) -> int:
    m = _SIZE_RE.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"bad size {text!r}: use a number with an optional K/M/G/T suffix, e.g. 64G")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


@dataclass
class NodeConfig:
    backend: str
    mountpoint: str
    foreground: bool = False
    dram_bytes: int = 0
    spill: str | None = None
    staging: str | None = None
    state_dir: str | None = None
    fsync_durable: bool = False
    sync_close: bool = False
    drain_timeout_s: float = DRAIN_TIMEOUT_S_DEFAULT
    import_ttl_s: float = IMPORT_TTL_S
    persist_retry_window_s: float = PERSIST_RETRY_WINDOW_S
    persist_yield_s: float = PERSIST_YIELD_S
    full_backend_wait_s: float = FULL_BACKEND_WAIT_S
    backend_options: dict = field(default_factory=dict)
    allow_other: bool = False
    read_only: bool = False
    datapath: str = "auto"
    kernel_writes: str = "disk"
    debug: bool = False
    log: str | None = None
    debug_faults: bool = False
    fabric: str | None = None
    transport: str = "auto"
    controller: str | None = None
    meta: str | None = None
    secret_file: str | None = None
    node: str = ""
    replicas: int = 1
    fabric_gbps: float = CLUSTER_FABRIC_GBPS_DEFAULT
    snic_gbps: float = CLUSTER_SNIC_GBPS_DEFAULT
    autogroup: bool = True
    metrics: str | None = None  # HOST:PORT, "off", or None: the default port (an ephemeral one if taken)

    @property
    def cluster(self) -> bool:
        return self.fabric is not None


def default_dram_bytes() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(POOL_BYTES_MIN, int(total * POOL_DEFAULT_RAM_FRACTION))


def _convert(name: str, kind: str, value: str | None):
    if kind == "flag":
        if value not in (None, "1", "true", "yes", "0", "false", "no"):
            raise ConfigError(f"option {name} takes no value (got {value!r})")
        return value not in ("0", "false", "no")
    if value is None or value == "":
        raise ConfigError(f"option {name} needs a value: {name}=...")
    if "\0" in value:
        raise ConfigError(f"option {name} must not contain a NUL byte, got {value!r}")
    if kind == "size":
        try:
            return parse_size(value)
        except ConfigError as exc:
            raise ConfigError(f"option {name}: {exc}") from None
        except OverflowError:  # float('9' * 400) is inf
            raise ConfigError(f"option {name}: size {value!r} is too large") from None
    if kind == "float":
        try:
            v = float(value)
        except ValueError:
            raise ConfigError(f"option {name} needs a number of seconds, got {value!r}") from None
        if not (v >= 0 and v < 1e9):
            raise ConfigError(f"option {name} must be between 0 and 1e9, got {value!r}")
        return v
    if kind == "int":
        # isdecimal, not isdigit: int() refuses '²', and a short string cannot hit int()'s digit limit
        if not (value.isascii() and value.isdecimal() and len(value) <= 2 and 1 <= int(value) <= 16):
            raise ConfigError(f"option {name} needs a whole number from 1 to 16, got {value!r}")
        return int(value)
    if kind == "rate":
        try:
            v = float(value)
        except ValueError:
            v = -1.0
        if not 0 < v < 1e6:
            raise ConfigError(f"option {name} needs a rate in Gbit/s above 0, got {value!r}")
        return v
    if kind == "addr":
        if value == "off" and name in ADDR_OFF_OPTIONS:
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not (port.isascii() and port.isdecimal() and len(port) <= 5) or int(port) > 65535:
            raise ConfigError(f"option {name} needs HOST:PORT, got {value!r}")
        return value
    if kind.startswith("choice:"):
        choices = kind[7:].split("|")
        if value not in choices:
            raise ConfigError(f"option {name} must be one of {', '.join(choices)}, got {value!r}")
        return value
    if kind == "path":
        if not os.path.isabs(value):
            raise ConfigError(f"option {name} needs an absolute path, got {value!r}")
        return value
    return value


def parse_options(text: str) -> dict:
    """``a,b=c`` -> {name: converted value}; raises ConfigError naming the problem."""
    out: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, text_value = item.partition("=")
        value = text_value if "=" in item else None
        if name in IGNORED or name.startswith("x-") or name.startswith("comment="):
            continue
        spec = OPTIONS.get(name)
        if spec is None:
            raise ConfigError(f"unknown mount option {name!r} (see mount.aiturbo --help)")
        out[name] = _convert(name, spec[0], value)
    return out


def build_config(backend: str, mountpoint: str, options: dict, *, foreground: bool) -> NodeConfig:
    cfg = NodeConfig(backend=backend, mountpoint=os.path.abspath(mountpoint), foreground=foreground)
    cfg.dram_bytes = options.get("dram") or default_dram_bytes()
    if cfg.dram_bytes < POOL_BYTES_MIN:
        raise ConfigError(f"dram={cfg.dram_bytes} is below the minimum of {POOL_BYTES_MIN} bytes (two chunks)")
    cfg.spill = options.get("spill")
    cfg.state_dir = options.get("state_dir")
    cfg.staging = options.get("staging")
    cfg.fsync_durable = options.get("fsync") == "durable"
    cfg.sync_close = options.get("sync_close", False)
    cfg.drain_timeout_s = options.get("drain_timeout", DRAIN_TIMEOUT_S_DEFAULT)
    cfg.import_ttl_s = options.get("import_ttl", IMPORT_TTL_S)
    cfg.persist_retry_window_s = options.get("persist_retry_window", PERSIST_RETRY_WINDOW_S)
    cfg.persist_yield_s = options.get("persist_yield", PERSIST_YIELD_S)
    cfg.full_backend_wait_s = options.get("full_backend_wait", FULL_BACKEND_WAIT_S)
    cfg.backend_options = {k: v for k, v in options.items() if k.startswith("s3_")}
    # Root mounts for every user of the node (the kernel enforces the modes:
    # default_permissions is always on); anyone else needs user_allow_other.
    cfg.allow_other = options.get("allow_other", os.geteuid() == 0)
    cfg.read_only = options.get("ro", False)
    cfg.datapath = options.get("datapath", "auto")
    cfg.kernel_writes = options.get("kernel_writes", "disk")
    cfg.debug = options.get("debug", False)
    cfg.log = options.get("log")
    cfg.debug_faults = options.get("debug_faults", False)
    cfg.fabric = options.get("fabric")
    cfg.controller = options.get("controller")
    cfg.transport = options.get("transport", "auto")
    cfg.meta = options.get("meta")
    cfg.secret_file = options.get("secret_file")
    cfg.node = options.get("node") or socket.gethostname()
    cfg.replicas = options.get("replicas", CLUSTER_REPLICAS_DEFAULT if cfg.cluster else 1)
    cfg.fabric_gbps = options.get("fabric_gbps", CLUSTER_FABRIC_GBPS_DEFAULT)
    cfg.snic_gbps = options.get("snic_gbps", CLUSTER_SNIC_GBPS_DEFAULT)
    cfg.metrics = options.get("metrics")
    cfg.autogroup = options.get("autogroup", "on") == "on"
    if cfg.cluster and not cfg.secret_file:
        raise ConfigError("fabric= needs secret_file=: peers authenticate with the cluster secret")
    if not cfg.cluster:
        for name in ("controller", "secret_file", "node", "transport"):
            if options.get(name):
                raise ConfigError(f"option {name} is for cluster mode: give fabric=HOST:PORT too")
        if cfg.replicas > 1:
            raise ConfigError(f"replicas={cfg.replicas} needs cluster mode (fabric=HOST:PORT): a single node has one pool")
    return cfg


def options_help() -> str:
    lines = ["mount options (-o name[=value],...):"]
    for name, (kind, text) in OPTIONS.items():
        shown = name if kind == "flag" else f"{name}={kind.upper() if not kind.startswith('choice:') else kind[7:]}"
        lines.append(f"  {shown:<32} {text}")
    lines.append("  generic mount words (defaults, noauto, _netdev, nofail, x-*) are accepted and ignored")
    return "\n".join(lines)
