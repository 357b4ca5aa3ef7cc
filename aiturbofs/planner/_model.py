"""The node-level flow LP of a grouped write: a lower bound and a guide for rounding.

The model, in bytes (scaled by the round's unique bytes U; time scaled by
``tau = U / min(backend_bw, sum of S-NIC bw)``, so T >= 1):

* ``f[i, j]``  fabric bytes node i sends to node j (i != j), split into
  ``fp[i, j]`` (chunks travelling to the node that persists them) and
  ``fr[i, j]`` (further copies, for replicas);
* ``g[i, j]``  persist responsibility handed from i to j for chunks both hold
  (free: no byte moves), at most ``M[i, j]``; in all, a node hands off at most
  its share of the chunks it shares and takes on at most the co-holders' shares;
* ``p[i]``     bytes node i persists;  ``T`` the makespan, ``Tp`` the S-NIC makespan.

Data aggregated from the chunks: each chunk's bytes are first split evenly
over its holders (the *origin* ``o0``); ``M[i, j]`` = sum over chunks held by
both i and j of size / holders; ``D`` = sum of size * max(0, R - holders),
the bytes that must be copied to reach R replicas; ``excl[i]`` = bytes only
node i holds (when R >= 2 each leaves i at least once); ``lack[i]`` = bytes
of the chunks node i does not hold (all it could ever receive).

Constraints: per node, sent <= T send_bw, received <= T recv_bw, received
<= min(free DRAM, lack), sent >= excl, p <= Tp snic_bw, Tp <= T; U <= T
backend_bw; total received >= D; origin o = o0 + in(g) - out(g) >= 0;
persist conservation o + in(fp) - out(fp) = p.

No constraint involves a single link (the fabric is limited per node, not
per pair), so only each node's totals of ``fp`` and ``fr`` matter, and the LP
carries those (``N`` values each instead of ``N^2``): non-negative totals
``out``/``in`` are the row/column sums of some zero-diagonal flow matrix iff
``out[i] + in[i] <= sum(in) = sum(out)`` for every i (max-flow/min-cut on
the bipartite graph without i -> i edges).  ``fp`` is recovered as a matrix
afterwards (north-west corner); any matrix with these totals is as good.

Why this is a lower bound on every chunk-level plan: given any plan, let each
chunk's origin be the holder its persist path starts from; then g (moving the
even split to that origin) respects M, fp (the path) is part of the real
traffic, every needed copy is a receive at a distinct non-holder, and all the
capacity constraints hold with the plan's own makespan.  So the LP optimum
T* <= that makespan.

Simplification (stated here for every user of ``makespan_s``): the fabric
phase and the persist phase are modelled as *concurrent* (each chunk is
pipelined: staged, then uploaded while others are still moving), so a plan's
time is the busiest single resource (a node's send, receive or S-NIC, or the
backend), not their sum.  Per-link limits inside the fabric are ignored: a
node's send and receive bandwidths are its only fabric constraints.

The objective adds tiny secondary terms, ``W_TP * Tp`` (spread persist evenly
over the S-NICs even when the backend is the bottleneck) and
``W_FLOW * sum(fp)`` (no useless transfers); the reported bound corrects for
them so it stays a valid lower bound.

The problem is compiled once per node count with cvxpy Parameters (DPP) and
re-solved with new data by HiGHS.
"""

import time
from dataclasses import dataclass

import cvxpy as cp
import numpy as np

from .._limits import PLAN_SOLVER_TIME_LIMIT_S
from ._pattern import Pattern
from ._types import PlanInfeasible, PlanInput

W_TP = 1e-4  # weight of the S-NIC makespan in the objective (T >= Tp, T ~ 1)
W_FLOW = 1e-5  # weight of the persist traffic (sum fp <= 1 at some optimum)


@dataclass(frozen=True)
class LpData:
    """The round aggregated to node level (bytes, bytes/s)."""

    unique_bytes: float
    origin0: np.ndarray  # (N,)
    shared: np.ndarray  # (N, N) M, zero diagonal
    copy_bytes: float  # D
    exclusive: np.ndarray  # (N,)
    lacking: np.ndarray  # (N,) bytes of the chunks node i does not hold: all it could ever receive
    sharable: np.ndarray  # (N,) node i's even share of the chunks it shares: the most it can hand off
    gatherable: np.ndarray  # (N,) the co-holders' shares of those chunks: the most it can take on


@dataclass(frozen=True)
class LpSolution:
    bound_s: float  # a valid lower bound on the makespan of any plan
    origin: np.ndarray  # (N,) bytes each node is responsible for persisting or forwarding
    persist_flow: np.ndarray  # (N, N) bytes: fp
    persist: np.ndarray  # (N,) bytes: p
    solve_s: float


def lp_data(inp: PlanInput, pat: Pattern) -> LpData:
    hold = pat.class_holders.astype(np.float64)  # (K, N)
    share = pat.class_bytes / np.maximum(pat.class_hcount, 1)
    origin0 = hold.T @ share
    shared = (hold * share[:, None]).T @ hold
    np.fill_diagonal(shared, 0.0)
    copy_bytes = float(np.sum(pat.class_bytes * np.maximum(0, inp.replicas - pat.class_hcount)))
    exclusive = np.zeros(inp.nodes)
    if inp.replicas >= 2:
        single = pat.class_hcount == 1
        exclusive = hold[single].T @ pat.class_bytes[single]
    lacking = float(pat.class_bytes.sum()) - hold.T @ pat.class_bytes
    multi = (pat.class_hcount >= 2).astype(np.float64)
    sharable = hold.T @ (share * multi)
    gatherable = hold.T @ (share * (pat.class_hcount - 1) * multi)
    return LpData(float(pat.class_bytes.sum()), origin0, shared, copy_bytes, exclusive, np.maximum(lacking, 0.0),
                  sharable, gatherable)


def trivial_bound_s(inp: PlanInput, data: LpData) -> float:
    """A lower bound without the LP: the aggregate resources alone."""
    u = data.unique_bytes
    bounds = [u / inp.backend_bw]
    snic = inp.snic_bw.sum()
    bounds.append(u / snic if snic > 0 else np.inf)
    if data.copy_bytes > 0:
        recv = inp.recv_bw.sum()
        bounds.append(data.copy_bytes / recv if recv > 0 else np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        excl = np.where(data.exclusive > 0, data.exclusive / inp.send_bw, 0.0)
    bounds.append(float(excl.max(initial=0.0)))
    return float(max(bounds))


class FlowModel:
    """The LP for ``n`` nodes, compiled once; ``solve`` swaps in a round's data."""

    def __init__(self, n: int):
        self.n = n
        P = lambda shape=(): cp.Parameter(shape, nonneg=True)  # noqa: E731
        self.send, self.recv, self.snic, self.dram = P(n), P(n), P(n), P(n)
        self.origin0, self.exclusive, self.shared = P(n), P(n), P((n, n))
        self.sharable, self.gatherable = P(n), P(n)
        self.copy, self.backend_t = P(), P()
        V = lambda: cp.Variable(n, nonneg=True)  # noqa: E731
        self.fp_out, self.fp_in, self.fr_out, self.fr_in, self.p = V(), V(), V(), V(), V()
        self.g = cp.Variable((n, n), nonneg=True)  # (bounded by a constraint: Parameter bounds are recent in cvxpy)
        self.T = cp.Variable()
        self.Tp = cp.Variable()
        sent, received = self.fp_out + self.fr_out, self.fp_in + self.fr_in
        fp_total, fr_total = cp.sum(self.fp_in), cp.sum(self.fr_in)
        self.origin = self.origin0 + cp.sum(self.g, axis=0) - cp.sum(self.g, axis=1)
        constraints = [
            sent <= cp.multiply(self.T, self.send),
            received <= cp.multiply(self.T, self.recv),
            received <= self.dram,
            sent >= self.exclusive,
            fp_total + fr_total >= self.copy,
            cp.sum(self.fp_out) == fp_total,
            cp.sum(self.fr_out) == fr_total,
            self.fp_out + self.fp_in <= fp_total,  # totals of a zero-diagonal matrix
            self.fr_out + self.fr_in <= fr_total,
            self.p <= cp.multiply(self.Tp, self.snic),
            self.T >= self.Tp,
            self.T >= self.backend_t,
            self.g <= self.shared,
            cp.sum(self.g, axis=1) <= self.sharable,
            cp.sum(self.g, axis=0) <= self.gatherable,
            self.origin >= 0,
            self.origin + self.fp_in - self.fp_out == self.p,
        ]
        objective = cp.Minimize(self.T + W_TP * self.Tp + W_FLOW * fp_total)
        self.problem = cp.Problem(objective, constraints)
        assert self.problem.is_dpp()

    def solve(self, inp: PlanInput, data: LpData) -> LpSolution:
        t0 = time.perf_counter()
        u = data.unique_bytes
        tau = u / min(inp.backend_bw, float(inp.snic_bw.sum()))  # seconds per time unit
        rate = tau / u  # bytes/s -> scaled
        self.send.value = inp.send_bw * rate
        self.recv.value = inp.recv_bw * rate
        self.snic.value = inp.snic_bw * rate
        # A node only ever receives chunks it lacks, each once.
        self.dram.value = np.minimum(inp.dram_free_bytes, data.lacking) / u
        self.origin0.value = data.origin0 / u
        self.shared.value = data.shared / u
        self.sharable.value = data.sharable / u
        self.gatherable.value = data.gatherable / u
        self.exclusive.value = data.exclusive / u
        self.copy.value = data.copy_bytes / u
        self.backend_t.value = u / inp.backend_bw / tau
        self.problem.solve(solver=cp.HIGHS, warm_start=False, time_limit=PLAN_SOLVER_TIME_LIMIT_S,
                           highs_options={"solver": "simplex", "simplex_strategy": 1})  # dual simplex
        status = self.problem.status
        if status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
            raise PlanInfeasible(_why_infeasible(inp, data))
        if status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) or self.T.value is None:
            raise RuntimeError(f"HiGHS did not solve the staging LP ({status}); {self.n} nodes")
        t_eps = float(self.T.value)
        bound = max((t_eps - W_FLOW) / (1.0 + W_TP), 0.0) * tau
        fp_out, fp_in, p = self.fp_out.value, self.fp_in.value, self.p.value
        assert fp_out is not None and fp_in is not None and p is not None  # an optimal solve sets every variable
        return LpSolution(
            bound_s=max(bound, trivial_bound_s(inp, data)),  # both are valid lower bounds
            origin=np.maximum(np.asarray(self.origin.value, dtype=np.float64), 0.0) * u,
            persist_flow=_pairs(np.maximum(fp_out, 0.0) * u, np.maximum(fp_in, 0.0) * u),
            persist=np.maximum(p, 0.0) * u,
            solve_s=time.perf_counter() - t0,
        )


def _pairs(out: np.ndarray, inn: np.ndarray) -> np.ndarray:
    """A flow matrix with these row/column totals (north-west corner), a node's own in/out netted first."""
    both = np.minimum(out, inn)
    out, inn = out - both, inn - both
    flow = np.zeros((len(out), len(out)))
    senders, receivers = np.flatnonzero(out > 0), np.flatnonzero(inn > 0)
    a, b = out[senders].copy(), inn[receivers].copy()
    i = j = 0
    while i < len(a) and j < len(b):
        x = min(a[i], b[j])
        flow[senders[i], receivers[j]] += x
        a[i] -= x
        b[j] -= x
        if a[i] <= b[j]:
            i += 1
        else:
            j += 1
    return flow


def _why_infeasible(inp: PlanInput, data: LpData) -> str:
    free = int(inp.dram_free_bytes.sum())
    stuck = np.flatnonzero((data.exclusive > 0) & (inp.send_bw <= 0))
    if len(stuck):
        return (f"node {int(stuck[0])} alone holds chunks that need {inp.replicas} replicas "
                f"but has no fabric send bandwidth")
    if data.copy_bytes > 0:
        return (
            f"cannot stage {inp.replicas} replicas: {int(data.copy_bytes)} bytes must be copied to "
            f"non-holders, the {inp.nodes} nodes have {free} bytes of free DRAM in all "
            f"(or not where the holders can reach)"
        )
    return f"no plan persists {int(data.unique_bytes)} bytes with these bandwidths and {free} bytes of free DRAM"
