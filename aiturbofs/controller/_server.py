"""The cluster controller: membership and group rounds, served over the fabric.

``ControllerServer`` answers the control messages of authenticated nodes
(``messages.ToController``: join, heartbeat, report, read_report, read_join,
leave, status), declares nodes dead when their heartbeats stop, and runs the
``RoundKeeper``.  Membership is recorded in the
metadata engine and loaded from it at start, so a restarted controller knows
the cluster again; everything else is re-reported by the nodes.

It never serves chunks: ``get_chunk`` has none, ``put_chunk`` refuses.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from dataclasses import asdict, dataclass

import trio

from .._errors import AiturboError, ConfigError, InvalidArgument, NoSpace, NotPermitted
from .._limits import (
    CONTROLLER_REQUESTS_PER_PEER_MAX,
    NODE_DEAD_AFTER_S,
    NODE_HEARTBEAT_S,
    NODES_MAX,
    ROUND_WAIT_MAX_S,
    ROUND_WINDOW_S,
    STATUS_SUMMARY_BYTES_MAX,
)
from .._nursery import open_nursery
from ..fabric import PeerInfo, TcpTransport, load_secret
from ..messages import (
    Answer,
    ControllerStatus,
    FirstReader,
    FromNode,
    Heartbeat,
    Join,
    Joined,
    Leave,
    Membership,
    NodeListing,
    Ok,
    ReadJoin,
    ReadReport,
    Refused,
    Report,
    Status,
    ToController,
    decode,
    encode,
)
from ..meta import NODE_ALIVE as ALIVE
from ..meta import NODE_DEAD as DEAD
from ..meta import NODE_LEFT as LEFT
from ..meta import open_meta
from ..planner import NodeSpec, Planner
from ._reads import ReadRoundKeeper
from ._rounds import PLAN_MODES, Planned, RoundKeeper

log = logging.getLogger(__name__)

CONTROLLER_NODE = "controller"  # the controller's name on the fabric
_SPEC_FIELDS = ("send_bw", "recv_bw", "snic_bw", "dram_free")


@dataclass
class _Node:
    name: str
    fabric: str
    state: str
    info: dict  # the bandwidths and free DRAM it reported (_SPEC_FIELDS)
    seen_s: float  # trio clock of its last join or heartbeat

    def listing(self) -> NodeListing:
        return NodeListing(node=self.name, fabric=self.fabric, state=self.state)


def _spec(info: dict) -> NodeSpec:
    """A node's planner figures from a join's figures or a stored info; ``InvalidArgument`` if malformed."""
    vals = [
        v for k in _SPEC_FIELDS
        if isinstance(v := info.get(k), (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    ]
    if len(vals) != len(_SPEC_FIELDS):
        raise InvalidArgument(f"join: {', '.join(_SPEC_FIELDS)} must be numbers >= 0 (bytes/s, bytes)")
    return NodeSpec(float(vals[0]), float(vals[1]), float(vals[2]), int(vals[3]))


class ControllerServer:
    """A ``ChunkHandler`` for the controller's fabric endpoint (see module doc).

    ``meta`` needs ``nodes``, ``upsert_node``, ``node_heartbeat``,
    ``set_node_state`` and ``chunk_sources``.  ``backend_bw`` is in bytes/s.
    ``plan`` is how write rounds are planned (``_rounds.PLAN_MODES``).
    """

    def __init__(self, meta, *, backend_bw: float, planner: Planner | None = None,
                 heartbeat_s: float = NODE_HEARTBEAT_S, dead_after_s: float = NODE_DEAD_AFTER_S,
                 window_s: float = ROUND_WINDOW_S, wait_max_s: float = ROUND_WAIT_MAX_S, plan: str = "lp"):
        assert 0 < heartbeat_s < dead_after_s
        self.meta = meta
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.nodes: dict[str, _Node] = {}  # every node known, whatever its state
        self.members: dict[str, NodeSpec] = {}  # alive and joined: what rounds are planned over
        self.rounds = RoundKeeper(meta, self.members, backend_bw=backend_bw, planner=planner,
                                  window_s=window_s, wait_max_s=wait_max_s, plan=plan)
        self.reads = ReadRoundKeeper(meta, self.members, backend_bw=backend_bw, planner=planner,
                                  window_s=window_s, wait_max_s=wait_max_s)

    async def run(self, transport, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Load the membership, serve on ``transport``; ``task_status.started(address)``; runs until cancelled."""
        await self._load()
        async with open_nursery() as nursery:
            address = await nursery.start(transport.serve, self)
            nursery.start_soon(self._reap)
            task_status.started(address)

    # ------------------------------------------------------------------ ChunkHandler
    async def get_chunk(self, peer: PeerInfo, key: bytes) -> None:
        return None

    async def put_chunk(self, peer: PeerInfo, key: bytes, data: bytearray) -> bool:
        return False

    async def control(self, peer: PeerInfo, body: dict) -> dict:
        request = decode(body, ToController)  # MalformedMessage: this request fails, the others go on
        if isinstance(request, Status):
            return encode(self.status())
        if not isinstance(request, FromNode):
            raise InvalidArgument(f"unknown controller op {request.op!r}")
        if request.node != peer.node:
            log.warning("%s from %s at %s claims to be node %r: refused", request.op, peer.node, peer.address,
                        request.node)
            raise NotPermitted(f"{request.op}: authenticated as {peer.node!r}, not {request.node!r}")
        return encode(await self._answer(request))

    async def _answer(self, request: FromNode) -> Answer:
        match request:
            case Join():
                return await self._join(request)
            case Heartbeat():
                return await self._heartbeat(request)
            case Report():
                return await self._report(request)
            case ReadReport():
                return await self._read_report(request)
            case ReadJoin():
                return self._read_join(request)
            case Leave():
                return await self._leave(request)
        raise InvalidArgument(f"unknown controller op {request.op!r}")

    # ------------------------------------------------------------------ ops
    async def _join(self, join: Join) -> Joined:
        name = join.node
        info = {"send_bw": join.send_bw, "recv_bw": join.recv_bw, "snic_bw": join.snic_bw, "dram_free": join.dram_free}
        spec = _spec(info)
        if not join.fabric:
            raise InvalidArgument("join: fabric must be the node's host:port")
        if name not in self.nodes and len(self.nodes) >= NODES_MAX:
            raise NoSpace(f"join: the controller tracks {NODES_MAX} nodes already")
        await self.meta.upsert_node(name, join.fabric, info, time.time_ns())
        rejoin = name in self.nodes
        self.nodes[name] = _Node(name, join.fabric, ALIVE, info, trio.current_time())
        self.members[name] = spec
        log.info("node_%s node=%s fabric=%s", "rejoined" if rejoin else "joined", name, join.fabric)
        return Joined(ok=True, heartbeat_s=self.heartbeat_s, nodes=tuple(n.listing() for n in self.nodes.values()))

    async def _heartbeat(self, beat: Heartbeat) -> Membership | Refused:
        name = beat.node
        node = self.nodes.get(name)
        if node is None or name not in self.members:
            return Refused(error="not joined")
        node.seen_s = trio.current_time()
        if beat.dram_free is not None:
            info = {**node.info, "dram_free": beat.dram_free}
            self.members[name], node.info = _spec(info), info
        if beat.summary is not None and len(json.dumps(beat.summary)) <= STATUS_SUMMARY_BYTES_MAX:
            node.info = {**node.info, "summary": beat.summary}  # what `aiturbo status` shows of it
        await self.meta.node_heartbeat(name, time.time_ns(), node.info)
        return Membership(nodes=tuple(n.listing() for n in self.nodes.values() if n.state == ALIVE),
                          dead=tuple(n.name for n in self.nodes.values() if n.state == DEAD))

    async def _report(self, report: Report) -> Planned | Refused:
        if report.node not in self.members:
            return Refused(error="not joined")
        return await self.rounds.report(report.node, report)

    async def _read_report(self, report: ReadReport) -> Planned | Refused:
        if report.node not in self.members:
            return Refused(error="not joined")
        return await self.reads.report(report.node, report)

    def _read_join(self, join: ReadJoin) -> FirstReader | Refused:
        if join.node not in self.members:
            return Refused(error="not joined")
        return self.reads.join(join.node, join.group)

    async def _leave(self, leave: Leave) -> Ok:
        name = leave.node
        if name in self.nodes and self.nodes[name].state == ALIVE:
            await self._retire(name, LEFT, "left the cluster")
        return Ok()

    def status(self) -> ControllerStatus:
        now = trio.current_time()
        nodes = tuple({**asdict(n.listing()), **n.info, "seen_s_ago": round(now - n.seen_s, 3)}
                      for n in self.nodes.values())
        return ControllerStatus(nodes=nodes, groups=self.rounds.stats(), read_groups=self.reads.stats())

    # ------------------------------------------------------------------ membership
    async def _load(self) -> None:
        """The nodes the metadata engine knows; alive ones get a fresh grace period."""
        now = trio.current_time()
        for row in await self.meta.nodes():
            self.nodes[row.name] = _Node(row.name, row.address, row.state, dict(row.info or {}), now)
            if row.state == ALIVE:
                try:
                    self.members[row.name] = _spec(row.info or {})
                except InvalidArgument:
                    pass  # stored without figures: its next heartbeat is told to join again
        log.info("controller_loaded nodes=%d alive=%d", len(self.nodes), len(self.members))

    async def _reap(self) -> None:
        while True:
            await trio.sleep(self.dead_after_s / 4)
            now = trio.current_time()
            for node in list(self.nodes.values()):
                if node.state == ALIVE and now - node.seen_s > self.dead_after_s:
                    await self._retire(node.name, DEAD, f"no heartbeat for {now - node.seen_s:.1f} s")

    async def _retire(self, name: str, state: str, why: str) -> None:
        self.nodes[name].state = state
        self.members.pop(name, None)
        self.rounds.drop_node(name)
        self.reads.drop_node(name)
        log.warning("node_%s node=%s reason=%r", state, name, why)
        try:
            await self.meta.set_node_state(name, state)
        except AiturboError as e:  # the in-memory view still holds; a restart re-detects it
            log.error("node %s: recording state %s failed: %s", name, state, e)


async def run_controller(listen: str, meta_url: str, secret_path: str, *, backend_gbps: float, plan: str = "lp",
                         metrics=None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the controller on ``listen`` (host:port) until cancelled, SIGTERM or SIGINT.

    ``metrics``: an async ``metrics(server, task_status=...)`` started next to
    the server (the CLI passes the Prometheus endpoint: this layer serves no
    HTTP); a ``ConfigError`` it raises ends the controller before it is started.

    ``plan`` is how write rounds are planned (``_rounds.PLAN_MODES``).
    ``ConfigError`` for a bad address, secret file, plan mode or metadata URL (before
    anything is served); ``task_status.started(address)`` once nodes can
    connect.  Call it from the main thread (it takes over SIGTERM and SIGINT).
    """
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"controller address {listen!r}: want HOST:PORT ([v6addr]:PORT; port 0: any free port)")
    host, port = host.removeprefix("[").removesuffix("]"), int(port_text)
    secret = load_secret(secret_path)
    if not (backend_gbps > 0 and math.isfinite(backend_gbps)):
        raise ConfigError(f"backend bandwidth must be a positive number of Gbit/s, not {backend_gbps}")
    if plan not in PLAN_MODES:
        raise ConfigError(f"plan mode {plan!r}: choose one of {', '.join(PLAN_MODES)}")
    meta = open_meta(meta_url)
    try:
        await meta.init(root_uid=os.getuid(), root_gid=os.getgid(), root_mode=0o40755)
        server = ControllerServer(meta, backend_bw=backend_gbps * 1e9 / 8, plan=plan)
        transport = TcpTransport(CONTROLLER_NODE, secret, host=host, port=port,
                                 in_flight_max=CONTROLLER_REQUESTS_PER_PEER_MAX)
        async with transport, open_nursery() as nursery:
            address = await nursery.start(server.run, transport)
            if metrics is not None:
                await nursery.start(metrics, server)
            log.info("controller listening on %s (backend %.1f Gbit/s, write rounds: %s)", address, backend_gbps,
                     "LP plan" if plan == "lp" else "dedup only, no plan")
            task_status.started(address)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("controller: %s, exiting", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break
    finally:
        with trio.CancelScope(shield=True):
            await meta.close()
