"""What goes into the grouped-write planner (``PlanInput``) and what comes out (``Plan``).

Both are array-based: a checkpoint round of a large job has tens of thousands
of unique chunks, and the planner must answer in well under 0.1 s, so chunks
are rows of numpy arrays, never one Python object each.  ``PlanInput.build``
and ``Plan.chunk`` give the per-chunk view for small callers and tests.
"""

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._errors import NoSpace
from ._node import NodeSpec


class PlanInfeasible(NoSpace):
    """No plan for the round: not enough free DRAM on non-holders to reach
    ``replicas`` copies, or no bandwidth to persist with.  ``proven`` is True
    when the LP relaxation itself is infeasible (so no plan exists at all),
    False when only the rounding failed (chunk sizes do not pack into the
    free DRAM).  The caller decides what to do (wait for persist to free
    DRAM, fewer replicas)."""

    def __init__(self, message: str = "", *, proven: bool = True):
        super().__init__(message)
        self.proven = proven


def _vector(name: str, value, n: int | None, dtype) -> np.ndarray:
    arr = np.array(value, dtype=dtype)  # a private copy: the caller may reuse its buffer
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        raise ValueError(f"{name} must be a vector of {n if n is not None else 'N'} values, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0")
    if dtype is np.float64:
        arr[arr < 1.0] = 0.0  # below a byte per second is no bandwidth (and no overflow in load / bw)
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class PlanInput:
    """One grouped-write round, after dedup.

    Nodes are ``0..N-1``.  Chunk ``c`` (a unique BLAKE3 hash of the round) has
    ``chunk_bytes[c]`` bytes and is already in the DRAM of every node ``i``
    with ``holders[c, i]`` (its writers: several when DP replicas wrote the
    same bytes).  Every chunk must end up in the DRAM of ``replicas`` distinct
    nodes and be persisted exactly once, by a node that holds it.
    """

    send_bw: np.ndarray  # (N,) bytes/s (below 1 byte/s counts as 0: no bandwidth)
    recv_bw: np.ndarray  # (N,) bytes/s
    snic_bw: np.ndarray  # (N,) bytes/s
    dram_free_bytes: np.ndarray  # (N,) int64
    backend_bw: float  # aggregate backend bandwidth cap, bytes/s
    replicas: int
    chunk_bytes: np.ndarray  # (C,) int64, each > 0
    holders: np.ndarray  # (C, N) bool, each row has at least one True

    def __post_init__(self):
        send = _vector("send_bw", self.send_bw, None, np.float64)
        n = send.shape[0]
        if n < 1:
            raise ValueError("a plan needs at least one node")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("send_bw", send)
        set_("recv_bw", _vector("recv_bw", self.recv_bw, n, np.float64))
        set_("snic_bw", _vector("snic_bw", self.snic_bw, n, np.float64))
        set_("dram_free_bytes", _vector("dram_free_bytes", self.dram_free_bytes, n, np.int64))
        backend = float(self.backend_bw)
        if not (backend > 0 and np.isfinite(backend)):
            raise ValueError(f"backend_bw must be a positive number of bytes/s, got {self.backend_bw!r}")
        set_("backend_bw", backend)
        if isinstance(self.replicas, bool) or int(self.replicas) != self.replicas or self.replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        set_("replicas", int(self.replicas))
        if self.replicas > n:
            raise ValueError(
                f"replicas={self.replicas} needs {self.replicas} distinct nodes per chunk, "
                f"but the round has only {n} node{'s' if n != 1 else ''}"
            )
        sizes = np.array(self.chunk_bytes, dtype=np.int64).reshape(-1)
        if np.any(sizes <= 0):
            raise ValueError("every chunk must have a positive size")
        sizes.flags.writeable = False
        set_("chunk_bytes", sizes)
        holders = np.array(self.holders, dtype=bool)
        if sizes.shape[0] == 0:
            holders = holders.reshape(0, n)
        if holders.shape != (sizes.shape[0], n):
            raise ValueError(f"holders must have shape (chunks, nodes) = {(sizes.shape[0], n)}, got {holders.shape}")
        if not np.all(holders.any(axis=1)):
            raise ValueError(f"chunk {int(np.argmin(holders.any(axis=1)))} has no holder")
        holders.flags.writeable = False
        set_("holders", holders)

    @property
    def nodes(self) -> int:
        return self.send_bw.shape[0]

    @property
    def chunks(self) -> int:
        return self.chunk_bytes.shape[0]

    @property
    def unique_bytes(self) -> int:
        return int(self.chunk_bytes.sum())

    @classmethod
    def build(
        cls,
        nodes: Sequence[NodeSpec],
        *,
        backend_bw: float,
        replicas: int,
        chunks: Iterable[tuple[int, Iterable[int]]],
    ) -> "PlanInput":
        """From per-node specs and ``(size, holder nodes)`` pairs, one per unique chunk."""
        chunks = list(chunks)
        holders = np.zeros((len(chunks), len(nodes)), dtype=bool)
        for c, (_, hs) in enumerate(chunks):
            hs = list(hs)
            if any(not 0 <= h < len(nodes) for h in hs):
                raise ValueError(f"chunk {c}: holder out of range 0..{len(nodes) - 1}: {hs}")
            holders[c, hs] = True
        return cls(  # the dtypes __post_init__ converts to
            send_bw=np.array([n.send_bw for n in nodes], dtype=np.float64),
            recv_bw=np.array([n.recv_bw for n in nodes], dtype=np.float64),
            snic_bw=np.array([n.snic_bw for n in nodes], dtype=np.float64),
            dram_free_bytes=np.array([n.dram_free_bytes for n in nodes], dtype=np.int64),
            backend_bw=backend_bw,
            replicas=replicas,
            chunk_bytes=np.array([size for size, _ in chunks], dtype=np.int64),
            holders=holders,
        )


@dataclass(frozen=True)
class ChunkAssignment:
    """One chunk's part of a plan: copy it along ``stage_targets`` (in order;
    a destination may be the source of a later pair), then ``persister`` uploads it."""

    stage_targets: tuple[tuple[int, int], ...]
    persister: int


@dataclass(frozen=True, eq=False)
class Plan:
    """The plan of one round, in the caller's chunk order.

    Times use the planner's model (see ``aiturbofs.planner``): every node
    resource and the backend work concurrently, so a node's time is its
    busiest resource and ``makespan_s`` the busiest of all.
    """

    persister: np.ndarray  # (C,) int32: the node that uploads chunk c
    transfers: np.ndarray  # (K, 3) int32 rows (chunk, src, dst), grouped by chunk, runnable in order
    bytes_sent: np.ndarray  # (N,) int64 over the fabric
    bytes_received: np.ndarray  # (N,) int64 over the fabric (= DRAM taken this round)
    bytes_persisted: np.ndarray  # (N,) int64 through the S-NIC
    makespan_s: float  # of this (integral) plan
    lp_bound_s: float  # the node-level LP optimum: no plan can be faster
    solve_s: float  # wall time the planner spent on this round
    lp_s: float = 0.0  # of which the LP (0 on a cache hit or with one node)
    cached: bool = False  # the assignment was reused from an identical earlier round
    bottleneck: str = ""  # the resource that sets makespan_s: "backend", "persist@3", "send@0", "recv@5"
    _starts: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        counts = np.bincount(self.transfers[:, 0], minlength=self.persister.shape[0]) if len(self.transfers) else (
            np.zeros(self.persister.shape[0], dtype=np.int64))
        starts = np.zeros(self.persister.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        object.__setattr__(self, "_starts", starts)
        for arr in (self.persister, self.transfers, self.bytes_sent, self.bytes_received, self.bytes_persisted):
            arr.flags.writeable = False

    @property
    def chunks(self) -> int:
        return self.persister.shape[0]

    @property
    def ratio(self) -> float:
        """Achieved makespan over the LP lower bound (1.0 is optimal)."""
        return self.makespan_s / self.lp_bound_s if self.lp_bound_s > 0 else 1.0

    def stage_targets(self, chunk: int) -> tuple[tuple[int, int], ...]:
        rows = self.transfers[self._starts[chunk] : self._starts[chunk + 1]]
        return tuple((int(s), int(d)) for _, s, d in rows)

    def chunk(self, chunk: int) -> ChunkAssignment:
        return ChunkAssignment(self.stage_targets(chunk), int(self.persister[chunk]))

    def __iter__(self) -> Iterator[ChunkAssignment]:
        return (self.chunk(c) for c in range(self.chunks))
