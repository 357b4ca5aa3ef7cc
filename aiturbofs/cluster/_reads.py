"""This node's part in grouped reads: read rounds joined, and its place in their chunks' chains.

A file opened for reading in a group (``ReadRounds.start``) is reported to
the controller, whose read plan gives every unique chunk a chain of the
round's readers: the head fetches it from storage, each other reader takes
it from its predecessor.  This node then prefetches the whole file along
its chains, so readers find every chunk in the pool, and keeps its links
until successors are done asking (``CLUSTER_CHAIN_LINGER_S``).

``ClusterNode`` asks it, for a chunk a reader misses, whether a predecessor
has it (``upstream_link``), and, for a chunk a peer asks for, whether that
peer is downstream of this node in a chain (``link_for``).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from .. import chunk
from .._errors import AiturboError
from .._limits import (
    AUTOGROUP_JOIN_WAIT_S,
    CLUSTER_CHAIN_LINGER_S,
    CLUSTER_CHAIN_PLAN_SKEW_S,
    CLUSTER_HEAD_FETCHES_IN_FLIGHT,
    CLUSTER_PREFETCH_IN_FLIGHT,
    CLUSTER_READ_PLAN_WAIT_S,
    CLUSTER_READ_ROUNDS_KEPT,
    CLUSTER_READ_WAIT_S,
)
from .._nursery import open_nursery
from ..messages import FirstReader, ReadPlan, ReadReport
from ..staging import StagingPool
from ._port import ReadRequest
from ._session import ControllerSession, file_chunks
from ._stats import Stats

log = logging.getLogger("aiturbofs.cluster")

ReadChunk = Callable[[int, int, bytes, int], Awaitable[bytes]]  # ``LocalSide.read_chunk``


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
class Link:
    """This node's place in the read chain of one chunk."""

    ino: int
    index: int
    length: int
    upstream: tuple[str, ...]  # predecessor first, back to the head
    downstream: frozenset[str]  # nodes after us: they may wait on us

    def from_chain(self, got, ino: int):
        """``got`` (what the chain's upstream nodes gave), logging when none had it."""
        if got is None:
            log.info("chunk %d of inode %d: no node up its chain (%s) had it; fetching it the usual way",
                     self.index, ino, ", ".join(self.upstream))
        return got


class ReadRounds:
    """The read rounds this node joined and its links in their chains (see module doc).

    ``session`` is None without a controller: then no round is joined.
    ``read_chunk`` reads a chunk as the VFS's readers do (``LocalSide.read_chunk``).
    """

    def __init__(self, *, node: str, replicas: int, pool: StagingPool, session: ControllerSession | None,
                 read_chunk: ReadChunk, stats: Stats):
        self.node = node
        self.replicas = replicas
        self.pool = pool
        self.session = session
        self._read_chunk = read_chunk
        self.stats = stats  # read rounds and prefetches are counted here
        # Rounds joined (ino, version), a reader waiting for a round's plan,
        # and this node's place in the chains of planned rounds
        self._rounds: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        self._planned: dict[int, _PendingPlan] = {}
        self._chain: dict[bytes, Link] = {}

    def start(self, request: ReadRequest, nursery: trio.Nursery) -> None:
        """Join the group's read round for ``request``'s file, in ``nursery`` (once per version)."""
        round_key = (request.ino, request.version)
        if self.session is None or round_key in self._rounds:
            return  # no controller to plan with, or this node joined the round already
        self._rounds[round_key] = None
        while len(self._rounds) > CLUSTER_READ_ROUNDS_KEPT:
            self._rounds.popitem(last=False)
        # An autogroup reader waits only to learn whether it is the first: the first reads at once
        wait_s = AUTOGROUP_JOIN_WAIT_S if request.auto else CLUSTER_READ_WAIT_S
        self._planned.setdefault(request.ino, _PendingPlan(trio.current_time() + wait_s))
        nursery.start_soon(self._read_round, self.session, request)

    async def _join_auto(self, session: ControllerSession, request: ReadRequest) -> None:
        """An untagged file's read round: the first reader reads at once, later ones wait for the plan."""
        plan = self._planned.get(request.ino)
        answer = await session.read_join(request)
        if plan is None:
            return
        if not isinstance(answer, FirstReader) or answer.first:
            plan.released = True  # alone so far (or no answer): never slower than a lone read
        else:
            plan.deadline = trio.current_time() + CLUSTER_READ_WAIT_S  # others read it: the plan is coming
        plan.changed()

    async def _read_round(self, session: ControllerSession, request: ReadRequest) -> None:
        keys = chunk.unpack_manifest(request.manifest)[: chunk.chunk_count(request.size)]
        mine: list[tuple[bytes, int, int]] = []
        try:
            if request.auto:
                await self._join_auto(session, request)
            have = [i for i, k in enumerate(keys) if k != chunk.HOLE and (self.pool.has(k) or k in self.pool.spill)]
            report = ReadReport(node=self.node, group=request.group, group_size=request.group_size,
                                replicas=self.replicas, file=file_chunks(request, keys, have=have))
            answer = await session.ask(report, ReadPlan, request.path, CLUSTER_READ_PLAN_WAIT_S)
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
                        self._chain[keys[index]] = Link(
                            request.ino, index, length, tuple(reversed(chain[:at])), frozenset(chain[at + 1 :]))
                        mine.append((keys[index], index, length))
                except (IndexError, ValueError) as exc:  # a chunk index that is not one of the file's
                    log.error("malformed read plan for %s from the controller: %r", request.path, exc)
        finally:
            plan = self._planned.pop(request.ino, None)
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
                await self._read_chunk(ino, index, key, length)  # into the file's backing file
                self.stats["chunks_prefetched"] += 1
        except AiturboError as exc:
            log.info("prefetch of chunk %d of inode %d failed (%s); the reader fetches it itself", index, ino, exc)
        finally:
            limiter.release()

    async def upstream_link(self, ino: int, key: bytes) -> Link | None:
        """Our link in the read chain of ``ino``'s chunk ``key`` if we take it from a predecessor (after
        waiting for the round's plan as long as reads of it wait)."""
        planned = self._planned.get(ino)
        if planned is not None:
            await planned.wait_for_reads()
        link = self._chain.get(key)
        if link is None or link.ino != ino or not link.upstream:
            return None  # not in a round of this file, or we are the chain's head: the usual path
        return link

    async def link_for(self, key: bytes) -> Link | None:
        """Our link in a read chain of chunk ``key`` (a peer asks for it and our pool has none), if any."""
        link = self._chain.get(key)
        pending = [p for p in self._planned.values() if not p.skew_spent]
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
        return link
