"""Rounding the node-level LP to chunks: who persists each chunk, where its copies go.

Four passes over the canonical chunk order (``_pattern``), vectorised per
holder class so a round of ~10^5 chunks takes milliseconds:

1. **Persist routes** follow the LP.  Its persist flows give each node a
   quota per route: "persist in place" and "send to j to persist there".
   Classes take their holders' remaining quotas, the most constrained (fewest
   holders) first; a route to a node that also holds the class runs as a
   persist in place there.  A large class is dealt by cumulative size (each
   route within one chunk of its quota); a small one chunk by chunk, each to
   the route with the most quota left, so many small classes do not all
   round the same way.
2. **Replicas.**  A chunk with h < R holders needs R - h new holders; a
   persist route to a non-holder is the first of them.  The others are dealt
   column by column over the non-holders, water-filled on receive time
   within free DRAM; column 0 is sent by the holders (water-filled on send
   time), column t by the node that received column t - 1 (a chain, so no
   single writer sends R - 1 copies).  Rows that got the same node twice
   are fixed one by one.
3. **DRAM repair**: a node whose received bytes exceed its free DRAM
   (rounding overshoot) hands transfers to other nodes, or drops copies
   beyond R, whichever costs less time.  If no node can take a needed copy,
   the rounding starts over DRAM-first (``dram_first``: the hardest chunks
   first, each copy to the non-holders with the most room left); if that
   fails too, ``PlanInfeasible(proven=False)``.
4. **Local search** (at most ``PLAN_IMPROVE_MOVES_MAX`` moves): while the
   busiest node resource is above the LP bound, move one chunk's persist,
   transfer source or transfer destination off it if that lowers it without
   raising another resource to its level.  This fixes the rounding error
   that matters on small rounds.

Invariant of the transfer list: a transfer's source is an original holder
of its chunk or the destination of an earlier transfer of the same chunk, so
running the transfers of a chunk in list order is always possible.
"""

import numpy as np

from .._limits import PLAN_IMPROVE_CANDIDATES, PLAN_IMPROVE_GAP, PLAN_IMPROVE_MOVES_MAX
from ._model import LpSolution
from ._pattern import Pattern
from ._types import PlanInfeasible, PlanInput

_TOL = 1e-12  # relative: a move must lower the busiest resource by more than this
_GREEDY_CHUNKS = 64  # classes this small are dealt chunk by chunk (exact), larger ones by cumulative size


def _times(load: np.ndarray, bw: np.ndarray) -> np.ndarray:
    """Seconds each resource needs: load / bw, with 0/0 = 0 and x/0 = inf."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = load / bw
    t[(bw <= 0) & (load <= 0)] = 0.0
    return t


def _over(load: np.ndarray, bw: np.ndarray) -> np.ndarray:
    """Seconds a resource would need for ``load`` > 0 bytes: inf where bw is 0 (no errstate: hot path)."""
    return np.divide(load, bw, out=np.full(np.shape(load), np.inf), where=bw > 0)


def _water_fill(load: np.ndarray, bw: np.ndarray, cap: np.ndarray, amount: float) -> np.ndarray:
    """x with 0 <= x <= cap, sum x = amount (or all of cap), levelling (load + x) / bw.

    x_j(level) = clip(level * bw_j - load_j, 0, cap_j) is piecewise linear in
    the level; the right piece is found among the 2N breakpoints at once.
    """
    ok = bw > 0
    cap = np.where(ok, np.maximum(cap, 0.0), 0.0)
    if amount >= cap.sum():
        return cap
    if amount <= 0:
        return np.zeros_like(cap)
    bw_ok = np.where(ok, bw, 1.0)
    starts = np.where(ok, load / bw_ok, np.inf)
    points = np.unique(np.concatenate([starts, np.where(ok, (load + cap) / bw_ok, np.inf)]))
    points = points[np.isfinite(points)]
    filled = np.clip(points[:, None] * bw[None, :] - load[None, :], 0.0, cap[None, :]).sum(axis=1)
    i = int(np.searchsorted(filled, amount))  # filled[i - 1] < amount <= filled[i]
    if i == 0:
        level = points[0]
    else:
        lo, hi = points[i - 1], points[i]
        f_lo, f_hi = filled[i - 1], filled[i]
        level = lo + (hi - lo) * (amount - f_lo) / (f_hi - f_lo)
    x = np.clip(level * bw - load, 0.0, cap)
    total = x.sum()
    return x * (amount / total) if total > 0 else x


def _deal(sizes: np.ndarray, quota: np.ndarray) -> np.ndarray:
    """Index of the quota each item goes to: items in order, quotas by cumulative size."""
    if len(quota) == 1:
        return np.zeros(len(sizes), dtype=np.int64)
    total = sizes.sum()
    bounds = np.cumsum(quota) * (total / quota.sum())
    mid = np.cumsum(sizes) - sizes / 2.0
    return np.minimum(np.searchsorted(bounds, mid, side="right"), len(quota) - 1)


class Rounding:
    """The chunk-level assignment being built, in canonical chunk order."""

    def __init__(self, inp: PlanInput, pat: Pattern):
        self.inp, self.pat = inp, pat
        self.n, self.c, self.r = inp.nodes, len(pat.sizes), inp.replicas
        self.size = pat.sizes.astype(np.float64)
        self.persister = np.zeros(self.c, dtype=np.int64)
        self.pers = np.zeros(self.n)
        self.send = np.zeros(self.n)
        self.recv = np.zeros(self.n)
        self.dram = inp.dram_free_bytes.astype(np.float64)
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.moves = 0

    # --- pass 1 and 2 -----------------------------------------------------------------

    def _add_transfers(self, chunks, src, dst):
        if len(chunks):
            self._parts.append((np.asarray(chunks, np.int64), np.asarray(src, np.int64), np.asarray(dst, np.int64)))
            sz = self.size[chunks]
            self.send += np.bincount(src, sz, minlength=self.n)
            self.recv += np.bincount(dst, sz, minlength=self.n)

    def persist_routes(self, sol: LpSolution) -> None:
        inp, pat, n = self.inp, self.pat, self.n
        origin = sol.origin
        net = np.maximum(sol.persist_flow - sol.persist_flow.T, 0.0)  # cancel swaps
        np.fill_diagonal(net, 0.0)
        out = net.sum(axis=1)
        relay = out > origin  # forwards more than it is responsible for: scale to its origin
        if relay.any():
            net[relay] *= (origin[relay] / out[relay])[:, None]
        # quota[i, j]: bytes the LP has node i hand to j to persist; quota[i, i]: persisted in place.
        quota = net
        quota[np.diag_indices(n)] = np.maximum(origin - net.sum(axis=1), 0.0)
        snic = inp.snic_bw
        for k in np.argsort(pat.class_hcount, kind="stable"):  # the most constrained classes first
            lo, hi = pat.class_start[k], pat.class_start[k + 1]
            held = pat.class_holders[k]
            hs = np.flatnonzero(held)
            sz = self.size[lo:hi]
            w = quota[hs].copy()  # (h, N): this class may use its holders' remaining quotas
            short = sz.sum() - w.sum()
            if short > 0:  # quotas used up by earlier classes: the rest persists in place, by S-NIC
                share = snic[hs] / snic[hs].sum() if snic[hs].sum() > 0 else np.full(len(hs), 1.0 / len(hs))
                w[np.arange(len(hs)), hs] += short * share
            flat = w.ravel()
            if len(sz) <= _GREEDY_CHUNKS:  # few chunks: each to the route with the most quota left
                route = np.empty(len(sz), dtype=np.int64)
                for x, size in enumerate(sz.tolist()):
                    r = int(np.argmax(flat))
                    route[x] = r
                    flat[r] -= size
            else:  # many: by cumulative size, each route within one chunk of its quota
                pos = np.flatnonzero(flat > 0)
                route = pos[_deal(sz, flat[pos])]
            src, dst = hs[route // n], route % n
            np.subtract.at(quota, (src, dst), sz)
            self.persister[lo:hi] = dst
            remote = np.flatnonzero(~held[dst])  # a route to a co-holder runs as a persist in place there
            self._add_transfers(lo + remote, src[remote], dst[remote])
        self.pers = np.bincount(self.persister, self.size, minlength=n).astype(np.float64)

    def replicas(self) -> None:
        inp, pat, r = self.inp, self.pat, self.r
        for k in np.flatnonzero(pat.class_hcount < r):
            lo, hi = pat.class_start[k], pat.class_start[k + 1]
            held = pat.class_holders[k]
            hs = np.flatnonzero(held)
            cols = r - len(hs)
            sz = self.size[lo:hi]
            new = np.full((hi - lo, cols), -1, dtype=np.int64)  # new holders of each row, column by column
            pers = self.persister[lo:hi]
            staged = ~held[pers]  # the persist route already made the first new holder
            new[staged, 0] = pers[staged]
            cand = np.flatnonzero(~held)
            for t in range(cols):
                rows = np.flatnonzero(new[:, t] < 0)
                if not len(rows):
                    continue
                order = cand
                if t > 0:  # rows by the node they got in column t - 1, nodes dealt in the opposite order
                    rows = rows[np.argsort(new[rows, t - 1], kind="stable")]
                    order = cand[::-1]
                rs = sz[rows]
                cap = np.minimum(self.dram[order] - self.recv[order], rs.sum())
                want = _water_fill(self.recv[order], inp.recv_bw[order], cap, float(rs.sum()))
                if want.sum() <= 0:
                    want = np.ones(len(order))  # nowhere fits: deal anyway, the repair pass decides
                new[rows, t] = order[_deal(rs, want)]
                if t > 0:
                    self._fix_duplicates(new, rows, t, sz, held)
                if t == 0:  # from the holders, levelled on send
                    amount = float(rs.sum())
                    give = _water_fill(self.send[hs], inp.send_bw[hs], np.full(len(hs), amount), amount)
                    src = hs[_deal(rs, give if give.sum() > 0 else np.ones(len(hs)))]
                else:  # a chain: from the node that got the previous copy
                    src = new[rows, t - 1]
                self._add_transfers(lo + rows, src, new[rows, t])

    def _fix_duplicates(self, new: np.ndarray, rows: np.ndarray, t: int, sz: np.ndarray, held: np.ndarray) -> None:
        """Rows whose column-t node already got the chunk in an earlier column take another non-holder."""
        dup = rows[(new[rows, :t] == new[rows, t][:, None]).any(axis=1)]
        if not len(dup):
            return
        recv = self.recv + np.bincount(new[rows, t], sz[rows], minlength=self.n)
        for row in dup.tolist():
            size = sz[row]
            ok = ~held
            ok[new[row, :t]] = False
            roomy = ok & (self.dram - recv >= size)
            d = int(np.argmin(np.where(roomy if roomy.any() else ok, _over(recv + size, self.inp.recv_bw), np.inf)))
            recv[new[row, t]] -= size
            recv[d] += size
            new[row, t] = d

    def dram_first(self) -> None:
        """Fallback when the LP-guided rounding does not pack into free DRAM: place copies chunk by
        chunk, the hardest first (fewest nodes with room, then largest), each on the non-holders with
        the most room left; persist in place where a holder can.  The local search then balances."""
        inp, pat, r = self.inp, self.pat, self.r
        holders = pat.class_holders[pat.cls]  # (C, N) canonical
        room = self.dram.copy()
        snic = inp.snic_bw > 0
        fits = (~holders & (room[None, :] >= self.size[:, None])).sum(axis=1)
        self.persister[:] = -1
        self.pers[:] = 0.0
        chunks, srcs, dsts = [], [], []
        for c in np.lexsort((-self.size, fits)).tolist():
            held, size = holders[c], self.size[c]
            need = r - int(held.sum())
            cand = np.flatnonzero(~held & (room >= size))
            cand = cand[np.argsort(-room[cand], kind="stable")]
            pick = list(cand[: max(need, 0)])
            if len(pick) < need:
                raise PlanInfeasible(f"cannot stage {r} replicas: chunk sizes do not pack into the free DRAM "
                                     f"(chunk of {int(size)} bytes)", proven=False)
            if not (held & snic).any() and not snic[pick].any():  # someone who gets it must upload it
                up = [int(j) for j in cand if snic[j] and int(j) not in pick]
                if not up:
                    raise PlanInfeasible(f"no node with S-NIC bandwidth can take a {int(size)}-byte chunk",
                                         proven=False)
                pick = pick[:-1] + up[:1] if need > 0 else up[:1]
            hs = np.flatnonzero(held)
            prev = int(hs[np.argmin(_over(self.send[hs] + size, inp.send_bw[hs]))]) if pick else -1
            for d in pick:
                chunks.append(c)
                srcs.append(prev)
                dsts.append(int(d))
                self.send[prev] += size
                self.recv[d] += size
                room[d] -= size
                prev = int(d)
            final = np.flatnonzero(held)
            final = np.concatenate([final, np.array(pick, dtype=np.int64)])
            up_t = np.where(snic[final], _over(self.pers[final] + size, inp.snic_bw[final]), np.inf)
            self._set_persister_fresh(c, int(final[np.argmin(up_t)]))
        self._parts = [(np.array(chunks, np.int64), np.array(srcs, np.int64), np.array(dsts, np.int64))]

    def _set_persister_fresh(self, c: int, node: int) -> None:
        self.persister[c] = node
        self.pers[node] += self.size[c]

    # --- the transfer list -------------------------------------------------------------

    def freeze(self) -> None:
        """Concatenate the transfers of passes 1-2 and index them by chunk."""
        if self._parts:
            ch = np.concatenate([p[0] for p in self._parts])
            src = np.concatenate([p[1] for p in self._parts])
            dst = np.concatenate([p[2] for p in self._parts])
        else:
            ch = src = dst = np.zeros(0, dtype=np.int64)
        spare = PLAN_IMPROVE_MOVES_MAX + 16
        self.t_chunk = np.concatenate([ch, np.zeros(spare, np.int64)])
        self.t_src = np.concatenate([src, np.zeros(spare, np.int64)])
        self.t_dst = np.concatenate([dst, np.zeros(spare, np.int64)])
        self.alive = np.concatenate([np.ones(len(ch), bool), np.zeros(spare, bool)])
        self.nt = len(ch)
        order = np.argsort(ch, kind="stable")
        starts = np.searchsorted(ch[order], np.arange(self.c + 1))
        self._order, self._starts = order, starts
        self._extra: dict[int, list[int]] = {}
        self.tcount = np.bincount(ch, minlength=self.c)  # live transfers (= new holders) per chunk

    def transfers_of(self, c: int) -> list[int]:
        base = self._order[self._starts[c] : self._starts[c + 1]].tolist()
        return [t for t in base + self._extra.get(c, []) if self.alive[t]]

    def holder_mask(self, c: int, trs: list[int]) -> np.ndarray:
        mask = self.pat.class_holders[self.pat.cls[c]].copy()
        mask[self.t_dst[trs]] = True
        return mask

    def _new_transfer(self, c: int, src: int, dst: int) -> None:
        if self.nt == len(self.t_chunk):
            grow = len(self.t_chunk) + 16
            self.t_chunk = np.concatenate([self.t_chunk, np.zeros(grow, np.int64)])
            self.t_src = np.concatenate([self.t_src, np.zeros(grow, np.int64)])
            self.t_dst = np.concatenate([self.t_dst, np.zeros(grow, np.int64)])
            self.alive = np.concatenate([self.alive, np.zeros(grow, bool)])
        t = self.nt
        self.nt += 1
        self.t_chunk[t], self.t_src[t], self.t_dst[t], self.alive[t] = c, src, dst, True
        self._extra.setdefault(c, []).append(t)
        self.tcount[c] += 1
        s = self.size[c]
        self.send[src] += s
        self.recv[dst] += s

    def _drop_transfer(self, t: int) -> None:
        c = int(self.t_chunk[t])
        self.alive[t] = False
        self.tcount[c] -= 1
        s = self.size[c]
        self.send[self.t_src[t]] -= s
        self.recv[self.t_dst[t]] -= s

    def _set_persister(self, c: int, node: int) -> None:
        s = self.size[c]
        self.pers[self.persister[c]] -= s
        self.persister[c] = node
        self.pers[node] += s

    def _move_dst(self, t: int, new: int, trs: list[int]) -> None:
        """Transfer t now delivers to ``new``; the old destination's role (persister, chain source) follows."""
        c, old = int(self.t_chunk[t]), int(self.t_dst[t])
        s = self.size[c]
        self.recv[old] -= s
        self.recv[new] += s
        self.t_dst[t] = new
        if self.persister[c] == old:
            self._set_persister(c, new)
        for u in trs:
            if u != t and self.t_src[u] == old:
                self.t_src[u] = new
                self.send[old] -= s
                self.send[new] += s

    def _removable(self, c: int, t: int, trs: list[int]) -> bool:
        """Dropping t keeps R holders and breaks no chain (the persister is handled by the caller)."""
        d = self.t_dst[t]
        if self.pat.class_hcount[self.pat.cls[c]] + self.tcount[c] - 1 < self.r:
            return False
        return not any(self.t_src[u] == d for u in trs if u != t)

    # --- pass 3: DRAM ------------------------------------------------------------------

    def repair_dram(self) -> None:
        """Nodes over their free DRAM hand received chunks on (or drop copies beyond R), cheapest first."""
        inp = self.inp
        for node in np.flatnonzero(self.recv > self.dram):
            incoming = np.flatnonzero(self.alive[: self.nt] & (self.t_dst[: self.nt] == node))
            incoming = incoming[np.argsort(-self.size[self.t_chunk[incoming]], kind="stable")]
            for t in incoming.tolist():
                if self.recv[node] <= self.dram[node]:
                    break
                c = int(self.t_chunk[t])
                trs = self.transfers_of(c)
                s = self.size[c]
                mask = self.holder_mask(c, trs)
                persists = self.persister[c] == node
                drop = move = (np.inf, -1)
                if self._removable(c, t, trs):
                    if not persists:
                        self._drop_transfer(t)  # a copy beyond R that nobody needs
                        continue
                    others = mask.copy()
                    others[node] = False
                    at = np.where(others, _over(self.pers + s, inp.snic_bw), np.inf)
                    drop = (float(at.min()), int(np.argmin(at)))
                ok = ~mask & (self.dram - self.recv >= s)
                if ok.any():
                    v = _over(self.recv + s, inp.recv_bw)
                    if persists:
                        v = np.maximum(v, _over(self.pers + s, inp.snic_bw))
                    relays = sum(1 for u in trs if u != t and self.t_src[u] == node)
                    if relays:
                        v = np.maximum(v, _over(self.send + relays * s, inp.send_bw))
                    v = np.where(ok, v, np.inf)
                    move = (float(v.min()), int(np.argmin(v)))
                if drop[1] < 0 and move[1] < 0:
                    raise PlanInfeasible(
                        f"cannot stage {self.r} replicas: node {node} got {int(self.recv[node])} bytes for "
                        f"{int(self.dram[node])} bytes of free DRAM and no other node can take a "
                        f"{int(s)}-byte chunk it lacks",
                        proven=False,
                    )
                if drop[1] >= 0 and drop[0] <= move[0]:
                    self._set_persister(c, drop[1])
                    self._drop_transfer(t)
                else:
                    self._move_dst(t, move[1], trs)

    # --- pass 4: local search ----------------------------------------------------------

    def improve(self, floor_s: float) -> None:
        """Move work off the busiest node resource until within ``PLAN_IMPROVE_GAP`` of ``floor_s``."""
        inp = self.inp
        stop = floor_s * (1 + PLAN_IMPROVE_GAP)
        for _ in range(PLAN_IMPROVE_MOVES_MAX):
            times = np.stack([_times(self.send, inp.send_bw), _times(self.recv, inp.recv_bw),
                              _times(self.pers, inp.snic_bw)])
            kind, b = np.unravel_index(int(np.argmax(times)), times.shape)
            cur = float(times[kind, b])
            if cur <= stop:
                return
            limit = cur * (1 - _TOL) if np.isfinite(cur) else np.finfo(np.float64).max  # inf: any finite move
            if not (self._off_send, self._off_recv, self._off_persist)[kind](int(b), limit):
                return
            self.moves += 1

    def _candidates(self, items: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """A few items of varied size: the largest, the smallest and some between."""
        if len(items) <= PLAN_IMPROVE_CANDIDATES:
            return items
        order = np.argsort(-sizes, kind="stable")
        pick = np.unique(np.linspace(0, len(items) - 1, PLAN_IMPROVE_CANDIDATES).round().astype(np.int64))
        return items[order[pick]]

    def _masks(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
        """Original holders (m, N), all holders (m, N) and live transfers of each chunk."""
        orig = self.pat.class_holders[self.pat.cls[chunks]]
        full = orig.copy()
        trs = []
        for row, c in enumerate(chunks.tolist()):
            t = self.transfers_of(c) if self.tcount[c] else []
            trs.append(t)
            if t:
                full[row, self.t_dst[t]] = True
        return orig, full, trs

    def _off_persist(self, b: int, limit: float) -> bool:
        inp = self.inp
        mine = np.flatnonzero(self.persister == b)
        if not len(mine):
            return False
        chunks = self._candidates(mine, self.size[mine])
        s = self.size[chunks][:, None]
        orig, full, trs = self._masks(chunks)
        full[:, b] = False  # b gives the chunk away
        # Hand it to another holder: only that holder's S-NIC changes.
        hand = np.where(full, _over(self.pers + s, inp.snic_bw), np.inf)
        # Or copy it from the least busy original holder to a node with room, which persists it.
        src = np.where(orig, _over(self.send + s, inp.send_bw), np.inf)
        h = np.argmin(src, axis=1)
        room = ~full & (self.dram - self.recv >= s)
        room[:, b] = False
        dst = np.where(room, np.maximum(_over(self.recv + s, inp.recv_bw), _over(self.pers + s, inp.snic_bw)), np.inf)
        j = np.argmin(dst, axis=1)
        rows = np.arange(len(chunks))
        stage = np.maximum(src[rows, h], dst[rows, j])
        hand_j = np.argmin(hand, axis=1)
        hand_v = hand[rows, hand_j]
        r_hand, r_stage = int(np.argmin(hand_v)), int(np.argmin(stage))
        if min(hand_v[r_hand], stage[r_stage]) >= limit:
            return False
        if hand_v[r_hand] <= stage[r_stage]:
            c, to, x = int(chunks[r_hand]), int(hand_j[r_hand]), trs[r_hand]
            self._set_persister(c, to)
            for t in x:  # the copy b received only to persist it may now be unneeded
                if self.t_dst[t] == b and self._removable(c, t, x):
                    self._drop_transfer(t)
                    break
        else:
            c = int(chunks[r_stage])
            self._new_transfer(c, int(h[r_stage]), int(j[r_stage]))
            self._set_persister(c, int(j[r_stage]))
        return True

    def _transfer_candidates(self, live: np.ndarray):
        ts = self._candidates(live, self.size[self.t_chunk[live]])
        chunks = self.t_chunk[ts]
        orig, full, trs = self._masks(chunks)
        return ts, chunks, self.size[chunks][:, None], orig, full, trs

    def _drop_options(self, ts, chunks, full, trs, s) -> tuple[float, tuple | None]:
        """Best drop of a copy beyond R: free (-inf) unless its node persists the chunk (then re-home it)."""
        best: tuple[float, tuple | None] = (np.inf, None)
        for row, t in enumerate(ts.tolist()):
            c = int(chunks[row])
            if not self._removable(c, t, trs[row]):
                continue
            d = int(self.t_dst[t])
            if self.persister[c] != d:
                return -np.inf, ("drop", t, -1, trs[row])
            others = full[row].copy()
            others[d] = False
            at = np.where(others, _over(self.pers + s[row], self.inp.snic_bw), np.inf)
            j = int(np.argmin(at))
            if at[j] < best[0]:
                best = (float(at[j]), ("drop", t, j, trs[row]))
        return best

    def _off_send(self, b: int, limit: float) -> bool:
        inp = self.inp
        live = np.flatnonzero(self.alive[: self.nt] & (self.t_src[: self.nt] == b))
        ts, chunks, s, orig, full, trs = self._transfer_candidates(live)
        best = self._drop_options(ts, chunks, full, trs, s)
        if best[0] > -np.inf:
            orig = orig.copy()
            orig[:, b] = False
            src = np.where(orig, _over(self.send + s, inp.send_bw), np.inf)  # another original holder sends
            h = np.argmin(src, axis=1)
            v = src[np.arange(len(ts)), h]
            r = int(np.argmin(v)) if len(v) else 0
            if len(v) and v[r] < best[0]:
                best = (float(v[r]), ("src", int(ts[r]), int(h[r]), trs[r]))
        return best[0] < limit and self._apply_transfer_move(best[1])

    def _off_recv(self, b: int, limit: float) -> bool:
        inp = self.inp
        live = np.flatnonzero(self.alive[: self.nt] & (self.t_dst[: self.nt] == b))
        ts, chunks, s, orig, full, trs = self._transfer_candidates(live)
        best = self._drop_options(ts, chunks, full, trs, s)
        if best[0] > -np.inf and len(ts):
            # Or deliver to another node with room; it takes over b's role for the chunk.
            persists = (self.persister[chunks] == b)[:, None]
            relays = np.array([sum(1 for u in x if u != t and self.t_src[u] == b) for t, x in zip(ts.tolist(), trs)],
                              dtype=np.float64)[:, None]
            room = ~full & (self.dram - self.recv >= s)
            v = _over(self.recv + s, inp.recv_bw)
            v = np.where(persists, np.maximum(v, _over(self.pers + s, inp.snic_bw)), v)
            v = np.where(relays > 0, np.maximum(v, _over(self.send + relays * s, inp.send_bw)), v)
            v = np.where(room, v, np.inf)
            j = np.argmin(v, axis=1)
            vv = v[np.arange(len(ts)), j]
            r = int(np.argmin(vv))
            if vv[r] < best[0]:
                best = (float(vv[r]), ("dst", int(ts[r]), int(j[r]), trs[r]))
        return best[0] < limit and self._apply_transfer_move(best[1])

    def _apply_transfer_move(self, move) -> bool:
        if move is None:
            return False
        op, t, j, trs = move
        c = int(self.t_chunk[t])
        if op == "src":
            s = self.size[c]
            self.send[self.t_src[t]] -= s
            self.send[j] += s
            self.t_src[t] = j
        elif op == "drop":
            if j >= 0:
                self._set_persister(c, j)
            self._drop_transfer(t)
        else:
            self._move_dst(t, j, trs)
        return True

    # --- result ------------------------------------------------------------------------

    def transfers(self) -> np.ndarray:
        """(K, 3) live transfers (chunk, src, dst), sorted by chunk, each chunk's in runnable order."""
        live = np.flatnonzero(self.alive[: self.nt])
        out = np.stack([self.t_chunk[live], self.t_src[live], self.t_dst[live]], axis=1)
        return out[np.argsort(out[:, 0], kind="stable")]


def assign(inp: PlanInput, pat: Pattern, sol: LpSolution, floor_s: float) -> Rounding:
    """The chunk-level plan of a round (canonical order); ``floor_s``: stop improving below this."""
    rnd = Rounding(inp, pat)
    rnd.persist_routes(sol)
    rnd.replicas()
    rnd.freeze()
    try:
        rnd.repair_dram()
    except PlanInfeasible:  # the LP-guided plan does not pack: start over, DRAM first
        rnd = Rounding(inp, pat)
        rnd.dram_first()
        rnd.freeze()
    rnd.improve(floor_s)
    return rnd
