"""A node as the planner sees it; plain data, importable without the planner's extra."""

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSpec:
    """One node as the planner sees it.  Bandwidths in bytes/s."""

    send_bw: float  # compute-fabric send
    recv_bw: float  # compute-fabric receive
    snic_bw: float  # storage NIC: the rate this node can persist (upload) at
    dram_free_bytes: int  # DRAM this node can give to chunks it receives this round
