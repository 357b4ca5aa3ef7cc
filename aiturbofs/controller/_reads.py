"""Group rounds of the grouped read: each chunk fetched once, then passed along a chain.

Nodes report each file a grouped reader opens (same body as a write report).
A round closes like a write round (``group_size`` files, the window, or the
wait bound), but its wait bound is READ_ROUND_WAIT_MAX_S: a reader stops
waiting for the plan CLUSTER_READ_WAIT_S after open().  Files opened by fewer
readers than ``group_size`` (PyTorch DCP's load without its own dedup: every
rank reads one rank's file and its own) no longer hold their round 10 s.  For every unique chunk of the round the plan picks one *head*
among the nodes reading it — a node that already holds it in DRAM if one
reads it, otherwise the reader with the least storage work so far relative
to its storage-NIC rate, so the fetches spread over every S-NIC — and a
*chain*: the head, then the chunk's other readers in ring order.  Each node
takes the chunk from its predecessor in the chain (which waits until it has
it), so a node forwards chunk k while it receives chunk k+1.

Rounds without a tag (``-o autogroup``; groups named ``auto:<ino>:<version>:<etag>``)
are formed by the opens themselves.  Before it reports, a reader asks
``join``: the first reader of a version within AUTOGROUP_WINDOW_S is told
so and reads at once, never waiting for a plan (a lone reader pays one
round trip); later ones wait for the round, which closes AUTOGROUP_WINDOW_S
after its first report, or as soon as every live node reported.  By then the first reader has fetched some chunks
alone: the plan makes it the head of as many leading chunks as its storage
NIC can have fetched since its join, plus its read-ahead, so no chunk is
fetched twice; the rest are spread like a tagged round's.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import replace

import trio

from .._errors import InvalidArgument
from .._limits import (
    AUTOGROUP_CLAIMS_MAX,
    AUTOGROUP_WINDOW_S,
    CHUNK_BYTES,
    GROUP_NAME_BYTES_MAX,
    READ_AHEAD_CHUNKS,
    READ_ROUND_WAIT_MAX_S,
)
from ..messages import FirstReader, ReadPlan
from ._rounds import Planned, RoundKeeper, _Round

AUTO_PREFIX = "auto:"  # the group of an untagged file's read round

log = logging.getLogger(__name__)


class ReadRoundKeeper(RoundKeeper):
    """The read rounds of one controller (see module doc); the rest is ``RoundKeeper``'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wait_max_s = min(self.wait_max_s, READ_ROUND_WAIT_MAX_S)
        self.window_s = min(self.window_s, self.wait_max_s)
        # autogroup: group -> (its first reader, when it joined), oldest first, within the window
        self._first: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()

    def join(self, node: str, group: str) -> FirstReader:
        """An untagged file opened for reading (its ``group``): is ``node`` its first reader within the window?"""
        if not group.startswith(AUTO_PREFIX) or len(group.encode()) > GROUP_NAME_BYTES_MAX:
            raise InvalidArgument(f"read_join: group must be an {AUTO_PREFIX}... name of at most {GROUP_NAME_BYTES_MAX} bytes")
        now = trio.current_time()
        while self._first and (len(self._first) > AUTOGROUP_CLAIMS_MAX
                               or now - next(iter(self._first.values()))[1] > AUTOGROUP_WINDOW_S):
            self._first.popitem(last=False)
        first = self._first.get(group)
        if first is None:
            self._first[group] = (node, now)
            return FirstReader(first=True)
        return FirstReader(first=first[0] == node)

    def _window(self, group: str) -> float:
        return AUTOGROUP_WINDOW_S if group.startswith(AUTO_PREFIX) else self.window_s

    def _full(self, rnd: _Round) -> bool:
        if rnd.group.startswith(AUTO_PREFIX):  # no size: every live node reads it, nobody else can join
            return {node for node, _ in rnd.reports} >= set(self.members) or super()._full(rnd)
        return super()._full(rnd)

    def _head_start(self, rnd: _Round, members: dict) -> tuple[str, int] | None:
        """An autogroup round's first reader and how many leading chunks it may have fetched alone."""
        first = self._first.get(rnd.group)
        if first is None or first[0] not in members:
            return None
        node, since = first
        fetched = (trio.current_time() - since) * members[node].snic_bw / CHUNK_BYTES
        return node, int(fetched) + 1 + READ_AHEAD_CHUNKS

    async def _plan(self, rnd: _Round, members: dict) -> dict[tuple[str, int], Planned]:
        files = list(rnd.reports.items())
        ring = list(dict.fromkeys(rep.node for _, rep in files))  # the round's readers, in report order
        readers: dict[bytes, list[str]] = {}
        lengths: dict[bytes, int] = {}
        cached: dict[bytes, set[str]] = collections.defaultdict(set)  # readers that have it in DRAM
        total = 0
        for _, rep in files:
            for key, length in zip(rep.keys, rep.lengths):
                if key is None:
                    continue
                total += length
                lengths[key] = length
                if rep.node not in readers.setdefault(key, []):
                    readers[key].append(rep.node)
        for _, rep in files:
            for index in rep.have:
                if (key := rep.keys[index]) is not None:
                    cached[key].add(rep.node)
        if (head_start := self._head_start(rnd, members)) is not None:
            first, count = head_start
            for _, rep in files:
                if rep.node == first:
                    for key in rep.keys[:count]:
                        if key is not None:
                            cached[key].add(first)  # as good as in its DRAM: it fetched them, or will
        load: collections.Counter[str] = collections.Counter()
        chains: dict[bytes, list[str]] = {}
        for key, rs in readers.items():
            in_pool = [n for n in rs if n in cached[key]]
            if in_pool:
                head = in_pool[0]  # served from its DRAM: no storage fetch
            else:
                head = min(rs, key=lambda n: (load[n] / max(members[n].snic_bw, 1.0), ring.index(n)))
                load[head] += lengths[key]
            order = [n for n in ring if n in rs]
            i = order.index(head)
            chains[key] = order[i:] + order[:i]
        common = ReadPlan(round=rnd.name, files=len(files), readers=len(ring), total_bytes=total,
                          unique_bytes=sum(lengths.values()), fetch_bytes=dict(load))
        answers: dict[tuple[str, int], Planned] = {}
        for file_key, rep in files:
            chained = {str(i): tuple(chains[k]) for i, k in enumerate(rep.keys) if k is not None}
            answers[file_key] = replace(common, chains=chained)
        return answers

    def _record(self, group: str, a: Planned) -> None:
        assert isinstance(a, ReadPlan), "read rounds are answered with read plans"
        g = self._count(group, a)
        g.last = {"round": a.round, "readers": a.readers, "fetch_bytes": a.fetch_bytes}
        self.plans += 1
        log.info("read_round_planned round=%s files=%d readers=%d bytes=%d unique=%d fetches=%s",
                 a.round, a.files, a.readers, a.total_bytes, a.unique_bytes, a.fetch_bytes)
