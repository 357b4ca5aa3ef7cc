"""Grouped-write planner: pure math, no I/O, no trio (DESIGN.md, "Grouped I/O").

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

from ._planner import Planner as Planner
from ._types import ChunkAssignment as ChunkAssignment
from ._types import NodeSpec as NodeSpec
from ._types import Plan as Plan
from ._types import PlanInfeasible as PlanInfeasible
from ._types import PlanInput as PlanInput
