"""Run one node daemon: state dir, layers, FUSE mount, signals, drain.

Order matters: everything that can fail for a user-fixable reason (bad
backend URL, missing bucket, locked state dir) fails *before* the kernel
mount, with a message that reaches the ``mount.aiturbo`` caller.  A backend
that does not answer is not such a reason: the mount comes up after
BACKEND_CHECK_TIMEOUT_S and persists once it answers (``store.BackendHealth``).  After the
mount, SIGTERM/SIGINT or an external unmount end the FUSE loop; the persist
queue is then drained (bounded by ``drain_timeout``) before the process exits.
"""

import errno
import fcntl
import logging
import os
import signal
import stat
import time
from functools import partial

import trio

from .. import backend as backend_mod
from .. import meta as meta_mod
from .._errors import AiturboError, ConfigError
from .._limits import (
    FUSE_TASKS_MAX,
    MALLOC_MMAP_THRESHOLD_BYTES,
    MALLOC_TRIM_THRESHOLD_BYTES,
    METRICS_NODE_ADDRESS_DEFAULT,
    READ_AHEAD_KB,
    SESSION_END_GRACE_S,
    STAGING_SLACK_BYTES_MIN,
    UNMOUNT_POLL_S,
    VERIFY_CHUNKS_PER_CALL,
)
from .._nursery import open_nursery
from ..cluster import ClusterNode, SingleNode
from ..controller import EmbeddedController
from ..fabric import load_secret, open_transport, parse_address
from ..fuse import Operations, datapath, probe_passthrough
from ..staging import SPILL_FILES_DIR, BackingArea, SpillStore, StagingPool
from ..vfs import Filesystem, VfsLocalSide, VfsOptions
from . import _control, _metrics, _sdnotify, _settle
from ._options import NodeConfig
from ._paths import control_socket, default_staging_dir, default_state_dir

log = logging.getLogger("aiturbofs.node")


class ReadyPipe:
    """Tells the waiting ``mount.aiturbo`` parent that the mount is up (or why not)."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def send(self, message: str) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, message.encode())
        finally:
            os.close(self.fd)
            self.fd = None


def _lock_state_dir(state_dir: str) -> int:
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    mode = stat.S_IMODE(os.stat(state_dir).st_mode)
    if mode & 0o077:
        # Its metadata database names every file, of private directories too.
        log.warning("state dir %s was mode %o, readable by others; made 0700", state_dir, mode)
        os.chmod(state_dir, 0o700)
    fd = os.open(os.path.join(state_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"state dir {state_dir} is in use by another aiturbofs mount", errno_=errno.EBUSY) from None
    return fd


def _set_read_ahead(mountpoint: str) -> None:
    # Not os.stat(mountpoint): that would ask our own, not yet serving, FUSE loop.
    dev = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == mountpoint:
                dev = fields[2]
    if dev is None:
        return
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError as exc:
        log.info("could not set read_ahead_kb on %s: %s", path, exc)


async def _set_read_ahead_after_init(mountpoint: str) -> None:
    # The kernel lowers read_ahead_kb when it processes FUSE INIT, which
    # happens once the loop runs; raise it again after that.
    await trio.sleep(0.3)
    _set_read_ahead(mountpoint)


def _fsname(cfg: NodeConfig) -> str:
    return f"aiturbo:{cfg.backend}"[:200].replace(",", "_")


def _tune_malloc() -> None:
    """Keep 1 MiB request buffers in glibc's heap instead of fresh mmaps.

    pyfuse3 makes a bytes object per write request; with glibc's default
    thresholds a young daemon maps and unmaps each one, paying ~2 page faults
    per 4 KiB written on the FUSE thread (benchmarks/README.md: main-thread
    CPU per GiB written 1.7 s -> 0.8 s with raised thresholds).
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD_BYTES)
    libc.mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD_BYTES)


def _one_line(exc: BaseException) -> str:
    """``exc``'s message as the one line mount(8) prints (a driver's text may span lines)."""
    return " ".join(str(exc).split())


def run_node(cfg: NodeConfig, ready_fd: int | None = None) -> int:
    """Run the daemon until unmounted; returns the process exit code."""
    _tune_malloc()
    ready = ReadyPipe(ready_fd)
    state_dir = cfg.state_dir or default_state_dir(cfg.mountpoint)
    try:
        if not os.path.isdir(cfg.mountpoint):
            raise ConfigError(f"mount point {cfg.mountpoint} is not a directory", errno_=errno.ENOTDIR)
        lock_fd = _lock_state_dir(state_dir)
    except AiturboError as exc:
        log.error("%s", exc)
        ready.send(f"ERR {_one_line(exc)}")
        return 32
    try:
        return trio.run(_main, cfg, state_dir, ready)
    except AiturboError as exc:
        log.error("mount failed: %s", _one_line(exc))
        ready.send(f"ERR {_one_line(exc)}")
        return 32
    finally:
        os.close(lock_fd)


def _cluster_node(cfg: NodeConfig, meta, pool, staging) -> ClusterNode | None:
    """Cluster mode (``fabric=``): this node's fabric endpoint and controller session."""
    if not cfg.cluster:
        return None
    assert cfg.fabric is not None and cfg.secret_file is not None  # cluster mode: the options require secret_file=
    secret = load_secret(cfg.secret_file)
    host, port = parse_address(cfg.fabric)
    transport = open_transport(cfg.transport, cfg.node, secret, host=host, port=port)
    gbps = 1e9 / 8
    return ClusterNode(
        node=cfg.node, replicas=cfg.replicas, controller=cfg.controller, meta=meta, pool=pool, staging=staging,
        transport=transport,
        send_bw=cfg.fabric_gbps * gbps, recv_bw=cfg.fabric_gbps * gbps, snic_bw=cfg.snic_gbps * gbps,
    )


async def _main(cfg: NodeConfig, state_dir: str, ready: ReadyPipe) -> int:
    meta = meta_mod.open_meta(cfg.meta or f"sqlite:///{os.path.join(state_dir, 'meta.db')}")
    await meta.init(root_uid=os.getuid(), root_gid=os.getgid(), root_mode=0o40755)
    # checked by fs.start, under a deadline: an unresponsive backend must not stall the mount
    backend = await backend_mod.open_backend(cfg.backend, dict(cfg.backend_options), check=False)
    spill = SpillStore(cfg.spill or os.path.join(state_dir, "spill"))
    pool = StagingPool(cfg.dram_bytes, spill, eager_spill=cfg.spill is not None)
    staging = BackingArea(cfg.staging or default_staging_dir(state_dir),
                          tmpfs_bytes=None if cfg.staging else _staging_tmpfs_bytes(cfg.dram_bytes),
                          disk_directory=os.path.join(spill.directory, SPILL_FILES_DIR) if cfg.kernel_writes == "disk" else None)
    try:
        _check_staging_room(staging.directory, cfg.dram_bytes)
        cluster = _cluster_node(cfg, meta, pool, staging)  # a bad secret file fails here: after the tmpfs is mounted
        if cluster is None:
            return await _serve(cfg, state_dir, ready, meta, backend, pool, spill, staging, None)
        async with cluster.transport:
            return await _serve(cfg, state_dir, ready, meta, backend, pool, spill, staging, cluster)
    finally:
        staging.close()
        staging.remove_if_empty()  # a mount that failed, or drained: no empty tmpfs left behind


def _staging_tmpfs_bytes(dram_bytes: int) -> int:
    """The size of the staging tmpfs: the budget, plus room for what the accounting rounds (and recovery) over it."""
    return dram_bytes + max(STAGING_SLACK_BYTES_MIN, dram_bytes // 8)


def _check_staging_room(directory: str, dram_bytes: int) -> None:
    """Warn if the staging dir's filesystem is smaller than the budget: writes past it would get ENOSPC."""
    st = os.statvfs(directory)
    room = st.f_blocks * st.f_frsize
    if room < dram_bytes:
        log.warning("staging dir %s holds %d MiB, less than dram=%d MiB: writes may get ENOSPC before the pool is full",
                    directory, room >> 20, dram_bytes >> 20)


async def _serve(cfg: NodeConfig, state_dir: str, ready: ReadyPipe, meta, backend, pool, spill, staging, cluster) -> int:
    controller = EmbeddedController()
    vopts = VfsOptions(
        fsync_durable=cfg.fsync_durable, sync_close=cfg.sync_close, autogroup=cfg.autogroup, import_ttl_s=cfg.import_ttl_s,
        persist_retry_window_s=cfg.persist_retry_window_s, drain_timeout_s=cfg.drain_timeout_s,
        persist_yield_s=cfg.persist_yield_s,
        full_backend_wait_s=cfg.full_backend_wait_s,
        owner_uid=os.getuid(), owner_gid=os.getgid(),
    )
    port = cluster if cluster is not None else SingleNode(controller.report_close)
    fs = Filesystem(meta, backend, pool, vopts, staging=staging, cluster=port)
    ops = Operations(fs, debug_faults=cfg.debug_faults)
    passthrough = await trio.to_thread.run_sync(probe_passthrough)
    name, handing = datapath.choose(cfg.datapath, passthrough)
    fuse = datapath.open_session(name, ops, cfg.mountpoint, fsname=_fsname(cfg), allow_other=cfg.allow_other,
                                 read_only=cfg.read_only, passthrough=handing)
    log.info("fuse_datapath=%s passthrough=%s (%s)", fuse.name, "available" if passthrough.available else "unavailable",
             passthrough.reason)
    started = time.time()
    exit_code = 0
    async with open_nursery() as nursery:
        if cluster is not None:
            cluster.local = VfsLocalSide(fs)
            await nursery.start(cluster.run, cfg.fabric)
        await fs.start(nursery)
        nursery.start_soon(pool.run_spiller)
        # The control socket is up before the mount appears: whoever sees the
        # mount (a test, a health check) can ask the daemon at once.
        metrics_url = await _start_metrics(nursery, cfg, fs, pool, cluster, controller)
        if cluster is not None:
            cluster.metrics_url = metrics_url
        dispatch = _Dispatcher(cfg, fs, pool, controller, ops, started, cluster, metrics_url, passthrough, fuse)
        await nursery.start(partial(_control.serve, control_socket(cfg.mountpoint), dispatch,
                                    long_polls=frozenset({"wait"})))
        try:
            fuse.mount()
        except OSError as exc:
            raise ConfigError(f"FUSE mount of {cfg.mountpoint} failed: {exc.strerror or exc}") from None
        nursery.start_soon(_set_read_ahead_after_init, cfg.mountpoint)
        session = _Session(nursery, fuse)
        nursery.start_soon(_watch_signals, session)
        nursery.start_soon(_watch_unmount, cfg.mountpoint, session)
        log.info("mounted %s at %s (pool %d MiB, staging %s, spill %s, state %s, metrics %s)", cfg.backend, cfg.mountpoint,
                 cfg.dram_bytes >> 20, staging.directory, spill.directory, state_dir, metrics_url or "off")
        ready.send("OK")
        _sdnotify.notify(_sdnotify.READY)  # -f under systemd (Type=notify): the same moment
        try:
            with session.scope:
                await fuse.serve(FUSE_TASKS_MAX)
        except* ConnectionAbortedError as group:
            # The kernel aborted the connection (an admin wrote the
            # connection's sysfs "abort" file): the mount is gone, the staged
            # files are not, so drain them like at an unmount.
            log.error("the kernel aborted the FUSE connection of %s (%s); draining what was staged",
                      cfg.mountpoint, group.exceptions[0])
        finally:
            session.closed = True
            session.stopping()  # an unmount the kernel told us of first: no end() came before
            fuse.close(unmount=True)
        queued = fs.persister.queue_length()
        log.info("unmounted %s; draining %d file(s) to the backend (timeout %.0f s)", cfg.mountpoint, queued, cfg.drain_timeout_s)
        left = await fs.persister.drain(cfg.drain_timeout_s)
        if left:
            names = [await _describe(meta, ino) for ino in left[:20]]
            log.error("drain timed out: %d file(s) not durable: %s%s", len(left), ", ".join(names),
                      " (their staged chunks stay in the staging and spill dirs for the next mount)")
            exit_code = 1
        else:
            log.info("drain complete: every file is durable")
            staging.remove_all()  # nothing staged is left: what the backing files cached goes back to DRAM
        nursery.cancel_scope.cancel()
    await meta.close()
    await backend.aclose()
    return exit_code


async def _start_metrics(nursery, cfg: NodeConfig, fs, pool, cluster, controller) -> str | None:
    """Serve this daemon's Prometheus metrics (``-o metrics``); their URL, or None when off.

    The default port may well be taken (several mounts on one host): then an
    ephemeral loopback port, with a warning; an explicit address that is
    taken fails the mount.
    """
    if cfg.metrics == _metrics.OFF:
        return None
    registry = _metrics.registry_of(_metrics.NodeCollector(fs, pool, cluster, controller, trio.current_time()))
    address = cfg.metrics or METRICS_NODE_ADDRESS_DEFAULT
    return await nursery.start(partial(_metrics.serve_metrics, address, registry, fallback=cfg.metrics is None))


async def _describe(meta, ino: int) -> str:
    try:
        paths = await meta.paths_of(ino)
    except AiturboError:
        paths = []
    return paths[0] if paths else f"inode {ino}"


class _Session:
    """Ends the FUSE session: gracefully, then by cancelling the requests still running.

    ``terminate`` stops taking requests but ``serve`` returns
    only when every running handler has: a writer waiting for pool memory
    (a full backend, a long outage) kept SIGTERM and unmount from ever
    reaching the drain.  After SESSION_END_GRACE_S such requests are
    cancelled; their callers get ENOTCONN from the kernel when the session
    closes (the data they were writing was never acknowledged).
    """

    def __init__(self, nursery: trio.Nursery, fuse):
        self.scope = trio.CancelScope()
        self._nursery = nursery
        self._fuse = fuse
        self._ending = False
        self._stopping = False
        self.closed = False

    def end(self) -> None:
        if self._ending or self.closed:
            return
        self._ending = True
        self.stopping()
        self._fuse.terminate()
        self._nursery.start_soon(self._cancel_after_grace)

    def stopping(self) -> None:
        """Tell systemd the service is stopping (the drain follows), once, at the first sign of it."""
        if not self._stopping:
            self._stopping = True
            _sdnotify.notify(_sdnotify.STOPPING)

    async def _cancel_after_grace(self) -> None:
        await trio.sleep(SESSION_END_GRACE_S)
        if not self.closed:
            log.warning("FUSE requests still running %.0f s after the session ended (writers waiting for memory?): "
                        "cancelling them", SESSION_END_GRACE_S)
            self.scope.cancel()


async def _watch_signals(session: _Session) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s received: unmounting and draining", signal.Signals(signum).name)
            session.end()
            break


def _mounted(mountpoint: str) -> bool:
    """Is ``mountpoint`` in this mount namespace's table?  (Sends no FUSE request.)"""
    with open("/proc/self/mountinfo", "rb") as f:
        table = f.read()
    want = os.fsencode(mountpoint)
    for line in table.splitlines():
        fields = line.split(b" ")
        # field 5 is the mount point, with space, tab, newline and backslash octal-escaped
        if len(fields) > 4 and fields[4].decode("unicode_escape").encode("latin-1") == want:
            return True
    return False


async def _watch_unmount(mountpoint: str, session: _Session) -> None:
    """End the session once the mount is gone from the mount table.

    A lazy unmount (``umount -l``, ``fusermount -uz``) detaches the mount at
    once, but the kernel ends the FUSE session only when the last process
    using it lets go: a writer waiting for pool memory kept the daemon from
    noticing (90 s and more), and so from draining.  The table tells at once.
    """
    # abspath, not realpath: a stat of our own mount point from the trio
    # thread would wait for the answer only this thread can give.
    target = os.path.abspath(mountpoint)
    while True:  # (the session has mounted it: not in the table means unmounted)
        await trio.sleep(UNMOUNT_POLL_S)
        if not _mounted(target):
            log.info("%s is no longer mounted (lazy unmount?): ending the session and draining", mountpoint)
            session.end()
            return


class _Dispatcher:
    """Answers control-socket requests from the running daemon's state."""

    def __init__(self, cfg, fs, pool, controller, ops, started, cluster, metrics_url, passthrough, fuse):
        self.cfg, self.fs, self.pool, self.controller, self.ops, self.started = cfg, fs, pool, controller, ops, started
        self.cluster, self.metrics_url = cluster, metrics_url
        self.passthrough, self.fuse = passthrough, fuse

    async def __call__(self, request: dict) -> dict:
        cmd = request.get("cmd")
        if cmd == "status":
            return await self._status()
        if cmd == "drop-cache":
            return {"ok": True, "freed_bytes": self.pool.drop_clean()}
        if cmd == "verify":
            first, count = int(request.get("first", 0)), int(request.get("count", VERIFY_CHUNKS_PER_CALL))
            if first < 0 or not 0 < count <= VERIFY_CHUNKS_PER_CALL:
                return {"ok": False, "error": f"verify: chunks from {first}, {count} of them: out of range"}
            return await self.fs.persister.verify(int(request["ino"]), first, count)
        if cmd == "repair":
            return await self.fs.restage(int(request["ino"]))
        if cmd == "wait":
            inos, timeout_s = _settle.parse(request)
            return {"ok": True, "states": await _settle.settle(self.fs, inos, timeout_s)}
        if cmd == "debug-fault":
            self.ops.faults.arm(str(request.get("handler")), int(request.get("count", 1)))
            return {"ok": True}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    async def _status(self) -> dict:
        p = self.fs.persister
        queued = [await _describe(self.fs.meta, ino) for ino in p.queued()[:20]]
        return {
            "ok": True,
            "mountpoint": self.cfg.mountpoint,
            "backend": self.cfg.backend,
            "backend_state": self.fs.health.status(),
            "uptime_s": round(time.time() - self.started, 1),
            "metrics": self.metrics_url,
            "pool": vars(self.pool.stats()),
            "staging": {"dir": self.fs.staging.directory, "allocated_bytes": self.fs.staging.bytes_allocated(),
                        "disk_dir": self.fs.staging.disk_directory,
                        "disk_allocated_bytes": self.fs.staging.bytes_allocated(on_disk=True)},
            # the data path serving requests; whether the kernel would take backing files (FUSE passthrough)
            "fuse": {"datapath": self.fuse.name, "passthrough_available": self.passthrough.available,
                     "passthrough": self.passthrough.reason, **self.fuse.counts()},
            "persist": {
                "queue": p.queue_length(), "queued": queued, "bytes_uploaded": p.stats.bytes_uploaded,
                "bytes_fetched": self.fs.store.bytes_fetched, "bytes_copied": p.stats.bytes_copied,
                "bytes_uploaded_for_peers": p.stats.bytes_uploaded_for_peers, "files_durable": p.stats.files_durable,
                "attrs_persisted": p.stats.attrs_persisted,
                "files_broken": p.stats.files_broken, "retries": p.stats.retries, "read_retries": self.fs.store.read_retries,
                "objects_hashed": self.fs.objects.manifests_recorded,
                "backend_full_s": p.backend_full_s(),
            },
            "meta": {"calls": dict(self.fs.meta.calls)},
            "groups": self.controller.summary(),
            "cluster": self.cluster.status() if self.cluster is not None else None,
            "nodes": await self.cluster.nodes_status() if self.cluster is not None else None,
            "errors": self.fs.errors[-20:],
        }
