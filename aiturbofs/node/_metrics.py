"""Prometheus metrics of a daemon or a controller, served on the trio thread.

``serve_metrics`` answers ``GET /metrics`` with ``generate_latest`` of a
per-process ``CollectorRegistry``; it is a tiny HTTP/1.0 server inside the
caller's nursery, so each scrape reads the daemon's objects on the trio
thread that owns them.  prometheus_client's own HTTP thread is never started:
it would read the pool and the persister while trio changes them.

The collectors compute every figure at scrape time from the objects that
already keep it (the pool, the persister, the cluster node, the controller's
round keeper): nothing is added to the write path.  They never await and
never raise on a missing part (a single node has no cluster).
"""

from __future__ import annotations

import errno
import logging

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    SummaryMetricFamily,
)

from .._errors import ConfigError
from .._limits import (
    METRICS_CALL_TIMEOUT_S,
    METRICS_CLIENTS_MAX,
    METRICS_CONTROLLER_ADDRESS_DEFAULT,
    METRICS_REQUEST_BYTES_MAX,
)
from ..fabric import format_address

log = logging.getLogger(__name__)

OFF = "off"


def _counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def _gauge(name: str, doc: str, value: float | None = None, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, labels=labels)


class NodeCollector:
    """The figures of one node daemon (see module doc)."""

    def __init__(self, fs, pool, cluster, controller, started_s: float):
        self.fs, self.pool, self.cluster, self.controller = fs, pool, cluster, controller
        self.started_s = started_s

    def describe(self):
        return []  # computed at scrape time: the registry must not call collect() at register

    def collect(self):
        yield from self._pool()
        yield from self._persist()
        yield from self._groups()
        if self.cluster is not None:
            yield from self._cluster()

    def _pool(self):
        s = self.pool.stats()
        g = _gauge("aiturbo_pool_bytes", "Bytes of the DRAM staging pool by state: dirty (not yet durable), "
                   "clean (read cache), open (chunks being written), free (recycled buffers), "
                   "spilled (copies on the spill disk); disk_dirty and disk_clean: chunks of files the kernel wrote, "
                   "in their backing files on disk (the page cache, not the budget)", labels=["state"])
        for state in ("dirty", "clean", "open", "free", "spilled", "disk_dirty", "disk_clean"):
            g.add_metric([state], getattr(s, f"{state}_bytes"))
        yield g
        yield _gauge("aiturbo_pool_used_bytes", "Bytes of DRAM the pool holds (counted against the budget)", s.used_bytes)
        yield _gauge("aiturbo_pool_budget_bytes", "The DRAM pool's byte budget (-o dram)", s.budget_bytes)
        yield _gauge("aiturbo_pool_pinned_chunks", "Chunks that must not be lost (not yet durable)", s.pinned_chunks)
        yield _gauge("aiturbo_pool_waiting_writers", "Writers waiting for pool memory (backpressure)", s.waiting_writers)
        yield _gauge("aiturbo_staging_allocated_bytes", "Bytes the backing files in the staging dir allocate "
                     "(DRAM when it is a tmpfs)", self.fs.staging.bytes_allocated())
        yield _gauge("aiturbo_staging_disk_allocated_bytes", "Bytes the backing files on disk allocate (files the kernel "
                     "wrote, -o kernel_writes=disk: the page cache and the disk, not the budget)",
                     self.fs.staging.bytes_allocated(on_disk=True))

    def _persist(self):
        p = self.fs.persister
        queued = p.queued()
        sizes = [node.row.size for ino in queued if (node := self.fs.inodes.get(ino)) is not None]
        yield _gauge("aiturbo_persist_queue_files", "Files queued or being persisted to the backend", len(queued))
        yield _gauge("aiturbo_persist_queue_bytes", "Sizes of the queued files this daemon holds in memory", sum(sizes))
        yield _gauge("aiturbo_backend_available", "1 while the backend answers; 0 while it is unavailable (writes are "
                     "staged, persisted when it answers)", 1 if self.fs.health.available else 0)
        c = _counter("aiturbo_backend_bytes", "Bytes moved to and from the backend: uploaded (sent), fetched "
                     "(read back), copied (materialised by server-side copy, never sent: dedup)", labels=["direction"])
        c.add_metric(["uploaded"], p.stats.bytes_uploaded)
        c.add_metric(["fetched"], self.fs.store.bytes_fetched)
        c.add_metric(["copied"], p.stats.bytes_copied)
        yield c
        yield _counter_value("aiturbo_backend_uploaded_for_peers_bytes",
                             "Bytes uploaded from here for parts of other nodes' files (round plans)",
                             p.stats.bytes_uploaded_for_peers)
        c = _counter("aiturbo_files_persisted", "Persists finished, by result", labels=["result"])
        c.add_metric(["durable"], p.stats.files_durable)
        c.add_metric(["broken"], p.stats.files_broken)
        yield c
        c = _counter("aiturbo_errors", "Errors by kind: backend_retry (transient backend error, retried), "
                     "broken_file (a file marked broken), logged (errors shown by aiturbo status)", labels=["kind"])
        c.add_metric(["backend_retry"], p.stats.retries)
        c.add_metric(["backend_read_retry"], self.fs.store.read_retries)
        c.add_metric(["broken_file"], p.stats.files_broken)
        c.add_metric(["logged"], getattr(self.fs, "errors_total", len(self.fs.errors)))
        yield c
        yield _counter_value("aiturbo_verify_problems", "Backend objects aiturbo verify found missing, of another "
                             "size, or with chunks other than the manifest's", p.stats.verify_problems)
        yield _gauge("aiturbo_uptime_seconds", "Seconds since the daemon started", trio.current_time() - self.started_s)

    def _groups(self):
        summary = self.controller.summary()
        if not summary:
            return
        c = _counter("aiturbo_group_chunks", "Chunks of the files closed in a group (logical)", labels=["group"])
        d = _gauge("aiturbo_group_distinct_chunks", "Distinct chunks of a group's files (dedup: unique)", labels=["group"])
        b = _counter("aiturbo_group_bytes", "Bytes of the files closed in a group", labels=["group"])
        for name, g in summary.items():
            c.add_metric([name], g["chunks"])
            d.add_metric([name], g["distinct_chunks"])
            b.add_metric([name], g["bytes"])
        yield from (c, d, b)

    def _cluster(self):
        cl = self.cluster
        st = cl.stats
        m = _gauge("aiturbo_cluster_members", "Nodes this node sees, by state", labels=["state"])
        m.add_metric(["alive"], len(cl.members))
        m.add_metric(["dead"], len(cl.dead))
        yield m
        yield _gauge("aiturbo_controller_connected", "1 while the session with the controller is up",
                     1 if cl.controller_connected() else 0)
        c = _counter("aiturbo_rounds", "Group rounds this node reported files to, by result "
                     "(unplanned: placed alone after no plan came)", labels=["result"])
        c.add_metric(["planned"], st["rounds"])
        c.add_metric(["unplanned"], st["rounds_failed"])
        yield c
        yield SummaryMetricFamily("aiturbo_round_wait_seconds", "From a grouped file's report to its round plan",
                                  count_value=st["rounds"], sum_value=st["round_wait_s_total"])
        yield SummaryMetricFamily("aiturbo_round_plan_seconds", "The controller's solve time of the plans received",
                                  count_value=st["rounds"], sum_value=st["plan_s_total"])
        c = _counter("aiturbo_dedup_bytes", "Bytes of the rounds this node took part in: logical (every file) and "
                     "unique (after dedup across ranks)", labels=["kind"])
        c.add_metric(["logical"], st["round_bytes_total"])
        c.add_metric(["unique"], st["round_unique_bytes_total"])
        yield c
        yield _counter_value("aiturbo_replicated_bytes", "Bytes of chunks this node put on peers (replicas, plans)",
                             st["bytes_replicated"])
        f = _counter("aiturbo_fabric_bytes", "Bytes moved over the peer fabric, by peer and direction",
                     labels=["peer", "direction"])
        corrupt = 0
        for peer, pc in cl.transport.counters().items():
            f.add_metric([peer, "sent"], pc.bytes_sent)
            f.add_metric([peer, "received"], pc.bytes_received)
            corrupt += pc.corrupt_frames
        yield f
        yield _counter_value("aiturbo_fabric_corrupt_chunks", "Chunks from peers that failed their BLAKE3 check",
                             corrupt)


def _counter_value(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class ControllerCollector:
    """The figures of the cluster controller (``aiturbo controller``)."""

    def __init__(self, server):
        self.server = server

    def describe(self):
        return []

    def collect(self):
        srv = self.server
        nodes = _gauge("aiturbo_controller_nodes", "Nodes the controller knows, by state", labels=["state"])
        counts: dict[str, int] = {"alive": 0, "dead": 0, "left": 0}
        for n in srv.nodes.values():
            counts[n.state] = counts.get(n.state, 0) + 1
        for state, k in counts.items():
            nodes.add_metric([state], k)
        yield nodes
        for keeper, kind in ((srv.rounds, "write"), (srv.reads, "read")):
            yield from _keeper_metrics(keeper, kind)


def _keeper_metrics(keeper, kind: str):
    stats = keeper.stats()
    c = _counter(f"aiturbo_controller_{kind}_rounds", f"Grouped {kind} rounds, by result", labels=["result"])
    c.add_metric(["planned"], sum(g["rounds"] for g in stats.values()))
    c.add_metric(["failed"], sum(g["errors"] for g in stats.values()))
    c.add_metric(["short"], sum(g["short_rounds"] for g in stats.values()))
    yield c
    yield SummaryMetricFamily(f"aiturbo_controller_{kind}_plan_seconds", f"Solve time of the {kind} round plans",
                              count_value=keeper.plans, sum_value=keeper.plan_s_total)
    yield SummaryMetricFamily(f"aiturbo_controller_{kind}_makespan_seconds",
                              f"Planned makespan of the {kind} rounds", count_value=keeper.plans,
                              sum_value=keeper.makespan_s_total)
    d = _counter(f"aiturbo_controller_{kind}_dedup_bytes", f"Bytes of the {kind} rounds: logical (every file), "
                 "unique (after dedup), durable (already in the backend: copied, not sent)", labels=["kind"])
    d.add_metric(["logical"], sum(g["bytes"] for g in stats.values()))
    d.add_metric(["unique"], sum(g["unique_bytes"] for g in stats.values()))
    d.add_metric(["durable"], sum(g["durable_bytes"] for g in stats.values()))
    yield d


def registry_of(collector) -> CollectorRegistry:
    """A fresh registry holding only ``collector`` (no process-global default metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def parse_metrics_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` / ``[v6]:port`` (port 0: any free one); ``ConfigError`` if malformed."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not (port.isascii() and port.isdecimal()) or int(port) > 65535:
        raise ConfigError(f"metrics address {address!r}: want HOST:PORT, or off")
    return host, int(port)


async def _listen(address: str, *, fallback: bool) -> list[trio.SocketListener]:
    host, port = parse_metrics_address(address)
    try:
        return await trio.open_tcp_listeners(port, host=host, backlog=METRICS_CLIENTS_MAX)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise ConfigError(f"metrics endpoint {address}: {exc.strerror or exc}") from None
        if not fallback:
            raise ConfigError(f"metrics endpoint {address} is taken by another process: choose another "
                              f"HOST:PORT or off") from None
        log.warning("metrics_port_taken address=%s fallback=ephemeral (another mount or exporter has it)", address)
        return await trio.open_tcp_listeners(0, host=host, backlog=METRICS_CLIENTS_MAX)


async def serve_metrics(address: str, registry: CollectorRegistry, *, fallback: bool,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``registry`` at ``http://address/metrics``; ``task_status.started(url)``.

    ``fallback``: ``address`` is the default, so a taken port means an
    ephemeral one on the same host (a warning) instead of a ``ConfigError``.
    Runs until cancelled.
    """
    listeners = await _listen(address, fallback=fallback)
    host, port = listeners[0].socket.getsockname()[:2]
    url = f"http://{format_address(host, port)}/metrics"
    limiter = trio.CapacityLimiter(METRICS_CLIENTS_MAX)

    async def handle(stream: trio.SocketStream) -> None:
        async with limiter, stream:
            with trio.move_on_after(METRICS_CALL_TIMEOUT_S):
                head = b""
                while b"\r\n\r\n" not in head and b"\n\n" not in head and len(head) < METRICS_REQUEST_BYTES_MAX:
                    more = await stream.receive_some(4096)
                    if not more:
                        break
                    head += more
                await stream.send_all(_answer(head, registry))

    log.info("metrics_serving url=%s", url)
    task_status.started(url)
    await trio.serve_listeners(handle, listeners)


def _answer(head: bytes, registry: CollectorRegistry) -> bytes:
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
        return _response(b"405 Method Not Allowed", b"text/plain", b"only GET /metrics\n")
    if parts[1].split(b"?", 1)[0] not in (b"/metrics", b"/"):
        return _response(b"404 Not Found", b"text/plain", b"metrics are at /metrics\n")
    return _response(b"200 OK", CONTENT_TYPE_LATEST.encode(), generate_latest(registry), head=parts[0] == b"HEAD")


def _response(status: bytes, content_type: bytes, body: bytes, *, head: bool = False) -> bytes:
    return (b"HTTP/1.0 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + (b"" if head else body))


def controller_endpoint(address: str | None):
    """The ``metrics`` hook of ``run_controller`` for ``--metrics`` (None: off).

    ``address`` None means the default loopback port, with the same fallback
    to an ephemeral port as a daemon's ``-o metrics``.
    """
    if address == OFF:
        return None
    if address is not None:
        parse_metrics_address(address)  # a malformed address fails before anything is served

    async def serve(server, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        registry = registry_of(ControllerCollector(server))
        await serve_metrics(address or METRICS_CONTROLLER_ADDRESS_DEFAULT, registry, fallback=address is None,
                            task_status=task_status)

    return serve
