"""This node's session with the controller: join, heartbeats, and the round reports it answers with plans.

``ControllerSession`` keeps one connection to the controller for the join
and the heartbeats, and joins again by itself after any failure (a
controller restart).  A round report (``Report`` at a grouped file's close,
``ReadReport`` when one is opened for reading) waits for its round, so it
goes on a connection of its own; ``ReadJoin`` (is this node the first
reader of an untagged file?) is answered at once, on the session's.  What
the messages say about this node (its address, bandwidths, free DRAM,
status line) the session asks its ``ClusterNode`` for through the two
message builders it is given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from .. import chunk
from .._errors import AuthFailed, MalformedMessage, PeerBroken, PeerClosed, PeerSlow, RemoteError
from .._limits import AUTOGROUP_JOIN_WAIT_S, CLUSTER_RECONNECT_S, CLUSTER_REPORT_TIMEOUT_S
from ..fabric import Peer, Transport
from ..messages import (
    Answer,
    FileChunks,
    FirstReader,
    Heartbeat,
    Join,
    Joined,
    Membership,
    ReadJoin,
    ReadReport,
    Refused,
    Report,
    WritePlan,
    decode_answer,
    encode,
)
from ._port import ReadRequest, StageRequest
from ._stats import Stats

log = logging.getLogger("aiturbofs.cluster")

PEER_ERRORS = (PeerBroken, PeerClosed, RemoteError, AuthFailed)
_A = TypeVar("_A", bound=Answer)


def file_chunks(request: StageRequest | ReadRequest, keys: list[bytes], *, have: list[int] | None = None) -> FileChunks:
    """The file of a round report: its chunk hashes and lengths (``have``: read reports)."""
    return FileChunks(ino=request.ino, path=request.path, size=request.size, chunks=tuple(k.hex() for k in keys),
                      lengths=tuple(chunk.chunk_length(request.size, i) for i in range(len(keys))),
                      have=None if have is None else tuple(have))


class ControllerSession:
    """This node's connection to the controller at ``address`` (see module doc)."""

    def __init__(self, *, node: str, replicas: int, address: str, transport: Transport, stats: Stats,
                 join: Callable[[], Join], heartbeat: Callable[[], Heartbeat]):
        self.node = node
        self.replicas = replicas
        self.address = address
        self.transport = transport
        self.stats = stats  # the write rounds' counters are counted here
        self._join = join  # the Join to send now (free DRAM changes between re-joins)
        self._heartbeat = heartbeat
        self._peer: Peer | None = None  # while the session is up

    @property
    def connected(self) -> bool:
        return self._peer is not None

    async def run(self) -> None:
        """Join, then heartbeat; re-join after any failure (controller restart)."""
        down_since = None
        while True:
            peer = None
            try:
                peer = await self.transport.connect(self.address)
                joined = decode_answer(await peer.control(encode(self._join())), Joined)
                if isinstance(joined, Refused):
                    raise RemoteError(f"join refused: {joined.error}")
                if not joined.ok:
                    raise RemoteError("join refused")
                period = joined.heartbeat_s
                self._peer = peer
                log.info("controller_joined address=%s down_s=%.1f", self.address,
                         time.monotonic() - down_since if down_since else 0.0)
                down_since = None
                while True:
                    await trio.sleep(period)
                    answer = decode_answer(await peer.control(encode(self._heartbeat())), Membership)
                    if isinstance(answer, Refused):
                        log.warning("controller: %s; joining again", answer.error)
                        break
            except (*PEER_ERRORS, MalformedMessage) as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("controller_unreachable address=%s error=%r retry_s=%.0f", self.address, exc, CLUSTER_RECONNECT_S)
            finally:
                self._peer = None
                if peer is not None:
                    await peer.aclose()
            await trio.sleep(CLUSTER_RECONNECT_S)

    async def read_join(self, request: ReadRequest) -> FirstReader | Refused | None:
        """Is this node the first reader of the untagged file of ``request``?  None: no answer (not joined, failed)."""
        session = self._peer  # the heartbeats' connection: the answer is immediate, no connection to open
        if session is None:
            return None
        try:
            reply = await session.control(encode(ReadJoin(node=self.node, group=request.group)),
                                          timeout=AUTOGROUP_JOIN_WAIT_S, keep_on_timeout=True)
            return decode_answer(reply, FirstReader)
        except (*PEER_ERRORS, PeerSlow, MalformedMessage) as exc:
            log.info("read_join of %s: %s; reading alone", request.path, exc)
            return None

    async def write_plan(self, request: StageRequest, keys: list[bytes]) -> WritePlan | None:
        """The round plan for a grouped file, or None (then it is placed alone)."""
        asked = trio.current_time()
        assert request.group is not None  # only grouped files are reported
        report = Report(node=self.node, group=request.group, group_size=request.group_size, replicas=self.replicas,
                        file=file_chunks(request, keys))
        plan = await self.ask(report, WritePlan, request.path, CLUSTER_REPORT_TIMEOUT_S)
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

    async def ask(self, report: Report | ReadReport, kind: type[_A], path: str, timeout_s: float) -> _A | None:
        """The controller's answer to a round report, or None (logged) if it has none in time."""
        deadline = trio.current_time() + timeout_s
        while trio.current_time() < deadline:
            if self._peer is None:
                await trio.sleep(0.05)  # not joined (yet, or again after a restart)
                continue
            # A connection of its own: reports wait for their round, and must
            # not take the slots the session's heartbeats need.
            answer: _A | Refused
            try:
                with trio.fail_after(max(0.1, deadline - trio.current_time())):
                    async with await self.transport.connect(self.address) as peer:
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
