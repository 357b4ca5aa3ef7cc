"""Grouped-write planner: pure math, no I/O, no trio (docs/design.md, "Grouped I/O").

Given one round of a grouped write -- the unique chunks after dedup, which
nodes already hold each, the nodes' fabric, S-NIC and DRAM budgets, the
backend cap and the replica count R -- the planner decides for every chunk
which nodes it is copied to over the fabric (to reach R holders, and to move
persist work off busy S-NICs) and which node uploads it, minimising the
round's makespan.

* ``_model``: a node-level flow LP (cvxpy + HiGHS, compiled once per node
  count with Parameters) whose optimum is a lower bound on any plan;
* ``_assign``: rounds the LP's flows to chunks, then a bounded local search;
* ``_pattern``: the canonical form of a round and the plan-cache key: a
  round whose (size, holders) multiset repeats -- step after step of one job
  -- reuses the earlier assignment without solving.

Model simplification: fabric transfers and uploads run concurrently
(pipelined per chunk), so a plan's time is its busiest single resource.

Usage::

    planner = Planner()
    plan = planner.plan(PlanInput.build(nodes, backend_bw=..., replicas=2,
                                        chunks=[(size, holders), ...]))
    plan.chunk(c)  # ChunkAssignment(stage_targets=((src, dst), ...), persister=node)

``PlanInput`` raises ValueError for malformed rounds (e.g. more replicas than
nodes); ``plan`` raises ``PlanInfeasible`` (an ``AiturboError``, ENOSPC) when
the free DRAM cannot hold the replicas.
"""

import importlib

from .._errors import missing_extra
from ._node import NodeSpec as NodeSpec

# Loaded on first use: they need numpy and cvxpy, the 'cluster' extra, which
# a single-node install (whose rounds are planned without the LP) may lack.
_LAZY = {"Planner": "._planner", "Plan": "._types", "PlanInput": "._types",
         "PlanInfeasible": "._types", "ChunkAssignment": "._types"}


def available() -> bool:
    """Whether the LP planner's dependencies are installed."""
    try:
        importlib.import_module("._planner", __name__)
    except ImportError:
        return False
    return True


def __getattr__(name: str):
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name], __name__)
        except ImportError as exc:
            raise missing_extra("the grouped-write planner", "cluster", exc) from exc
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
