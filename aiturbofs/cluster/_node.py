"""This node's part of a cluster: fabric endpoint, membership, replicas, and the parts it owns.

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

It owns three parts, each in a module of its own: the controller session
(``_session.ControllerSession``: join, heartbeats, round reports), the
replicas it holds for other nodes (``_holds.ReplicaHolds``) and its part
in grouped reads (``_reads.ReadRounds``: rounds joined, chain links,
prefetch).  Peer connections, replica placement and the fabric handler stay
here.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Literal

import trio

from .. import chunk
from .._errors import (
    AiturboError,
    InvalidArgument,
    MalformedMessage,
    NotFound,
    PeerBroken,
    RemoteError,
)
from .._limits import (
    CLUSTER_TAKEOVER_PERIOD_S,
    CLUSTER_UNREACHABLE_RETRY_S,
    FABRIC_CALL_TIMEOUT_S,
    HASH_BYTES,
    PEER_UPLOAD_PART_TIMEOUT_S,
)
from .._nursery import open_nursery
from ..fabric import Named, Peer, PeerInfo, Transport, format_address, parse_address
from ..messages import (
    Heartbeat,
    Hold,
    Join,
    Ok,
    Receipt,
    Refused,
    ToNode,
    UploadPart,
    decode,
    decode_answer,
    encode,
)
from ..meta import NODE_ALIVE, NODE_DEAD
from ..staging import BackingArea, StagingPool
from ._holds import ReplicaHolds
from ._port import CopySource, LocalSide, PersistHints, ReadRequest, Staged, StageRequest
from ._reads import ReadRounds
from ._session import PEER_ERRORS, ControllerSession
from ._stats import Stats, new_stats

log = logging.getLogger("aiturbofs.cluster")

PUTS_IN_FLIGHT_PER_PEER = 4  # chunk puts to one replica target at once


def _key(text) -> bytes:
    try:
        key = bytes.fromhex(text)
    except (TypeError, ValueError):
        raise InvalidArgument(f"bad chunk key {text!r}") from None
    if len(key) != HASH_BYTES:
        raise InvalidArgument(f"bad chunk key {text!r}")
    return key


_Failed = list[tuple[str, list[bytes]]]  # (target node, the chunks it did not take)


class ClusterNode:
    """The ``ClusterPort`` of a cluster member (see module doc)."""

    shared = True

    def __init__(self, *, node: str, replicas: int, controller: str | None, meta, pool: StagingPool,
                 staging: BackingArea, transport: Transport, send_bw: float, recv_bw: float, snic_bw: float):
        self.node = node
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
        self._unreachable: dict[str, float] = {}  # peer -> when connecting to it last failed
        self._nursery: trio.Nursery | None = None
        self.stats: Stats = new_stats()  # counted here and by the parts below
        self.metrics_url: str | None = None  # set by the daemon once its metrics endpoint serves
        self._holds = ReplicaHolds(node=node, meta=meta, pool=pool, staging=staging)
        self._session = ControllerSession(
            node=node, replicas=replicas, address=controller, transport=transport, stats=self.stats,
            join=self._join_message, heartbeat=self._heartbeat_message,
        ) if controller else None
        self._reads = ReadRounds(node=node, replicas=replicas, pool=pool, session=self._session,
                                 read_chunk=self._read_chunk, stats=self.stats)

    # ============================================================ lifecycle
    async def run(self, listen: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self._holds.recover()
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
            if self._session is not None:
                nursery.start_soon(self._session.run)
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

    def _join_message(self) -> Join:
        assert self.address is not None  # run() serves the fabric before the session starts
        bw = self.bandwidths
        return Join(node=self.node, fabric=self.address, dram_free=self._dram_free(),
                    send_bw=bw["send_bw"], recv_bw=bw["recv_bw"], snic_bw=bw["snic_bw"])

    def _heartbeat_message(self) -> Heartbeat:
        return Heartbeat(node=self.node, dram_free=self._dram_free(), summary=self.summary())

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
                await self._holds.release_done()
                if self.dead and self.local is not None:
                    await self.local.take_over(self.dead)
            except AiturboError as exc:  # the metadata engine is unreachable: try again
                log.warning("cluster housekeeping: %s", exc)

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
        link = await self._reads.link_for(key)
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
        await self._holds.receive(key, data)
        self.stats["chunks_received"] += 1
        return True

    async def control(self, peer: PeerInfo, body: dict) -> dict:
        request = decode(body, ToNode)  # MalformedMessage: this request fails, the others go on
        match request:
            case Hold():
                self._holds.hold(request.ino, [_key(k) for k in request.keys])
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
            except PEER_ERRORS:
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
            except (*PEER_ERRORS, AiturboError) as exc:
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
        if request.group is not None and self._session is not None and keys:
            plan = await self._session.write_plan(request, keys)
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

    # ===================================================== grouped reads (_reads)
    def start_read(self, request: ReadRequest) -> None:
        if self._nursery is not None:
            self._reads.start(request, self._nursery)

    async def round_fetch(self, ino: int, key: bytes) -> bytes | None:
        link = await self._reads.upstream_link(ino, key)
        if link is None:
            return None
        return link.from_chain(await self._first_having(key, link.upstream, "chunks_from_chain"), ino)

    async def round_fetch_named(self, ino: int, name: bytes) -> tuple[bytes, bytes] | None:
        link = await self._reads.upstream_link(ino, name)
        if link is None:
            return None
        return link.from_chain(await self._first_having(name, link.upstream, "chunks_from_chain", named=True), ino)

    async def _read_chunk(self, ino: int, index: int, key: bytes, length: int) -> bytes:
        local = self.local
        assert local is not None  # grouped reads come from the Filesystem: it is set
        return await local.read_chunk(ino, index, key, length)

    # ===================================================== replica placement
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
            except (*PEER_ERRORS, AiturboError) as exc:
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
        except (*PEER_ERRORS, AiturboError) as exc:
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
        return self._session is not None and self._session.connected

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
            "controller": self.controller_address, "controller_connected": self.controller_connected(),
            "replicas": self.replicas, "members": sorted(self.members), "dead": sorted(self.dead),
            "replica_files_held": len(self._holds), **self.stats,
            "fabric_counters": {n: vars(c) for n, c in self.transport.counters().items()},
        }
