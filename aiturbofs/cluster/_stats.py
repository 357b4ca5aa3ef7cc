"""The counters of this node's part of a cluster (``ClusterNode.status``), kept by the parts that count them."""

from __future__ import annotations

from typing import Any, TypedDict


class Stats(TypedDict):
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


def new_stats() -> Stats:
    return {
        "rounds": 0, "rounds_failed": 0, "chunks_replicated": 0, "bytes_replicated": 0,
        "chunks_received": 0, "chunks_served": 0, "chunks_fetched": 0, "last_plan": None,
        "read_rounds": 0, "chunks_from_chain": 0, "chunks_prefetched": 0, "last_read_plan": None,
        "round_wait_s_total": 0.0, "plan_s_total": 0.0, "round_bytes_total": 0, "round_unique_bytes_total": 0,
    }
