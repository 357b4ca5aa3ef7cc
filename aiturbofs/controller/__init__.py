"""Control plane.  On a single node it is embedded in the daemon.

The embedded controller receives every committed file's report (path, chunk
hashes, group tag) — the data grouped I/O is planned from — and keeps per
group statistics for ``aiturbo status``.  Grouped rounds, dedup across ranks
and the staging plan come with cluster mode.
"""

import collections
from dataclasses import dataclass, field

GROUP_CHUNKS_TRACKED_MAX = 1 << 20  # distinct chunk hashes remembered per group


@dataclass
class GroupStats:
    files: int = 0
    bytes: int = 0
    chunks: int = 0
    distinct: set = field(default_factory=set)


class EmbeddedController:
    def __init__(self):
        self.groups: dict[str, GroupStats] = collections.defaultdict(GroupStats)

    async def report_close(self, report) -> None:
        if report.group is None:
            return
        g = self.groups[report.group]
        g.files += 1
        g.bytes += report.size
        for i in range(0, len(report.manifest), 32):
            g.chunks += 1
            if len(g.distinct) < GROUP_CHUNKS_TRACKED_MAX:
                g.distinct.add(report.manifest[i : i + 32])

    def summary(self) -> dict:
        return {
            name: {"files": g.files, "bytes": g.bytes, "chunks": g.chunks, "distinct_chunks": len(g.distinct)}
            for name, g in self.groups.items()
        }
