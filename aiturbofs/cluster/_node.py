"""This node's part of a cluster: fabric endpoint, controller session, replicas.

``ClusterNode`` implements the VFS's ``ClusterPort`` and the fabric's
``ChunkHandler``; what it needs of the VFS (a chunk for a chain successor, a
part of another node's upload, a takeover) it asks its ``LocalSide``:

- **stage** (close(), future 0): a grouped file is reported to the
  controller, which answers with the round's plan: the transfers this node
  makes, who holds the file's chunks afterwards and how its upload is split
  (dedup).  Without a plan (an ungrouped file, or no answer from the
  controller within ``CLUSTER_REPORT_TIMEOUT_S``) the node places the
  replicas itself on the next live nodes (rendezvous hashing by inode).
  Each receiver pins the chunks under a ``hold`` for the inode and releases
  them once the shared metadata says the file is durable (or gone).
- **membership** comes from the shared metadata (the controller records
  joins, heartbeats and deaths there), so a controller restart does not
  change who is alive; the session to the controller re-joins by itself.
- **takeover**: files whose owner the controller declared dead are
  persisted by their first live holder (``LocalSide.take_over``).
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, TypeVar

import trio

from .. import chunk
from .._errors import (
    AiturboError,
    AuthFailed,
    InvalidArgument,
    MalformedMessage,
    NotFound,
    PeerBroken,
    PeerClosed,
    PeerSlow,
    RemoteError,
)
from .._limits import (
    AUTOGROUP_JOIN_WAIT_S,
    CLUSTER_CHAIN_LINGER_S,
    CLUSTER_CHAIN_PLAN_SKEW_S,
    CLUSTER_HEAD_FETCHES_IN_FLIGHT,
    CLUSTER_HOLD_PENDING_S,
    CLUSTER_PREFETCH_IN_FLIGHT,
    CLUSTER_READ_PLAN_WAIT_S,
    CLUSTER_READ_ROUNDS_KEPT,
    CLUSTER_READ_WAIT_S,
    CLUSTER_RECONNECT_S,
    CLUSTER_REPORT_TIMEOUT_S,
    CLUSTER_TAKEOVER_PERIOD_S,
    CLUSTER_UNREACHABLE_RETRY_S,
    FABRIC_CALL_TIMEOUT_S,
    HASH_BYTES,
    PEER_UPLOAD_PART_TIMEOUT_S,
)
from .._nursery import open_nursery
from ..fabric import Named, Peer, PeerInfo, Transport, format_address, parse_address
from ..messages import (
    Answer,
    FileChunks,
    FirstReader,
    Heartbeat,
    Hold,
    Join,
    Joined,
    Membership,
    Ok,
    ReadJoin,
    ReadPlan,
    ReadReport,
    Receipt,
    Refused,
    Report,
    ToNode,
    UploadPart,
    WritePlan,
    decode,
    decode_answer,
    encode,
)
from ..meta import NODE_ALIVE, NODE_DEAD, STATE_BROKEN, STATE_DURABLE, STATE_PERSISTING, STATE_STAGED
from ..staging import BackingArea, Pins, content_key_of
from ._port import CopySource, LocalSide, PersistHints, ReadRequest, Staged, StageRequest

log = logging.getLogger("aiturbofs.cluster")

PUTS_IN_FLIGHT_PER_PEER = 4  # chunk puts to one replica target at once
_PEER_ERRORS = (PeerBroken, PeerClosed, RemoteError, AuthFailed)
_A = TypeVar("_A", bound=Answer)


def _key(text) -> bytes:
    try:
        key = bytes.fromhex(text)
    except (TypeError, ValueError):
        raise InvalidArgument(f"bad chunk key {text!r}") from None
    if len(key) != HASH_BYTES:
        raise InvalidArgument(f"bad chunk key {text!r}")
    return key


class _Stats(TypedDict):
    """``ClusterNode.stats``: counters, and the figures of the last round plans."""

    rounds: int
    rounds_failed: int
    chunks_replicated: int
    bytes_replicated: int
    chunks_received: int
    chunks_served: int
    chunks_fetched: int
    last_plan: dict[str, Any] | None
    read_rounds: int
    chunks_from_chain: int
    chunks_prefetched: int
    last_read_plan: dict[str, Any] | None
    round_wait_s_total: float
    plan_s_total: float
    round_bytes_total: int
    round_unique_bytes_total: int


_Failed = list[tuple[str, list[bytes]]]  # (target node, the chunks it did not take)


@dataclass
class _PendingPlan:
    """A grouped read's round plan not answered yet."""

    deadline: float  # reads of the file wait for it until then: CLUSTER_READ_WAIT_S after open, not per chunk
    event: trio.Event = field(default_factory=trio.Event)  # set when the answer (or its failure) is in
    skew_spent: bool = False  # a chunk request already waited CLUSTER_CHAIN_PLAN_SKEW_S for it
    released: bool = False  # reads need not wait for it (the first reader of an autogroup round)
    nudge: trio.Event = field(default_factory=trio.Event)  # set (and replaced) when the above change

    def changed(self) -> None:
        self.nudge.set()
        self.nudge = trio.Event()

    async def wait_for_reads(self) -> None:
        """Until the plan is in, reads are released, or the deadline (which may move) passes."""
        while not (self.event.is_set() or self.released) and trio.current_time() < self.deadline:
            with trio.move_on_at(self.deadline):
                await self.nudge.wait()


@dataclass(frozen=True)
class _Link:
    """This node's place in the read chain of one chunk."""

    ino: int
    index: int
    length: int
    upstream: tuple[str, ...]  # predecessor first, back to the head
    downstream: frozenset[str]  # nodes after us: they may wait on us


class ClusterNode:
    """The ``ClusterPort`` of a cluster member (see module doc)."""

    shared = True

    def __init__(self, *, node: str, replicas: int, controller: str | None, meta, pool, staging: BackingArea,
                 transport: Transport, send_bw: float, recv_bw: float, snic_bw: float):
        self.node = node
        self.staging = staging  # replicas received are kept in backing files of their own
        self.replicas = replicas
        self.controller_address = controller
        self.meta = meta
        self.pool = pool
        self.transport = transport
        self.bandwidths = {"send_bw": send_bw, "recv_bw": recv_bw, "snic_bw": snic_bw}
        self.local: LocalSide | None = None  # set by the daemon once the Filesystem exists
        self.address: str | None = None  # where peers reach our fabric endpoint
        self.members: dict[str, str] = {}  # live node -> fabric address (from the metadata)
        self.dead: set[str] = set()
        self._peers: dict[str, Peer] = {}
        self._peer_locks: dict[str, trio.Lock] = {}
        self._controller: Peer | None = None  # while the session is up
        self._holds: dict[int, Pins] = {}  # inode -> replica chunks pinned here for it (one pin per chunk)
        self._pending: dict[bytes, list[float]] = {}  # received chunks no hold claimed yet
        # Grouped reads: rounds joined (ino, version), a reader waiting for a round's
        # plan, and this node's place in the chains of planned rounds
        self._read_rounds: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        self._read_planned: dict[int, _PendingPlan] = {}
        self._chain: dict[bytes, _Link] = {}
        self._unreachable: dict[str, float] = {}  # peer -> when connecting to it last failed
        self._nursery: trio.Nursery | None = None
        self.stats: _Stats = {
            "rounds": 0, "rounds_failed": 0, "chunks_replicated": 0, "bytes_replicated": 0,
            "chunks_received": 0, "chunks_served": 0, "chunks_fetched": 0, "last_plan": None,
            "read_rounds": 0, "chunks_from_chain": 0, "chunks_prefetched": 0, "last_read_plan": None,
            "round_wait_s_total": 0.0, "plan_s_total": 0.0, "round_bytes_total": 0, "round_unique_bytes_total": 0,
        }
        self.metrics_url: str | None = None  # set by the daemon once its metrics endpoint serves

    # ============================================================ lifecycle
    async def run(self, listen: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self._recover_holds()
        async with open_nursery() as nursery:
            self._nursery = nursery
            address = await nursery.start(self.transport.serve, self)
            host, port = parse_address(address)
            if host in ("0.0.0.0", "::", ""):  # listening everywhere: advertise the host's address
                host = socket.gethostbyname(socket.gethostname())
            self.address = format_address(host, port)
            if not self.controller_address:
                # No controller to admit us (daemons sharing metadata on one
                # host): register ourselves.  With a controller, only a node
                # that proved the cluster secret to it becomes a member.
                await self.meta.upsert_node(self.node, self.address, self.bandwidths, time.time_ns())
            await self._refresh_members()
            log.info("fabric_serving node=%s address=%s transport=%s replicas=%d controller=%s",
                     self.node, self.address, self.transport.kind, self.replicas, self.controller_address or "embedded")
            if self.controller_address:
                nursery.start_soon(self._controller_session)
            nursery.start_soon(self._housekeeping)
            task_status.started()

    @property
    def owner(self) -> str:
        return self.node

    def dead_nodes(self) -> set[str]:
        return set(self.dead)

    async def _refresh_members(self) -> None:
        rows = await self.meta.nodes()
        self.members = {r.name: r.address for r in rows if r.state == NODE_ALIVE}
        self.members[self.node] = self.address or ""
        self.dead = {r.name for r in rows if r.state == NODE_DEAD} - {self.node}

    async def _controller_session(self) -> None:
        """Join, then heartbeat; re-join after any failure (controller restart)."""
        address = self.controller_address
        assert address is not None  # run() starts the session only with a controller
        down_since = None
        while True:
            peer = None
            try:
                peer = await self.transport.connect(address)
                joined = decode_answer(await peer.control(encode(self._join_message())), Joined)
                if isinstance(joined, Refused):
                    raise RemoteError(f"join refused: {joined.error}")
                if not joined.ok:
                    raise RemoteError("join refused")
                period = joined.heartbeat_s
                self._controller = peer
                log.info("controller_joined address=%s down_s=%.1f", self.controller_address,
                         time.monotonic() - down_since if down_since else 0.0)
                down_since = None
                while True:
                    await trio.sleep(period)
                    beat = Heartbeat(node=self.node, dram_free=self._dram_free(), summary=self.summary())
                    answer = decode_answer(await peer.control(encode(beat)), Membership)
                    if isinstance(answer, Refused):
                        log.warning("controller: %s; joining again", answer.error)
                        break
            except (*_PEER_ERRORS, MalformedMessage) as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("controller_unreachable address=%s error=%r retry_s=%.0f", self.controller_address, exc, CLUSTER_RECONNECT_S)
            finally:
                self._controller = None
                if peer is not None:
                    await peer.aclose()
            await trio.sleep(CLUSTER_RECONNECT_S)

    def _join_message(self) -> Join:
        assert self.address is not None  # run() serves the fabric before the session starts
        bw = self.bandwidths
        return Join(node=self.node, fabric=self.address, dram_free=self._dram_free(),
                    send_bw=bw["send_bw"], recv_bw=bw["recv_bw"], snic_bw=bw["snic_bw"])

    def _dram_free(self) -> int:
        s = self.pool.stats()
        return max(0, s.budget_bytes - s.dirty_bytes)

    async def _housekeeping(self) -> None:
        while True:
            await trio.sleep(CLUSTER_TAKEOVER_PERIOD_S)
            try:
                if not self.controller_address:
                    await self.meta.node_heartbeat(self.node, time.time_ns(),
                                                   {**self.bandwidths, "summary": self.summary()})
                await self._refresh_members()
                await self._release_holds()
                if self.dead and self.local is not None:
                    await self.local.take_over(self.dead)
            except AiturboError as exc:  # the metadata engine is unreachable: try again
                log.warning("cluster housekeeping: %s", exc)

    async def _recover_holds(self) -> None:
        """After a restart: the replicas a previous run kept here for peers' files not yet durable are held again.

        Each is verified (BLAKE3) against its name first.  What no such file
        needs is removed with the rest of what the previous run left
        (``BackingArea.sweep``, after the persister's own recovery).
        """
        found = self.staging.found_replicas
        if not found:
            return
        restored = 0
        for row in await self.meta.inodes_in_states([STATE_STAGED, STATE_PERSISTING]):
            if self.node not in row.holders or row.owner == self.node or row.nlink == 0 or not row.manifest:
                continue
            first: dict[bytes, int] = {}  # each chunk of the file, at its first index
            for index, key in enumerate(chunk.unpack_manifest(row.manifest)[: chunk.chunk_count(row.size)]):
                if key != chunk.HOLE:
                    first.setdefault(key, index)
            for key, index in first.items():
                length = chunk.chunk_length(row.size, index)
                if self.pool.has(key):
                    self.pool.pin(key)
                elif key in found and await self._replica_verified(key, length):
                    self.pool.recover_replica(key, self.staging.replica(key).range(0), length)
                else:
                    continue  # not kept here (another holder has it), or lost
                self._hold_pins(row.ino).keys.append(key)
                restored += 1
        if restored:
            log.info("recovered replicas=%d for files of other nodes not yet durable", restored)

    async def _replica_verified(self, key: bytes, length: int) -> bool:
        """Does the replica file a previous run left for ``key`` still hash to it?"""
        try:
            return await trio.to_thread.run_sync(content_key_of, self.staging.replica(key).path, 0, length) == key
        except OSError as exc:
            log.warning("replica %s… not recovered: %s", key.hex()[:16], exc)
            return False

    def _hold_pins(self, ino: int) -> Pins:
        """The pins this node holds for ``ino``'s replicas (made empty on first use)."""
        pins = self._holds.get(ino)
        if pins is None:
            pins = self._holds[ino] = Pins(self.pool)
        return pins

    async def _release_holds(self) -> None:
        for ino, pins in list(self._holds.items()):
            try:
                row = await self.meta.get_inode(ino)
                done = row.nlink == 0 or row.state == STATE_BROKEN or (
                    row.state == STATE_DURABLE and row.persisted_version == row.version
                )
            except NotFound:
                done = True
            if done and self._holds.get(ino) is pins:
                del self._holds[ino]
                pins.release()
        cutoff = time.monotonic() - CLUSTER_HOLD_PENDING_S
        for key, times in list(self._pending.items()):
            while times and times[0] < cutoff:
                times.pop(0)
                self.pool.unpin(key)
                log.warning("chunk %s… was received but never claimed by a file: released", key.hex()[:16])
            if not times:
                del self._pending[key]

    # ==================================================== fabric handler
    async def get_chunk(self, peer: PeerInfo, key: bytes):
        data = await self._get_chunk(peer, key)
        if data is None or self.local is None:
            return data
        digest = self.local.content_key(key)  # ``key`` is a chunk's name: say what its bytes hash to
        return data if digest is None else Named(digest, data)

    async def _get_chunk(self, peer: PeerInfo, key: bytes):
        view = self.pool.view(key)
        if view is not None:
            self.stats["chunks_served"] += 1
            return bytes(view)
        if key in self.pool.spill:
            self.stats["chunks_served"] += 1
            return await self.pool.spill.read(key)
        link = self._chain.get(key)
        pending = [p for p in self._read_planned.values() if not p.skew_spent]
        if link is None and pending:
            # A chain successor may ask before our own copy of the plan is in:
            # the round's answers reach its readers within the skew of each
            # other.  A plan still pending after that is a round that has not
            # closed (it waits for more readers), whose successors cannot ask
            # yet; so each pending plan costs one skew wait, not one per chunk
            # asked for (holders' DRAM lookups of a short round's readers
            # each waited the full skew).
            with trio.move_on_after(CLUSTER_CHAIN_PLAN_SKEW_S) as scope:
                for plan in pending:
                    await plan.event.wait()
            if scope.cancelled_caught:
                for plan in pending:
                    plan.skew_spent = True
            link = self._chain.get(key)
        local = self.local
        if link is not None and local is not None and peer.node in link.downstream:
            # Further down one of our read chains: wait until we have it (fetching
            # it if need be).  Only nodes downstream wait, and they only ever ask
            # upstream, so no two nodes wait on each other; anyone else (a chain
            # head looking in holders' DRAM) is answered at once.
            data = await local.read_chunk(link.ino, link.index, key, link.length)
            self.stats["chunks_served"] += 1
            return data
        return None

    async def put_chunk(self, peer: PeerInfo, key: bytes, data: bytearray) -> bool:
        await self.pool.store(key, data, into=self.staging.replica(key).range(0))
        self._pending.setdefault(key, []).append(time.monotonic())
        self.stats["chunks_received"] += 1
        return True

    async def control(self, peer: PeerInfo, body: dict) -> dict:
        request = decode(body, ToNode)  # MalformedMessage: this request fails, the others go on
        match request:
            case Hold():
                self._hold(request.ino, [_key(k) for k in request.keys])
                return encode(Ok())
            case UploadPart():
                if self.local is None:
                    raise RemoteError("not serving yet")
                receipt = await self.local.upload_for_peer(
                    request.backend_key, request.token, request.index, _key(request.key), request.length,
                    list(request.holders),
                )
                return encode(Receipt(receipt=receipt))
        raise InvalidArgument(f"unknown node op {request.op!r} from {peer.node!r}")

    def _hold(self, ino: int, keys: list[bytes]) -> None:
        """Turn received chunks into replicas of ``ino``: pinned until it is durable."""
        pins = self._hold_pins(ino)
        held = set(pins.keys)
        for key in keys:
            times = self._pending.get(key)
            if not times:
                continue  # never arrived (or already expired): the sender counted it as failed
            times.pop(0)
            if not times:
                del self._pending[key]
            if key in held:
                self.pool.unpin(key)  # one pin per file is enough
            else:
                held.add(key)
                pins.keys.append(key)  # the pin store() took is the hold's now

    # ===================================================== peers
    async def _peer(self, name: str):
        peer = self._peers.get(name)
        if peer is not None and peer.state == "open":
            return peer
        failed = self._unreachable.get(name)
        if failed is not None and time.monotonic() - failed < CLUSTER_UNREACHABLE_RETRY_S:
            raise PeerBroken(f"node {name!r} was unreachable {time.monotonic() - failed:.1f} s ago")
        lock = self._peer_locks.setdefault(name, trio.Lock())
        async with lock:
            peer = self._peers.get(name)
            if peer is not None and peer.state == "open":
                return peer
            address = self.members.get(name)
            if not address:
                await self._refresh_members()
                address = self.members.get(name)
            if not address:
                raise PeerBroken(f"node {name!r} is not a live member")
            try:
                peer = self._peers[name] = await self.transport.connect(address)
            except _PEER_ERRORS:
                self._unreachable[name] = time.monotonic()  # readers go elsewhere meanwhile
                raise
            self._unreachable.pop(name, None)
            return peer

    async def fetch(self, key: bytes, holders: list[str]) -> bytes | None:
        return await self._first_having(key, holders, "chunks_fetched")

    async def _first_having(self, key: bytes, names, counter: Literal["chunks_fetched", "chunks_from_chain"], *,
                            named: bool = False):
        """Chunk ``key`` from the first of ``names`` (live peers, in order) that has it; counted in ``stats[counter]``.

        ``named``: ``key`` is a chunk's name; returns ``(digest, bytes)``.
        """
        for name in names:
            if name == self.node or name in self.dead:
                continue
            try:
                peer = await self._peer(name)
                got = await (peer.get_named_chunk(key) if named else peer.get_chunk(key))
            except (*_PEER_ERRORS, AiturboError) as exc:
                log.info("chunk %s… from %r: %s", key.hex()[:16], name, exc)
                continue
            if got is not None:
                self.stats[counter] += 1
                return (got[0], bytes(got[1])) if named else bytes(got)
        return None

    async def upload_part(self, node: str, backend_key: str, token: str, index: int, key: bytes, length: int, holders: list[str]) -> str:
        peer = await self._peer(node)
        request = UploadPart(backend_key=backend_key, token=token, index=index, key=key.hex(), length=length,
                             holders=tuple(holders))
        reply = await peer.control(
            encode(request),
            # The peer gives up at PEER_UPLOAD_PART_TIMEOUT_S; a slow backend
            # fails this call alone, not the connection every other call shares.
            timeout=PEER_UPLOAD_PART_TIMEOUT_S + FABRIC_CALL_TIMEOUT_S, keep_on_timeout=True,
        )
        try:
            answer = decode_answer(reply, Receipt)
        except MalformedMessage as exc:
            raise RemoteError(f"node {node!r} answered upload_part with {exc}") from None
        if isinstance(answer, Refused):
            raise RemoteError(f"node {node!r} refused upload_part: {answer.error}")
        return answer.receipt

    # ===================================================== staging (future 0)
    async def stage(self, request: StageRequest) -> Staged:
        keys = chunk.unpack_manifest(request.manifest)[: chunk.chunk_count(request.size)]
        plan = None
        if request.group is not None and self.controller_address and keys:
            plan = await self._report(request, keys)
        if plan is None:
            holders = await self._replicate(request.ino, keys, self.replicas - 1)
            return Staged(holders=holders)
        by_dst: dict[str, list[bytes]] = {}
        for index, dst in plan.stage:
            by_dst.setdefault(dst, []).append(keys[index])
        holders = list(plan.holders) or [self.node]
        if self.node not in holders:
            holders.insert(0, self.node)
        failed: _Failed = []
        async with open_nursery() as nursery:
            for dst, dst_keys in by_dst.items():
                nursery.start_soon(self._put_all, request.ino, dst, dst_keys, failed)
        for dst, dst_keys in failed:  # a planned target failed: place those chunks elsewhere
            if dst in holders:
                holders.remove(dst)
            holders += [h for h in await self._replicate(request.ino, dst_keys, 1, avoid=set(holders)) if h not in holders]
        hints = PersistHints(
            persist={int(i): n for i, n in plan.persist.items()},
            copy={int(i): CopySource(c.backend_key, c.offset, c.length, c.etag) for i, c in plan.copy.items()},
            wait=set(plan.wait),
        )
        return Staged(holders=holders, hints=hints)

    async def committed(self, request: StageRequest, version: int) -> None:
        pass  # the controller heard of the file at ``stage``

    def _file(self, request: StageRequest | ReadRequest, keys: list[bytes], *,
              have: list[int] | None = None) -> FileChunks:
        """The file of a round report: its chunk hashes and lengths (``have``: read reports)."""
        return FileChunks(ino=request.ino, path=request.path, size=request.size, chunks=tuple(k.hex() for k in keys),
                          lengths=tuple(chunk.chunk_length(request.size, i) for i in range(len(keys))),
                          have=None if have is None else tuple(have))

    async def _report(self, request: StageRequest, keys: list[bytes]) -> WritePlan | None:
        """The round plan for a grouped file, or None (then it is placed alone)."""
        asked = trio.current_time()
        assert request.group is not None  # only grouped files are reported
        report = Report(node=self.node, group=request.group, group_size=request.group_size, replicas=self.replicas,
                        file=self._file(request, keys))
        plan = await self._ask(report, WritePlan, request.path, CLUSTER_REPORT_TIMEOUT_S)
        if plan is None:
            self.stats["rounds_failed"] += 1
            return None
        self.stats["rounds"] += 1
        self.stats["round_wait_s_total"] += trio.current_time() - asked
        self.stats["plan_s_total"] += plan.plan_s
        self.stats["round_bytes_total"] += plan.total_bytes
        self.stats["round_unique_bytes_total"] += plan.unique_bytes
        self.stats["last_plan"] = {
            "round": plan.round, "files": plan.files, "lp_bound_s": plan.lp_bound_s, "makespan_s": plan.makespan_s,
            "plan_s": plan.plan_s, "cached": plan.cached, "unique_bytes": plan.unique_bytes,
            "total_bytes": plan.total_bytes, "durable_bytes": plan.durable_bytes,
        }
        return plan

    async def _ask(self, report: Report | ReadReport, kind: type[_A], path: str, timeout_s: float) -> _A | None:
        """The controller's answer to a round report, or None (logged) if it has none in time."""
        deadline = trio.current_time() + timeout_s
        while trio.current_time() < deadline:
            if self._controller is None:
                await trio.sleep(0.05)  # not joined (yet, or again after a restart)
                continue
            # A connection of its own: reports wait for their round, and must
            # not take the slots the session's heartbeats need.
            address = self.controller_address
            assert address is not None  # a controller session is up
            answer: _A | Refused
            try:
                with trio.fail_after(max(0.1, deadline - trio.current_time())):
                    async with await self.transport.connect(address) as peer:
                        reply = await peer.control(encode(report), timeout=max(0.1, deadline - trio.current_time()))
                answer = decode_answer(reply, kind)
            except (PeerBroken, PeerClosed, AuthFailed, trio.TooSlowError) as exc:
                log.info("report of %s: %s; reporting again", path, exc or "timed out")
                await trio.sleep(0.05)
                continue
            except (RemoteError, MalformedMessage) as exc:
                answer = Refused(error=str(exc))
            if isinstance(answer, Refused):
                log.warning("round_unplanned path=%s reason=%r (placed alone)", path, answer.error)
                return None
            return answer
        log.warning("round_unplanned path=%s reason=%r (placed alone)", path,
                    f"no plan within {timeout_s:.0f} s: controller unreachable")
        return None

    # ===================================================== grouped reads
    def start_read(self, request: ReadRequest) -> None:
        round_key = (request.ino, request.version)
        if not self.controller_address or self._nursery is None or round_key in self._read_rounds:
            return  # no controller to plan with, or this node joined the round already
        self._read_rounds[round_key] = None
        while len(self._read_rounds) > CLUSTER_READ_ROUNDS_KEPT:
            self._read_rounds.popitem(last=False)
        # An autogroup reader waits only to learn whether it is the first: the first reads at once
        wait_s = AUTOGROUP_JOIN_WAIT_S if request.auto else CLUSTER_READ_WAIT_S
        self._read_planned.setdefault(request.ino, _PendingPlan(trio.current_time() + wait_s))
        self._nursery.start_soon(self._read_round, request)

    async def _join_auto(self, request: ReadRequest) -> None:
        """An untagged file's read round: the first reader reads at once, later ones wait for the plan."""
        plan = self._read_planned.get(request.ino)
        answer: FirstReader | Refused | None = None
        session = self._controller  # the heartbeats' connection: the answer is immediate, no connection to open
        if session is not None:
            try:
                reply = await session.control(encode(ReadJoin(node=self.node, group=request.group)),
                                              timeout=AUTOGROUP_JOIN_WAIT_S, keep_on_timeout=True)
                answer = decode_answer(reply, FirstReader)
            except (*_PEER_ERRORS, PeerSlow, MalformedMessage) as exc:
                log.info("read_join of %s: %s; reading alone", request.path, exc)
        if plan is None:
            return
        if not isinstance(answer, FirstReader) or answer.first:
            plan.released = True  # alone so far (or no answer): never slower than a lone read
        else:
            plan.deadline = trio.current_time() + CLUSTER_READ_WAIT_S  # others read it: the plan is coming
        plan.changed()

    async def _read_round(self, request: ReadRequest) -> None:
        keys = chunk.unpack_manifest(request.manifest)[: chunk.chunk_count(request.size)]
        mine: list[tuple[bytes, int, int]] = []
        try:
            if request.auto:
                await self._join_auto(request)
            have = [i for i, k in enumerate(keys) if k != chunk.HOLE and (self.pool.has(k) or k in self.pool.spill)]
            report = ReadReport(node=self.node, group=request.group, group_size=request.group_size,
                                replicas=self.replicas, file=self._file(request, keys, have=have))
            answer = await self._ask(report, ReadPlan, request.path, CLUSTER_READ_PLAN_WAIT_S)
            if answer is not None and request.auto and answer.readers <= 1:
                answer = None  # read alone: no chain to serve, nothing to prefetch
            if answer is not None:
                self.stats["read_rounds"] += 1
                self.stats["last_read_plan"] = {"round": answer.round, "files": answer.files, "readers": answer.readers,
                                                "unique_bytes": answer.unique_bytes, "fetch_bytes": answer.fetch_bytes}
                try:
                    for text, chain in answer.chains.items():
                        index = int(text)
                        if self.node not in chain:
                            continue
                        at = chain.index(self.node)
                        length = chunk.chunk_length(request.size, index)
                        self._chain[keys[index]] = _Link(
                            request.ino, index, length, tuple(reversed(chain[:at])), frozenset(chain[at + 1 :]))
                        mine.append((keys[index], index, length))
                except (IndexError, ValueError) as exc:  # a chunk index that is not one of the file's
                    log.error("malformed read plan for %s from the controller: %r", request.path, exc)
        finally:
            plan = self._read_planned.pop(request.ino, None)
            if plan is not None:
                plan.event.set()
                plan.changed()
        if not mine:
            return
        try:  # whole-file prefetch along the chains: readers then find every chunk in the pool
            # The chunks this node heads come from storage, the others from a predecessor: apart, so the
            # storage NIC stays busy while chunks wait for their turn up the chain (in one file-order
            # window the fetches ran in batches, each waiting for the slowest chain of the batch).
            heads = [m for m in mine if not self._chain[m[0]].upstream]
            follows = [m for m in mine if self._chain[m[0]].upstream]
            async with open_nursery() as nursery:
                nursery.start_soon(self._prefetch_all, request.ino, heads, CLUSTER_HEAD_FETCHES_IN_FLIGHT)
                nursery.start_soon(self._prefetch_all, request.ino, follows, CLUSTER_PREFETCH_IN_FLIGHT)
            await trio.sleep(CLUSTER_CHAIN_LINGER_S)  # successors may still be asking for them
        finally:
            for key, _, _ in mine:
                link = self._chain.get(key)
                if link is not None and link.ino == request.ino:
                    del self._chain[key]

    async def _prefetch_all(self, ino: int, chunks: list[tuple[bytes, int, int]], in_flight: int) -> None:
        limiter = trio.Semaphore(in_flight)
        async with open_nursery() as nursery:
            for key, index, length in chunks:
                await limiter.acquire()
                nursery.start_soon(self._prefetch, ino, key, index, length, limiter)

    async def _prefetch(self, ino: int, key: bytes, index: int, length: int, limiter) -> None:
        try:
            if not self.pool.has(key):
                local = self.local
                assert local is not None  # grouped reads come from the Filesystem: it is set
                await local.read_chunk(ino, index, key, length)  # into the file's backing file
                self.stats["chunks_prefetched"] += 1
        except AiturboError as exc:
            log.info("prefetch of chunk %d of inode %d failed (%s); the reader fetches it itself", index, ino, exc)
        finally:
            limiter.release()

    async def round_fetch(self, ino: int, key: bytes) -> bytes | None:
        link = await self._upstream_link(ino, key)
        if link is None:
            return None
        got = await self._first_having(key, link.upstream, "chunks_from_chain")
        return self._from_chain(link, got, ino)

    async def round_fetch_named(self, ino: int, name: bytes) -> tuple[bytes, bytes] | None:
        link = await self._upstream_link(ino, name)
        if link is None:
            return None
        got = await self._first_having(name, link.upstream, "chunks_from_chain", named=True)
        return self._from_chain(link, got, ino)

    async def _upstream_link(self, ino: int, key: bytes) -> _Link | None:
        """Our link in the read chain of ``ino``'s chunk ``key`` if we take it from a predecessor (after
        waiting for the round's plan as long as reads of it wait)."""
        planned = self._read_planned.get(ino)
        if planned is not None:
            await planned.wait_for_reads()
        link = self._chain.get(key)
        if link is None or link.ino != ino or not link.upstream:
            return None  # not in a round of this file, or we are the chain's head: the usual path
        return link

    @staticmethod
    def _from_chain(link: _Link, got, ino: int):
        if got is None:
            log.info("chunk %d of inode %d: no node up its chain (%s) had it; fetching it the usual way",
                     link.index, ino, ", ".join(link.upstream))
        return got

    def _candidates(self, ino: int, avoid: set[str]) -> list[str]:
        """Live nodes in rendezvous order for ``ino`` (a stable, spread choice)."""
        names = [n for n in self.members if n not in avoid and n not in self.dead and n != self.node]
        return chunk.rendezvous_order(ino, names)

    async def _replicate(self, ino: int, keys: list[bytes], copies: int, *, avoid: set[str] | None = None) -> list[str]:
        """Put ``keys`` on ``copies`` more nodes; returns the holders (this node first)."""
        holders = [self.node]
        wanted = [k for k in dict.fromkeys(keys) if k != chunk.HOLE]
        if copies <= 0 or not wanted:
            return holders
        for name in self._candidates(ino, (avoid or set()) | {self.node}):
            if len(holders) > copies:
                break
            failed: _Failed = []
            await self._put_all(ino, name, wanted, failed)
            if not failed:
                holders.append(name)
        if len(holders) <= copies:
            log.warning("replicas_short ino=%d placed=%d wanted=%d (too few live nodes answer)", ino, len(holders), copies + 1)
        return holders

    async def _put_all(self, ino: int, dst: str, keys: list[bytes], failed: _Failed) -> None:
        """Put ``keys`` on ``dst`` and have it hold them for ``ino``; on failure append (dst, keys)."""
        limiter = trio.Semaphore(PUTS_IN_FLIGHT_PER_PEER)
        errors = []

        async def put(peer, key: bytes) -> None:
            try:
                async with self.pool.lease(key, self._missing(key)) as view:
                    if not await peer.put_chunk(key, view):
                        errors.append(f"refused chunk {key.hex()[:16]}…")
                        return
                self.stats["chunks_replicated"] += 1
                self.stats["bytes_replicated"] += len(view)
            except (*_PEER_ERRORS, AiturboError) as exc:
                errors.append(str(exc))
            finally:
                limiter.release()

        try:
            peer = await self._peer(dst)
            async with open_nursery() as nursery:
                for key in keys:
                    await limiter.acquire()
                    nursery.start_soon(put, peer, key)
            if not errors:
                await peer.control(encode(Hold(ino=ino, keys=tuple(k.hex() for k in keys))))
        except (*_PEER_ERRORS, AiturboError) as exc:
            errors.append(str(exc))
        if errors:
            log.warning("replica_failed ino=%d node=%s error=%r", ino, dst, errors[0])
            failed.append((dst, keys))

    @staticmethod
    def _missing(key: bytes):
        async def fetch() -> bytes:
            raise NotFound(f"chunk {key.hex()[:16]}… is not in this node's pool")
        return fetch

    def controller_connected(self) -> bool:
        return self._controller is not None

    def summary(self) -> dict:
        """This node's one line of ``aiturbo status`` (small: it rides on every heartbeat)."""
        s = self.pool.stats()
        persist = self.local.persist_summary() if self.local is not None else {}
        return {
            "pool_used": s.used_bytes, "pool_budget": s.budget_bytes, "dirty": s.dirty_bytes, "spilled": s.spilled_bytes,
            **{k: persist.get(k, 0) for k in ("queue", "durable", "broken", "uploaded")},
            "replicated": self.stats["bytes_replicated"], "metrics": self.metrics_url,
        }

    async def nodes_status(self) -> list[dict]:
        """Every node of the metadata's nodes table with the summary it last sent (this node: now)."""
        now_ns = time.time_ns()
        out = []
        for row in await self.meta.nodes():
            summary = self.summary() if row.name == self.node else (row.info or {}).get("summary") or {}
            out.append({"node": row.name, "state": row.state, "fabric": row.address,
                        "seen_s_ago": round(max(0, now_ns - row.heartbeat_ns) / 1e9, 1), **summary})
        return out

    def status(self) -> dict:
        return {
            "node": self.node, "fabric": self.address, "transport": self.transport.kind,
            "controller": self.controller_address, "controller_connected": self._controller is not None,
            "replicas": self.replicas, "members": sorted(self.members), "dead": sorted(self.dead),
            "replica_files_held": len(self._holds), **self.stats,
            "fabric_counters": {n: vars(c) for n, c in self.transport.counters().items()},
        }

