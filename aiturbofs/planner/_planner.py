"""The planner: LP per node count, rounding, and the cache of repeating rounds."""

import collections
import threading
import time

import numpy as np

from .._limits import PLAN_CACHE_ENTRIES_MAX, PLAN_MODELS_MAX
from ._assign import _times, assign
from ._model import FlowModel, lp_data, trivial_bound_s
from ._pattern import Pattern, pattern_of
from ._types import Plan, PlanInfeasible, PlanInput


class _Cached:
    """A plan in canonical chunk order, reusable for any round with the same pattern."""

    __slots__ = ("persister", "transfers", "received", "lp_bound_s", "dram")

    def __init__(self, persister, transfers, received, lp_bound_s, dram):
        self.persister, self.transfers, self.received = persister, transfers, received
        self.lp_bound_s = lp_bound_s
        self.dram = dram  # the free DRAM the bound was computed with (capped at the round's bytes)


class Planner:
    """Plans grouped-write rounds.  One per controller; ``plan`` is thread-safe
    (it serialises callers: the compiled LPs are shared mutable state) and
    blocking (tens of ms), so trio code calls it through ``to_thread``."""

    def __init__(self, *, cache_entries: int = PLAN_CACHE_ENTRIES_MAX, models_max: int = PLAN_MODELS_MAX):
        self._lock = threading.Lock()
        self._models: collections.OrderedDict[int, FlowModel] = collections.OrderedDict()
        self._models_max = max(1, models_max)
        self._cache: collections.OrderedDict[bytes, _Cached] = collections.OrderedDict()
        self._cache_entries = cache_entries
        self.cache_hits = 0
        self.cache_misses = 0

    def model(self, n: int) -> FlowModel:
        """The compiled LP for ``n`` nodes (built on first use, then kept, LRU)."""
        m = self._models.get(n)
        if m is None:
            m = self._models[n] = FlowModel(n)
            while len(self._models) > self._models_max:
                self._models.popitem(last=False)
        self._models.move_to_end(n)
        return m

    def plan(self, inp: PlanInput, *, use_cache: bool = True) -> Plan:
        with self._lock:
            return self._plan(inp, use_cache)

    def _plan(self, inp: PlanInput, use_cache: bool) -> Plan:
        t0 = time.perf_counter()
        n = inp.nodes
        if inp.chunks == 0:
            zeros = np.zeros(n, dtype=np.int64)
            return Plan(np.zeros(0, np.int32), np.zeros((0, 3), np.int32), zeros, zeros.copy(), zeros.copy(),
                        makespan_s=0.0, lp_bound_s=0.0, solve_s=time.perf_counter() - t0)
        if not inp.snic_bw.sum() > 0:
            raise PlanInfeasible(f"no node has S-NIC bandwidth to persist {inp.unique_bytes} bytes")
        pat = pattern_of(inp)
        if use_cache and self._cache_entries > 0:
            hit = self._cache.get(pat.key)
            if hit is not None and np.all(hit.received <= inp.dram_free_bytes):
                self._cache.move_to_end(pat.key)
                self.cache_hits += 1
                bound = hit.lp_bound_s
                if np.any(_capped_dram(inp) > hit.dram):  # more DRAM now: the old LP bound may be too high
                    bound = trivial_bound_s(inp, lp_data(inp, pat))
                return _finish(inp, pat, hit.persister, hit.transfers, bound, t0, cached=True)
            self.cache_misses += 1
        _check_chunks(inp, pat)
        data = lp_data(inp, pat)
        lp_s = 0.0
        if n == 1:  # no fabric: the one node persists everything
            persister = np.zeros(inp.chunks, dtype=np.int64)
            transfers = np.zeros((0, 3), dtype=np.int64)
            bound = trivial_bound_s(inp, data)
        else:
            sol = self.model(n).solve(inp, data)
            bound, lp_s = sol.bound_s, sol.solve_s
            rnd = assign(inp, pat, sol, floor_s=bound)
            persister, transfers = rnd.persister, rnd.transfers()
        plan = _finish(inp, pat, persister, transfers, bound, t0, cached=False, lp_s=lp_s)
        if not np.isfinite(plan.makespan_s):
            raise PlanInfeasible(f"no plan found: {plan.bottleneck} has no bandwidth for its bytes", proven=False)
        if use_cache and self._cache_entries > 0:
            self._cache[pat.key] = _Cached(persister.astype(np.int32), transfers.astype(np.int32),
                                           plan.bytes_received.copy(), bound, _capped_dram(inp))
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return plan


def _check_chunks(inp: PlanInput, pat: Pattern) -> None:
    """Each chunk alone must fit: R - h non-holders with room for it, and some node able to upload it.

    Per class, with its largest chunk (the first, in canonical order): if that one fits, all do."""
    largest = pat.sizes[pat.class_start[:-1]]
    can_take = ~pat.class_holders & (inp.dram_free_bytes[None, :] >= largest[:, None])
    short = can_take.sum(axis=1) < inp.replicas - pat.class_hcount
    snic = inp.snic_bw > 0
    stuck = ~(pat.class_holders & snic).any(axis=1) & ~(can_take & snic).any(axis=1)
    for k in np.flatnonzero(short | stuck).tolist():  # look at the class chunk by chunk
        lo, hi = pat.class_start[k], pat.class_start[k + 1]
        sizes = pat.sizes[lo:hi]
        fits = ~pat.class_holders[k] & (inp.dram_free_bytes[None, :] >= sizes[:, None])  # (m, N)
        need = inp.replicas - int(pat.class_hcount[k])
        bad = np.flatnonzero(fits.sum(axis=1) < need)
        if len(bad):
            c = int(bad[0])
            raise PlanInfeasible(
                f"cannot stage {inp.replicas} replicas: a chunk of {int(sizes[c])} bytes held by "
                f"{int(pat.class_hcount[k])} node(s) needs {need} more nodes with that much free DRAM, "
                f"{int(fits[c].sum())} have it"
            )
        if stuck[k] and not (fits & snic).any(axis=1).all():
            c = int(np.argmin((fits & snic).any(axis=1)))
            raise PlanInfeasible(f"a chunk of {int(sizes[c])} bytes: no holder has S-NIC bandwidth and no node "
                                 f"with S-NIC bandwidth has room for it")


def _capped_dram(inp: PlanInput) -> np.ndarray:
    return np.minimum(inp.dram_free_bytes, inp.unique_bytes)  # the LP never uses more


def _finish(inp: PlanInput, pat: Pattern, persister, transfers, bound: float, t0: float, *, cached: bool,
            lp_s: float = 0.0) -> Plan:
    """The Plan in the caller's chunk order, with per-node bytes and the achieved makespan."""
    n = inp.nodes
    size = pat.sizes.astype(np.float64)
    ch, src, dst = transfers[:, 0], transfers[:, 1], transfers[:, 2]
    sent = np.bincount(src, size[ch], minlength=n).round().astype(np.int64)
    received = np.bincount(dst, size[ch], minlength=n).round().astype(np.int64)
    persisted = np.bincount(persister, size, minlength=n).round().astype(np.int64)
    times = np.stack([_times(sent.astype(np.float64), inp.send_bw), _times(received.astype(np.float64), inp.recv_bw),
                      _times(persisted.astype(np.float64), inp.snic_bw)])
    kind, node = np.unravel_index(int(np.argmax(times)), times.shape)
    backend_s = inp.unique_bytes / inp.backend_bw
    if backend_s >= times[kind, node]:
        makespan, bottleneck = backend_s, "backend"
    else:
        makespan, bottleneck = float(times[kind, node]), f"{('send', 'recv', 'persist')[kind]}@{node}"
    out_persister = np.empty(inp.chunks, dtype=np.int32)
    out_persister[pat.order] = persister
    caller_chunk = pat.order[ch]
    keep = np.argsort(caller_chunk, kind="stable")  # stable: each chunk's transfers stay in runnable order
    out_transfers = np.stack([caller_chunk[keep], src[keep], dst[keep]], axis=1).astype(np.int32)
    return Plan(
        persister=out_persister,
        transfers=out_transfers.reshape(-1, 3),
        bytes_sent=sent,
        bytes_received=received,
        bytes_persisted=persisted,
        makespan_s=float(makespan),
        lp_bound_s=float(bound),
        solve_s=time.perf_counter() - t0,
        lp_s=lp_s,
        cached=cached,
        bottleneck=bottleneck,
    )
