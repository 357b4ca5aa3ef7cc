"""Group rounds of the grouped write: collect reports, dedup, plan, answer.

``RoundKeeper`` owns the open round of every group.  Nodes report each
closed file of a group (its chunk hashes in file order); the reports of one
round are deduplicated by full BLAKE3 hash, across files and against chunks
already durable in the backend (``meta.chunk_sources``), the remaining
unique chunks are planned over the live members (``planner``), and every
report is answered with its own file's share of the plan.

The plan mode (``PLAN_MODES``) is a factor of the benchmarks' analysis:
``lp`` (the default) plans transfers, holders and uploaders with the LP;
``dedup`` only deduplicates: each unique chunk is uploaded by the node of the
first reported file that holds it, and the only transfers are the ones that
bring a chunk up to ``replicas`` holders, to the nodes a node placing its
file alone would choose.  The answers have the same shape either way, so the
nodes cannot tell the modes apart.

A round closes when ``group_size`` distinct files reported, or
``window_s`` after its first report when the group has no size, and in any
case ``wait_max_s`` after its first report.  ``report`` is a long poll: it
returns when the round of its report has been planned.

It never moves bytes and keeps nothing the nodes cannot report again: a
restarted controller plans the rounds re-reported to it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import trio

from .. import chunk
from .._errors import AiturboError, InvalidArgument
from .._limits import (
    CHUNK_BYTES,
    GROUP_NAME_BYTES_MAX,
    GROUPS_TRACKED_MAX,
    HASH_BYTES,
    ROUND_FILES_MAX,
    ROUND_PLAN_TIMEOUT_S,
    ROUND_PLANS_MAX,
    ROUND_WAIT_MAX_S,
    ROUND_WINDOW_S,
)
from ..messages import DurableSource, ReadPlan, Refused, RoundReport, WritePlan
from ..planner import NodeSpec

log = logging.getLogger(__name__)

PLAN_MODES = ("lp", "dedup")  # see the module doc
Planned = WritePlan | ReadPlan  # a file's answer in a planned round (write or read)


@dataclass
class FileReport:
    """One file of a round, as a node reported it (``keys[i]`` None: a hole)."""

    node: str
    ino: int
    path: str
    keys: list[bytes | None]
    lengths: list[int]
    replicas: int
    group_size: int | None
    have: frozenset[int] = frozenset()  # reads: chunk indices already in the reporting node's DRAM


def parse_report(node: str, report: RoundReport) -> tuple[str, FileReport]:
    """``(group, FileReport)`` of a (read) report; ``InvalidArgument`` naming what is wrong.

    The message's types are checked already (``messages.decode``); this checks what they hold.
    """
    group = report.group
    if not 1 <= len(group.encode()) <= GROUP_NAME_BYTES_MAX:
        raise InvalidArgument(f"report: group must be a name of 1 to {GROUP_NAME_BYTES_MAX} bytes")
    size = report.group_size
    if size is not None and not 1 <= size <= ROUND_FILES_MAX:
        raise InvalidArgument(f"report: group_size must be null or 1..{ROUND_FILES_MAX}")
    if report.replicas < 1:
        raise InvalidArgument("report: replicas must be an integer >= 1")
    f = report.file
    if f.ino < 1:
        raise InvalidArgument("report: file must be an object with an ino >= 1 and a path")
    if len(f.chunks) != len(f.lengths):
        raise InvalidArgument("report: file.chunks and file.lengths must be lists of one length")
    keys: list[bytes | None] = []
    for i, (hexkey, length) in enumerate(zip(f.chunks, f.lengths)):
        try:
            key = bytes.fromhex(hexkey)
        except ValueError:
            key = b""
        if len(key) != HASH_BYTES or not 1 <= length <= CHUNK_BYTES:
            raise InvalidArgument(f"report: chunk {i} of {f.path!r}: want a 64-hex hash, 1..{CHUNK_BYTES} bytes")
        keys.append(None if key == chunk.HOLE else key)  # a hole: nothing to store
    have = f.have or ()
    if not all(0 <= i < len(keys) for i in have):
        raise InvalidArgument("report: file.have must be a list of chunk indices")
    return group, FileReport(node, f.ino, f.path, keys, list(f.lengths), report.replicas, size, frozenset(have))


class _Round:
    def __init__(self, group: str, number: int, deadline: float, size: int | None):
        self.name = f"{group}#{number}"
        self.group = group
        self.deadline = deadline
        self.size = size  # the group size of its first report (None: close after the window)
        self.reports: dict[tuple[str, int], FileReport] = {}  # (node, ino) -> report, in report order
        self.answers: dict[tuple[str, int], Planned | Refused] = {}
        self.closed = trio.Event()  # no report joins it any more
        self.answered = trio.Event()


@dataclass
class _Chunk:
    """A unique chunk of a round."""

    length: int
    first_file: int  # position (in report order) of the first file containing it: it uploads the bytes
    writers: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (file position, index), first copy
    dests: set[str] = field(default_factory=set)  # nodes the plan copies it to


@dataclass
class GroupStats:
    opened: int = 0  # rounds started: the number of the latest
    rounds: int = 0  # rounds planned
    files: int = 0
    bytes: int = 0
    unique_bytes: int = 0
    durable_bytes: int = 0
    errors: int = 0
    short: int = 0  # rounds closed before group_size files reported
    last: dict = field(default_factory=dict)  # figures of the last round


class RoundKeeper:
    """The group rounds of one controller.

    ``members`` is the caller's live view of the cluster, node -> ``NodeSpec``
    (or a ``(send_bw, recv_bw, snic_bw, dram_free)`` tuple); it is read when
    a round is planned, so the caller keeps it current and calls
    ``drop_node`` when a node dies or leaves.  ``meta`` needs only
    ``chunk_sources(keys)``; ``None`` means nothing is durable yet.
    ``backend_bw`` is in bytes/s.  ``plan`` is one of ``PLAN_MODES``.
    """

    def __init__(self, meta, members: Mapping, *, backend_bw: float, planner=None,
                 window_s: float = ROUND_WINDOW_S, wait_max_s: float = ROUND_WAIT_MAX_S, plan: str = "lp"):
        assert backend_bw > 0 and 0 < window_s <= wait_max_s
        if plan not in PLAN_MODES:
            raise InvalidArgument(f"plan mode {plan!r}: choose one of {', '.join(PLAN_MODES)}")
        self.plan_mode = plan
        self.meta = meta
        self.members = members
        self.backend_bw = backend_bw
        self._planner = planner
        self.window_s, self.wait_max_s = window_s, wait_max_s
        self._open: dict[str, _Round] = {}
        # for the metrics endpoint: rounds planned, and their solve and planned times
        self.plans, self.plan_s_total, self.makespan_s_total = 0, 0.0, 0.0
        self._stats: collections.OrderedDict[str, GroupStats] = collections.OrderedDict()

    @property
    def planner(self):
        """The LP planner, made (and numpy and cvxpy imported) on the first round it plans."""
        if self._planner is None:
            from ..planner import Planner

            self._planner = Planner()
        return self._planner

    async def report(self, node: str, report: RoundReport) -> Planned | Refused:
        """Add ``node``'s file report to its group's round; its answer once the round is planned."""
        group, rep = parse_report(node, report)
        rnd = self._open.get(group)
        if rnd is None:
            g = self._group(group)
            g.opened += 1
            wait_s = self.wait_max_s if rep.group_size else self._window(group)
            rnd = self._open[group] = _Round(group, g.opened, trio.current_time() + wait_s, rep.group_size)
        key = (node, rep.ino)
        rnd.reports[key] = rep  # the same file reported again (a retry) keeps its place
        if self._full(rnd):
            await self._close(rnd)
        else:
            waited = False
            try:
                with trio.move_on_at(rnd.deadline):
                    await rnd.closed.wait()
                waited = True
            finally:
                if not waited and not rnd.closed.is_set() and rnd.reports.get(key) is rep:
                    self._withdraw(rnd, key)  # the reporter went away before the round closed
            if not rnd.closed.is_set():
                if rnd.size and len(rnd.reports) < rnd.size:
                    log.warning("round_short round=%s files=%d of=%d waited_s=%.1f", rnd.name,
                                len(rnd.reports), rnd.size, self.wait_max_s)
                    self._group(group).short += 1
                await self._close(rnd)
        await rnd.answered.wait()
        return rnd.answers.get(key) or Refused(error=f"round {rnd.name}: report of {node}:{rep.path} was dropped")

    def _full(self, rnd: _Round) -> bool:
        """Whether ``rnd`` closes now: it has its group size of files (or ROUND_FILES_MAX)."""
        return len(rnd.reports) >= min(rnd.size or ROUND_FILES_MAX, ROUND_FILES_MAX)

    def _window(self, group: str) -> float:
        """How long a round of ``group`` without a size stays open after its first report."""
        return self.window_s

    def drop_node(self, node: str) -> None:
        """Forget the reports of a dead or departed node in rounds not closed yet."""
        for rnd in list(self._open.values()):
            for key in [k for k in rnd.reports if k[0] == node]:
                log.info("round %s: dropped the report of %s (ino %d): the node is gone", rnd.name, node, key[1])
                self._withdraw(rnd, key)

    def stats(self) -> dict:
        return {name: {"rounds": g.rounds, "files": g.files, "bytes": g.bytes, "unique_bytes": g.unique_bytes,
                       "durable_bytes": g.durable_bytes, "errors": g.errors, "short_rounds": g.short,
                       "open_files": len(self._open[name].reports) if name in self._open else 0, **g.last}
                for name, g in self._stats.items()}

    # ------------------------------------------------------------------ internals
    def _withdraw(self, rnd: _Round, key: tuple[str, int]) -> None:
        del rnd.reports[key]
        if not rnd.reports and self._open.get(rnd.group) is rnd:
            del self._open[rnd.group]  # a later report starts afresh, with a full window
            rnd.closed.set()
            rnd.answered.set()

    def _group(self, group: str) -> GroupStats:
        g = self._stats.pop(group, None) or GroupStats()
        self._stats[group] = g
        while len(self._stats) > GROUPS_TRACKED_MAX:
            self._stats.popitem(last=False)
        return g

    async def _close(self, rnd: _Round) -> None:
        """Close ``rnd`` and plan it (once; the other reporters wait for ``answered``)."""
        if rnd.closed.is_set():
            return
        rnd.closed.set()
        if self._open.get(rnd.group) is rnd:
            del self._open[rnd.group]
        # Shielded: the round's other reporters wait for this plan, whatever becomes of the closer.
        with trio.CancelScope(shield=True):
            try:
                with trio.fail_after(ROUND_PLAN_TIMEOUT_S):
                    await self._answer(rnd)
            except trio.TooSlowError:
                self._fail(rnd, f"planning took longer than {ROUND_PLAN_TIMEOUT_S} s")
            finally:
                rnd.answered.set()

    async def _answer(self, rnd: _Round) -> None:
        for _ in range(ROUND_PLANS_MAX):
            members = {n: s if isinstance(s, NodeSpec) else NodeSpec(*s) for n, s in self.members.items()}
            for key in [k for k in rnd.reports if k[0] not in members]:
                rnd.answers[key] = Refused(error=f"round {rnd.name}: node {key[0]} is not a live member")
                del rnd.reports[key]
            if not rnd.reports:
                return
            try:
                answers = await self._plan(rnd, members)
            except (AiturboError, ValueError) as e:  # PlanInfeasible, or a round the planner cannot take
                self._fail(rnd, str(e))
                return
            if all(n in self.members for n in members):
                rnd.answers.update(answers)
                self._record(rnd.group, next(iter(answers.values())))
                return
            log.warning("round %s: a node died while it was planned; planning again", rnd.name)
        self._fail(rnd, f"nodes kept dying during {ROUND_PLANS_MAX} plans")

    def _fail(self, rnd: _Round, why: str) -> None:
        log.warning("round_failed round=%s files=%d reason=%r (its nodes place their files alone)",
                    rnd.name, len(rnd.reports), why)
        self._group(rnd.group).errors += 1
        for key in rnd.reports:
            rnd.answers.setdefault(key, Refused(error=f"round {rnd.name} not planned: {why}"))

    async def _plan(self, rnd: _Round, members: dict[str, NodeSpec]) -> dict[tuple[str, int], Planned]:
        files = list(rnd.reports.items())
        chunks: dict[bytes, _Chunk] = {}
        total = 0
        for pos, (_, rep) in enumerate(files):
            for idx, (key, length) in enumerate(zip(rep.keys, rep.lengths)):
                if key is None:
                    continue
                total += length
                chunk = chunks.get(key) or chunks.setdefault(key, _Chunk(length, pos))
                chunk.writers.setdefault(rep.node, (pos, idx))
        sources = await self.meta.chunk_sources(list(chunks)) if self.meta is not None and chunks else {}
        pending = [k for k in chunks if k not in sources]
        nodes = list(members)
        replicas = min(max(rep.replicas for _, rep in files), len(nodes))
        stage: list[list[tuple[int, str]]] = [[] for _ in files]
        persister: dict[bytes, str] = {}
        lp_bound_s = makespan_s = plan_s = 0.0
        cached = False
        if pending and self.plan_mode == "dedup":
            self._first_writers(pending, chunks, files, nodes, replicas, stage, persister)
        elif pending:
            plan = await trio.to_thread.run_sync(self.planner.plan, self._input(pending, chunks, members, replicas),
                                                 abandon_on_cancel=True)
            lp_bound_s, makespan_s, plan_s, cached = plan.lp_bound_s, plan.makespan_s, plan.solve_s, plan.cached
            for c, p in enumerate(plan.persister.tolist()):
                persister[pending[c]] = nodes[p]
            sent: collections.Counter[str] = collections.Counter()
            for c, src, dst in plan.transfers.tolist():
                ch = chunks[pending[c]]
                src = nodes[src]
                if src not in ch.writers:  # a relay in the plan's chain: an original writer sends instead
                    src = min(ch.writers, key=lambda n: sent[n])
                sent[src] += ch.length
                pos, idx = ch.writers[src]  # exactly one reporting file of the sender does the put
                stage[pos].append((idx, nodes[dst]))
                ch.dests.add(nodes[dst])
        unique = sum(c.length for c in chunks.values())
        durable = sum(chunks[k].length for k in sources)
        common = WritePlan(round=rnd.name, plan=self.plan_mode, files=len(files), replicas=replicas,
                           lp_bound_s=lp_bound_s, makespan_s=makespan_s, plan_s=plan_s, cached=cached,
                           unique_bytes=unique, total_bytes=total, durable_bytes=durable)
        answers: dict[tuple[str, int], Planned] = {}
        for pos, (file_key, rep) in enumerate(files):
            holders: set[str] = set()
            persist: dict[str, str] = {}
            copy: dict[str, DurableSource] = {}
            wait: list[int] = []
            for idx, k in enumerate(rep.keys):
                if k is None:
                    continue
                ch = chunks[k]
                holders.update(ch.writers, ch.dests)
                if (src := sources.get(k)) is not None:
                    copy[str(idx)] = DurableSource(backend_key=src.backend_key, offset=src.offset, length=src.length,
                                                   etag=src.etag)
                elif ch.first_file == pos:
                    persist[str(idx)] = persister[k]
                else:
                    wait.append(idx)
            holders.discard(rep.node)
            answers[file_key] = replace(common, stage=tuple(stage[pos]), holders=(rep.node, *sorted(holders)),
                                        persist=persist, copy=copy, wait=tuple(wait))
        return answers

    @staticmethod
    def _first_writers(pending: list[bytes], chunks: dict[bytes, _Chunk], files: list, nodes: list[str],
                       replicas: int, stage: list[list[tuple[int, str]]], persister: dict[bytes, str]) -> None:
        """Dedup without a plan: the first file's node uploads each chunk and sends the missing replicas.

        The replica targets are the live nodes in the rendezvous order of the
        file's inode, the order a node placing its file alone uses
        (``chunk.rendezvous_order``), so this mode differs from an
        untagged write only by the dedup.
        """
        for k in pending:
            ch = chunks[k]
            pos, idx = ch.writers[files[ch.first_file][1].node]  # setdefault kept the first file's place
            rep = files[pos][1]
            persister[k] = rep.node
            missing = replicas - len(ch.writers)
            if missing <= 0:
                continue
            order = chunk.rendezvous_order(rep.ino, (n for n in nodes if n not in ch.writers))
            for dst in order[:missing]:
                stage[pos].append((idx, dst))
                ch.dests.add(dst)

    def _count(self, group: str, a: Planned) -> GroupStats:
        """Add a planned round (its first answer, ``a``) to its group's figures."""
        g = self._group(group)
        g.rounds += 1
        g.files += a.files
        g.bytes += a.total_bytes
        g.unique_bytes += a.unique_bytes
        return g

    def _record(self, group: str, a: Planned) -> None:
        assert isinstance(a, WritePlan), "write rounds are answered with write plans"
        g = self._count(group, a)
        g.durable_bytes += a.durable_bytes
        self.plans += 1
        self.plan_s_total += a.plan_s
        self.makespan_s_total += a.makespan_s
        g.last = {"round": a.round, "plan": a.plan, "lp_bound_s": a.lp_bound_s, "makespan_s": a.makespan_s,
                  "plan_s": a.plan_s, "cached": a.cached}
        if a.plan == "dedup":
            log.info("round_deduped round=%s files=%d bytes=%d unique=%d durable=%d plan=dedup "
                     "(no LP: each unique chunk is uploaded by its first file's node)", a.round, a.files,
                     a.total_bytes, a.unique_bytes, a.durable_bytes)
            return
        log.info("round_planned round=%s files=%d bytes=%d unique=%d durable=%d makespan_s=%.3f bound_s=%.3f "
                 "solve_s=%.3f cached=%s", a.round, a.files, a.total_bytes, a.unique_bytes,
                 a.durable_bytes, a.makespan_s, a.lp_bound_s, a.plan_s, "yes" if a.cached else "no")

    def _input(self, pending: list[bytes], chunks: dict[bytes, _Chunk], members: dict[str, NodeSpec],
               replicas: int):
        import numpy as np

        from ..planner import PlanInput

        index = {n: i for i, n in enumerate(members)}
        holders = np.zeros((len(pending), len(members)), dtype=bool)
        for c, k in enumerate(pending):
            holders[c, [index[n] for n in chunks[k].writers]] = True
        specs = list(members.values())
        return PlanInput(
            send_bw=[s.send_bw for s in specs], recv_bw=[s.recv_bw for s in specs],
            snic_bw=[s.snic_bw for s in specs], dram_free_bytes=[s.dram_free_bytes for s in specs],
            backend_bw=self.backend_bw, replicas=replicas,
            chunk_bytes=[chunks[k].length for k in pending], holders=holders,
        )
