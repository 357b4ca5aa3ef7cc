"""The controller a single-node daemon embeds: group statistics, and rounds over one member.

Every committed file of a group is counted (``report_close``, shown by
``aiturbo status``).  ``report`` runs the same ``RoundKeeper`` as the cluster
controller with this node as the only member, so files of one round that
share chunks upload each unique chunk once and copy the rest.
"""

import collections
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import planner
from .._limits import GROUP_CHUNKS_TRACKED_MAX, HASH_BYTES
from ..messages import ReadPlan, Refused, Report, WritePlan

if TYPE_CHECKING:
    from ._rounds import RoundKeeper

log = logging.getLogger(__name__)

# With one node nothing moves over the fabric: only the S-NIC and backend
# figures shape the (trivial) plan, and they only need to be positive.
_LOCAL_BW = 1e9  # bytes/s


@dataclass
class GroupStats:
    files: int = 0
    bytes: int = 0
    chunks: int = 0
    distinct: set = field(default_factory=set)


class EmbeddedController:
    def __init__(self, meta=None, node: str = "local", *, spec=None, backend_bw: float = _LOCAL_BW,
                 **round_options):
        """``spec``: this node's ``NodeSpec`` (or ``(send_bw, recv_bw, snic_bw, dram_free)``);
        ``round_options`` go to ``RoundKeeper`` (``window_s``, ``wait_max_s``, ``planner``)."""
        self.node = node
        self.groups: dict[str, GroupStats] = collections.defaultdict(GroupStats)
        self.members = {node: spec or (_LOCAL_BW, _LOCAL_BW, _LOCAL_BW, 0)}
        self._keeper_args = (meta, backend_bw, round_options)
        self._rounds: RoundKeeper | None = None

    @property
    def rounds(self) -> "RoundKeeper":
        """The ``RoundKeeper``, made (and the planner imported) on first use."""
        if self._rounds is None:
            from ._rounds import RoundKeeper

            meta, backend_bw, options = self._keeper_args
            if "plan" not in options and not planner.available():
                # One node: the LP would place every chunk here anyway; dedup is all a round can do.
                log.info("grouped rounds: dedup only (the LP planner needs the 'cluster' extra)")
                options = {**options, "plan": "dedup"}
            self._rounds = RoundKeeper(meta, self.members, backend_bw=backend_bw, **options)
        return self._rounds

    async def report(self, report: Report) -> WritePlan | ReadPlan | Refused:
        """This node's file report for a group round; the round's answer (see ``RoundKeeper.report``)."""
        return await self.rounds.report(self.node, report)

    async def report_close(self, report) -> None:
        if report.group is None:
            return
        g = self.groups[report.group]
        g.files += 1
        g.bytes += report.size
        for i in range(0, len(report.manifest), HASH_BYTES):
            g.chunks += 1
            if len(g.distinct) < GROUP_CHUNKS_TRACKED_MAX:
                g.distinct.add(report.manifest[i : i + HASH_BYTES])

    def summary(self) -> dict:
        return {
            name: {"files": g.files, "bytes": g.bytes, "chunks": g.chunks, "distinct_chunks": len(g.distinct)}
            for name, g in self.groups.items()
        }
