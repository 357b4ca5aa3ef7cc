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
"""

from __future__ import annotations

import collections
import logging

from .._limits import READ_ROUND_WAIT_MAX_S
from ._rounds import RoundKeeper, _Round

log = logging.getLogger(__name__)


class ReadRoundKeeper(RoundKeeper):
    """The read rounds of one controller (see module doc); the rest is ``RoundKeeper``'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wait_max_s = min(self.wait_max_s, READ_ROUND_WAIT_MAX_S)
        self.window_s = min(self.window_s, self.wait_max_s)

    async def _plan(self, rnd: _Round, members: dict) -> dict[tuple[str, int], dict]:
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
        common = {"round": rnd.name, "files": len(files), "readers": len(ring), "total_bytes": total,
                  "unique_bytes": sum(lengths.values()), "fetch_bytes": dict(load)}
        answers: dict[tuple[str, int], dict] = {}
        for file_key, rep in files:
            chained = {str(i): chains[k] for i, k in enumerate(rep.keys) if k is not None}
            answers[file_key] = {**common, "chains": chained}
        return answers

    def _record(self, group: str, a: dict) -> None:
        g = self._count(group, a)
        g.last = {"round": a["round"], "readers": a["readers"], "fetch_bytes": a["fetch_bytes"]}
        self.plans += 1
        log.info("read_round_planned round=%s files=%d readers=%d bytes=%d unique=%d fetches=%s",
                 a["round"], a["files"], a["readers"], a["total_bytes"], a["unique_bytes"], a["fetch_bytes"])
